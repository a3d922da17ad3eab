#!/usr/bin/env python3
"""Scaling: TFLOP/s per GPU and iteration time vs GPU count.

Runs `dssim scenario FILE --gpus N` for each N (data parallelism absorbs the change, so tp·pp must
divide N; other counts are skipped with a note), with the analytic backend, the simulator, or both,
or reads JSON reports given on the command line. Left: model and hardware TFLOP/s per GPU (MFU in
the labels). Right: iteration time, with the ideal line (time ∝ 1/N from the smallest count).

  plots/scaling.py --dssim build/dssim --scenario scenarios/gpt175b.yaml \\
      --gpus 512 1024 2048 4096 8192 --backend both -o scaling.png
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (selects the Agg backend)
from common import MARKERS, SERIES, plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator  # noqa: E402

BACKEND_LABELS = {"analytic": "analytic", "sim": "simulator (SimGrid)", "cpu": "measured (CPU)",
                  "cuda": "measured (CUDA)"}


@dataclass(frozen=True)
class ScalingPoint:
    gpus: int
    dp: int
    iteration_seconds: float
    model_tflops: float
    hardware_tflops: float
    mfu: float


def scaling_points(reports: list[dict]) -> dict[str, list[ScalingPoint]]:
    """Reports -> {backend: points sorted by GPU count}; one point per GPU count and backend."""
    out: dict[str, dict[int, ScalingPoint]] = {}
    for r in reports:
        c, t = r["config"], r["throughput"]
        pt = ScalingPoint(int(c["gpus"]), int(c["dp"]), float(t["iteration_seconds"]),
                          float(t["model_tflops_per_gpu"]), float(t["hardware_tflops_per_gpu"]), float(t["mfu"]))
        series = out.setdefault(r.get("backend", "analytic"), {})
        if pt.gpus in series:
            raise ValueError(f"two {r.get('backend')} reports for {pt.gpus} GPUs")
        series[pt.gpus] = pt
    return {b: [s[g] for g in sorted(s)] for b, s in out.items()}


def valid_gpu_counts(counts: list[int], tp: int, pp: int) -> tuple[list[int], list[int]]:
    """(counts that tp·pp divides, the rest)."""
    ok = [n for n in counts if n % (tp * pp) == 0]
    return ok, [n for n in counts if n not in ok]


def plot_scaling(reports: list[dict], out: str | Path, title: str | None = None) -> Path:
    series = scaling_points(reports)
    if not series:
        raise ValueError("no reports to plot")
    common.apply_style()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.4))
    fig.subplots_adjust(left=0.06, right=0.985, top=0.83, bottom=0.11, wspace=0.18)
    all_gpus = sorted({p.gpus for pts in series.values() for p in pts})
    for i, (backend, pts) in enumerate(series.items()):
        colour, marker = SERIES[i % len(SERIES)], MARKERS[i % len(MARKERS)]
        lab = BACKEND_LABELS.get(backend, backend)
        g = [p.gpus for p in pts]
        # Later series are drawn thinner on top, so coinciding backends stay visible.
        lw, ms = (4.5, 9) if i == 0 and len(series) > 1 else (1.6, 6)
        alpha = 0.55 if i == 0 and len(series) > 1 else 1.0
        style = dict(marker=marker, color=colour, linewidth=lw, markersize=ms, alpha=alpha)
        ax1.plot(g, [p.model_tflops for p in pts], label=f"model FLOPs, {lab}", **style)
        ax1.plot(g, [p.hardware_tflops for p in pts], linestyle="--", markerfacecolor="white",
                 label=f"hardware FLOPs (with recompute), {lab}", **style)
        ax2.plot(g, [p.iteration_seconds for p in pts], label=lab, **style)
        if i == 0:
            for p in pts:
                ax1.annotate(f"MFU {p.mfu:.0%}", (p.gpus, p.model_tflops), textcoords="offset points",
                             xytext=(0, -15), ha="center", fontsize=8, color=colour)
            base = pts[0]
            ax2.plot(g, [base.iteration_seconds * base.gpus / n for n in g], color=common.COLORS["reference"],
                     linestyle=":", linewidth=1.4, label=f"ideal (time ∝ 1/GPUs from {base.gpus})")
            for p in pts:
                ax2.annotate(f"dp {p.dp}", (p.gpus, p.iteration_seconds), textcoords="offset points",
                             xytext=(7, 5), ha="left", va="bottom", fontsize=8, color="#555555")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_gpus)
        ax.set_xticklabels([str(n) for n in all_gpus])
        ax.minorticks_off()
        ax.set_xlim(all_gpus[0] / 1.3, all_gpus[-1] * 1.3)
        ax.set_xlabel("GPUs")
    ax1.set_ylim(0, None)
    top = max(p.hardware_tflops for pts in series.values() for p in pts)
    ax1.set_ylim(0, top * 1.25)
    ax1.set_ylabel("achieved TFLOP/s per GPU")
    ax1.set_title("Throughput per GPU")
    ax1.legend(loc="lower left", fontsize=8.5)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax2.yaxis.set_minor_locator(NullLocator())
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax2.set_ylabel("iteration time (s, log scale)")
    ax2.set_title("Iteration time (global batch fixed)")
    ax2.legend(loc="upper right", fontsize=8.5)
    r0 = reports[0]
    c = r0["config"]
    p0 = next(iter(series.values()))[0]
    peak = p0.model_tflops / p0.mfu if p0.mfu > 0 else float("nan")
    fig.suptitle(title or f"Scaling: {common.scenario_name(r0)}", x=0.06, ha="left", fontweight="bold",
                 fontsize=12.5)
    fig.text(0.06, 0.9, f"{c['parameters'] / 1e9:.3g}B params on {c.get('gpu', '?')}, tp {c['tp']} · pp {c['pp']} "
             f"fixed, data parallelism grows with the GPU count; global batch {c['global_batch']}, micro-batch "
             f"{c['micro_batch']}, ZeRO-{c['zero_stage']}, recompute {c['recompute']}; MFU against "
             f"{peak:.0f} TFLOP/s peak",
             fontsize=9, color="#444444")
    return common.save(fig, out)


def run_scaling(dssim: str, scenario: str, gpus: list[int], backends: list[str], sets: list[str]) -> list[dict]:
    probe = common.run_dssim(dssim, common.scenario_args(scenario, sets))
    ok, skipped = valid_gpu_counts(gpus, int(probe["config"]["tp"]), int(probe["config"]["pp"]))
    if skipped:
        print(f"scaling: skipping {skipped}: tp·pp = {probe['config']['tp'] * probe['config']['pp']} "
              f"does not divide them", file=sys.stderr)
    return [common.run_dssim(dssim, common.scenario_args(scenario, sets, gpus=n, backend=b))
            for b in backends for n in ok]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="*", help="JSON reports (dssim scenario --json) at several GPU counts")
    p.add_argument("-o", "--output", default="scaling.png", help="PNG to write")
    p.add_argument("--scenario", help="run dssim on this scenario at each GPU count")
    p.add_argument("--gpus", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192], help="GPU counts")
    p.add_argument("--backend", choices=["analytic", "sim", "both"], default="analytic")
    p.add_argument("--set", action="append", default=[], help="scenario override (repeatable)")
    p.add_argument("--dssim", default=common.default_dssim(), help="dssim binary (default: $DSSIM or build/dssim)")
    p.add_argument("--title", help="plot title")
    a = p.parse_args(argv)
    if bool(a.reports) == bool(a.scenario):
        p.error("give either REPORTS or --scenario")
    if a.scenario:
        backends = ["analytic", "sim"] if a.backend == "both" else [a.backend]
        reports = run_scaling(a.dssim, a.scenario, a.gpus, backends, a.set)
    else:
        reports = [common.load_json(f) for f in a.reports]
    print(plot_scaling(reports, a.output, a.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Planner sweep: the best configuration per GPU count, from `dssim plan FILE --gpus A..B --json`.

Left axis: tokens/s per GPU of the best configuration at each GPU count (weak throughput per GPU;
flat means perfect scaling). Right axis: its MFU. Each point is annotated with the winning layout
(TP · PP · DP, micro-batch, ZeRO stage, recompute, offload); a GPU count where nothing fits is
marked on the x axis. The best GPU count under the plan's objective is drawn larger.

  plots/plan_sweep.py --dssim build/dssim --scenario scenarios/gpt13b_zero2.yaml --gpus 16..512 \\
      --vary tp,pp,micro_batch,zero,recompute -o plan_sweep.png
  plots/plan_sweep.py PLAN.json -o plan_sweep.png        # a saved `dssim plan --gpus A..B --json`
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (selects the Agg backend)
from common import SERIES, plt  # noqa: E402

OFFLOAD = {"none": "", "optimizer": " opt-off", "optimizer+params": " opt+param-off"}
RECOMPUTE = {"none": "", "selective": " sel-rc", "full": " full-rc"}


@dataclass(frozen=True)
class SweepPoint:
    gpus: int
    fits: bool
    tokens_per_gpu: float = 0.0   # tokens/s per GPU of the best configuration
    mfu: float = 0.0
    layout: str = ""              # short label of the winning layout
    key: str = ""
    best: bool = False            # the best GPU count under the objective


def layout_label(config: dict) -> str:
    """'TP2 PP1 DP64\\nmb 4 ZeRO-3' (plus v, SP, EP, recompute and offload when used)."""
    c = config
    top = f"TP{c['tp']} PP{c['pp']} DP{c['dp']}"
    if c.get("ep", 1) > 1:
        top += f" EP{c['ep']}"
    if c.get("interleave", 1) > 1:
        top += f" v{c['interleave']}"
    if c.get("sequence_parallel"):
        top += " SP"
    bottom = (f"mb {c['micro_batch']} ZeRO-{c['zero_stage']}" + RECOMPUTE.get(c.get("recompute", "none"), "")
              + OFFLOAD.get(c.get("offload", "none"), ""))
    return f"{top}\n{bottom}"


def sweep_points(doc: dict) -> list[SweepPoint]:
    """A `dssim plan --json` document -> one point per GPU count, sorted by GPU count."""
    if doc.get("schema") != "dssim.plan/1":
        raise ValueError(f"not a dssim plan --json document (schema {doc.get('schema')!r})")
    best = doc.get("best") or {}
    out: dict[int, SweepPoint] = {}
    for i, plan in enumerate(doc["plans"]):
        gpus = int(plan["gpus"])
        if gpus in out:
            raise ValueError(f"two plans for {gpus} GPUs")
        ranked = plan.get("ranked") or []
        if not ranked:
            out[gpus] = SweepPoint(gpus, False)
            continue
        e = ranked[0]
        out[gpus] = SweepPoint(gpus, True, float(e["tokens_per_second"]) / gpus, float(e["mfu"]),
                               layout_label(e["config"]), e["key"], best.get("plan_index") == i)
    return [out[g] for g in sorted(out)]


def plot_sweep(doc: dict, out: str | Path, title: str | None = None) -> Path:
    pts = sweep_points(doc)
    fitting = [p for p in pts if p.fits]
    if not fitting:
        raise ValueError("nothing fits at any GPU count of the sweep")
    common.apply_style()
    fig, ax = plt.subplots(figsize=(11, 5.8))
    fig.subplots_adjust(left=0.08, right=0.92, top=0.84, bottom=0.11)
    ax2 = ax.twinx()
    g = [p.gpus for p in fitting]
    tok, mfu = [p.tokens_per_gpu for p in fitting], [p.mfu for p in fitting]
    c_tok, c_mfu = SERIES[0], SERIES[1]
    ax.plot(g, tok, marker="o", color=c_tok, linewidth=2, markersize=7, label="tokens/s per GPU (left)")
    ax2.plot(g, [100 * m for m in mfu], marker="s", color=c_mfu, linewidth=1.4, linestyle="--", markersize=6,
             markerfacecolor="white", label="MFU (right)")
    for p in fitting:
        if p.best:
            ax.plot([p.gpus], [p.tokens_per_gpu], marker="*", color=c_tok, markersize=17, linestyle="none",
                    label=f"best GPU count ({doc.get('objective', 'throughput')})")
    all_gpus = [p.gpus for p in pts]
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_gpus)
    ax.set_xticklabels([str(n) for n in all_gpus])
    ax.minorticks_off()
    ax.set_xlim(all_gpus[0] / 1.5, all_gpus[-1] * 1.5)
    ax.set_ylim(0, max(tok) * 1.45)
    ax2.set_ylim(0, 100)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s per GPU (best configuration)")
    ax2.set_ylabel("MFU of the best configuration (%)")
    ax2.grid(False)
    for p in pts:
        if not p.fits:
            ax.plot([p.gpus], [0], marker="x", color=common.COLORS["capacity"], markersize=10, clip_on=False,
                    linestyle="none")
            ax.annotate("nothing fits", (p.gpus, 0), textcoords="offset points", xytext=(0, 8), ha="center",
                        fontsize=8, color=common.COLORS["capacity"])
    # the winning layout above each point, alternating height where neighbours would collide
    for i, p in enumerate(fitting):
        ax.annotate(p.layout, (p.gpus, p.tokens_per_gpu), textcoords="offset points",
                    xytext=(0, 12 + (22 if i % 2 else 0)), ha="center", va="bottom", fontsize=7.5, color="#333333",
                    linespacing=1.1)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower left", fontsize=8.5)
    name = doc.get("scenario", {}).get("name", "scenario")
    fig.suptitle(title or f"Planner sweep: {name}, best configuration per GPU count", x=0.08, ha="left",
                 fontweight="bold", fontsize=12.5)
    plan0 = doc["plans"][0]
    scored = sum(int(pl["counts"]["scored"]) for pl in doc["plans"])
    fig.text(0.08, 0.895, f"`dssim plan --gpus {all_gpus[0]}..{all_gpus[-1]}`: global batch {plan0['global_batch']}, "
             f"objective {doc.get('objective', 'throughput')}, {scored} configurations scored over "
             f"{len(pts)} GPU counts{' (exact)' if doc.get('exact') else ''}", fontsize=9, color="#444444")
    return common.save(fig, out)


def run_sweep(dssim: str, scenario: str, gpus: str, extra: list[str]) -> dict:
    """`dssim plan SCENARIO --gpus A..B --top 1 EXTRA --json` (exit 3, nothing fits, still gives JSON)."""
    return common.run_dssim(dssim, ["plan", common.resolve_scenario(scenario), "--gpus", gpus, "--top", "1", *extra])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan_json", nargs="?", help="a saved `dssim plan --gpus A..B --json`")
    p.add_argument("-o", "--output", default="plan_sweep.png", help="PNG to write")
    p.add_argument("--scenario", help="run `dssim plan` on this scenario")
    p.add_argument("--gpus", default="16..512", help="GPU range A..B (A, 2A, ... B)")
    p.add_argument("--vary", help="dimensions to search (dssim plan --vary)")
    p.add_argument("--dssim", default=common.default_dssim(), help="dssim binary (default: $DSSIM or build/dssim)")
    p.add_argument("--title", help="plot title")
    a = p.parse_args(argv)
    if bool(a.plan_json) == bool(a.scenario):
        p.error("give either PLAN_JSON or --scenario")
    doc = (run_sweep(a.dssim, a.scenario, a.gpus, ["--vary", a.vary] if a.vary else [])
           if a.scenario else common.load_json(a.plan_json))
    print(plot_sweep(doc, a.output, a.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())

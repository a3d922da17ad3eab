#!/usr/bin/env python3
"""What-ifs: iteration time vs one GPU's slowdown, and goodput vs checkpoint interval.

Left: `dssim scenario S --backend sim --what-if "slow-gpu RANK xF" --json` for each F (the clean
run at F = 1), with the two bounds: the clean iteration, and every GPU at F (the whole iteration
x 1/F). Right: `dssim scenario S --reliability --set reliability.checkpoint_interval=T --json`
for intervals around Daly's optimum: the closed form and the Monte-Carlo, Daly's interval marked.

  plots/what_if.py --dssim build/dssim --scenario scenarios/gpt13b_zero2.yaml --rank 17 \\
      --factors 1 0.9 0.8 0.7 0.6 0.5 --set reliability.failures_per_gpu_hour=5e-3 -o what_if.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (selects the Agg backend)
from common import SERIES, plt  # noqa: E402


def slowdown_points(dssim: str, scenario: str, rank: int, factors: list[float]) -> list[tuple[float, float, float]]:
    """[(F, iteration seconds, clean seconds)] for one slow GPU at each factor F."""
    out = []
    for f in factors:
        args = common.scenario_args(scenario, backend="sim") + ["--what-if", f"slow-gpu {rank} x{f:g}"]
        r = common.run_dssim(dssim, args)
        w = r["extras"]["what_if"]
        out.append((f, float(w["iteration_seconds"]), float(w["clean_iteration_seconds"])))
    return out


def goodput_points(dssim: str, scenario: str, scales: list[float], sets: list[str] = (), samples: int = 100
                   ) -> tuple[list[tuple[float, float, float]], dict]:
    """[(interval s, closed form, Monte-Carlo)] at scales x Daly's interval, and the auto report."""
    base = common.scenario_args(scenario, sets=[f"reliability.samples={samples}", *sets], backend="analytic")
    base.append("--reliability")
    auto = common.run_dssim(dssim, base)["extras"]["reliability"]
    daly = float(auto["daly_interval_seconds"])
    pts = []
    for s in scales:
        g = common.run_dssim(dssim, base + ["--set", f"reliability.checkpoint_interval={s * daly:.6g} s"])["extras"]["reliability"]
        pts.append((float(g["checkpoint_interval_seconds"]), float(g["goodput"]), float(g["monte_carlo"]["goodput"])))
    return pts, auto


def plot_what_if(slow: list[tuple[float, float, float]], good: list[tuple[float, float, float]], auto: dict,
                 out: str | Path, title: str, rank: int) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    fs = [p[0] for p in slow]
    clean = slow[0][2]
    a.plot([1 / f for f in fs], [p[1] for p in slow], marker="o", color=SERIES[0], label=f"rank {rank} at speed F (simulated)")
    a.plot([1 / f for f in fs], [clean / f for f in fs], ls="--", color=SERIES[3], label="every GPU at speed F")
    a.axhline(clean, ls=":", color="grey", label="clean run")
    a.set_xlabel("one GPU's kernel-time factor 1/F")
    a.set_ylabel("iteration time (s)")
    a.set_title("one slow GPU")
    a.legend(fontsize=8)
    xs = [p[0] / 60 for p in good]
    b.plot(xs, [100 * p[1] for p in good], marker="o", color=SERIES[0], label="closed form (Daly)")
    b.plot(xs, [100 * p[2] for p in good], marker="x", ls="", color=SERIES[1], label=f"Monte-Carlo ({auto['monte_carlo']['jobs']} jobs)")
    b.axvline(float(auto["daly_interval_seconds"]) / 60, ls=":", color="grey", label="Daly's optimum")
    b.set_xscale("log")
    b.set_xlabel("checkpoint interval (min)")
    b.set_ylabel("goodput (%)")
    mtbf = auto["mtbf_seconds"]
    b.set_title(f"goodput: a failure every {mtbf / 3600:.1f} h, checkpoint {auto['checkpoint_seconds']:.1f} s"
                if mtbf else "goodput")
    b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return common.save(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="scenarios/gpt13b_zero2.yaml", help="scenario to run")
    p.add_argument("--rank", type=int, default=17, help="the slow GPU")
    p.add_argument("--factors", type=float, nargs="+", default=[1, 0.9, 0.8, 0.7, 0.6, 0.5], help="speed factors F")
    p.add_argument("--scales", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1, 2, 4, 8],
                   help="checkpoint intervals as multiples of Daly's")
    p.add_argument("--set", dest="sets", action="append", default=[],
                   help="reliability keys for the goodput panel, e.g. reliability.failures_per_gpu_hour=5e-3")
    p.add_argument("-o", "--output", default="what_if.png", help="PNG to write")
    p.add_argument("--dssim", default=common.default_dssim(), help="dssim binary (default: $DSSIM or build/dssim)")
    a = p.parse_args(argv)
    if 1 not in a.factors:
        a.factors = [1.0] + a.factors
    slow = slowdown_points(a.dssim, a.scenario, a.rank, sorted(a.factors, reverse=True))
    good, auto = goodput_points(a.dssim, a.scenario, a.scales, a.sets)
    print(plot_what_if(slow, good, auto, a.output, Path(a.scenario).stem, a.rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())

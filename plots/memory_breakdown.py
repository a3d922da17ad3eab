#!/usr/bin/env python3
"""Memory per GPU for ZeRO stages 0–3: stacked bars by category with the GPU capacity line.

The categories are the report's `memory_bytes` (params, grads, optimizer, activations,
comm_buffers, temporaries; their sum is `memory_bytes.total`). Either the script runs dssim once
per stage (`--set zero.stage=K` on a scenario with pp = 1, since ZeRO-2/3 need it), or it reads
reports given as JSON files (`dssim scenario ... --json > z0.json`).

  plots/memory_breakdown.py --dssim build/dssim --scenario scenarios/gpt13b_zero2.yaml -o mem.png
  plots/memory_breakdown.py z0.json z1.json z2.json z3.json -o mem.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (selects the Agg backend)
from common import COLORS, GIB, plt  # noqa: E402

# Report key -> (legend label, colour key), bottom of the stack first.
CATEGORIES = [
    ("params", "parameters", "params"),
    ("grads", "gradients", "grads"),
    ("optimizer", "optimizer states", "optimizer_states"),
    ("activations", "activations", "activations"),
    ("comm_buffers", "communication buffers", "comm_buffers"),
    ("temporaries", "temporaries", "temporaries"),
]
STAGE_NAMES = {0: "no ZeRO", 1: "optimizer states\npartitioned", 2: "+ gradients\npartitioned",
               3: "+ parameters\npartitioned"}


def memory_stack(report: dict, rel_tol: float = 1e-6) -> list[tuple[str, float]]:
    """[(category, bytes)] in stacking order; raises ValueError if they do not sum to the total."""
    mem = report["memory_bytes"]
    missing = [k for k, _, _ in CATEGORIES if k not in mem]
    if missing:
        raise ValueError(f"memory_bytes lacks {missing}")
    stack = [(k, float(mem[k])) for k, _, _ in CATEGORIES]
    total = float(mem["total"])
    s = sum(v for _, v in stack)
    if abs(s - total) > rel_tol * max(total, 1.0):
        raise ValueError(f"memory categories sum to {s:.6g} bytes but memory_bytes.total is {total:.6g}")
    return stack


def bar_label(report: dict) -> str:
    c = report["config"]
    k = int(c["zero_stage"])
    off = []
    if c.get("offload_optimizer"):
        off.append("optimizer")
    if c.get("offload_param"):
        off.append("params")
    extra = f"\noffload: {', '.join(off)}" if off else ""
    return f"ZeRO-{k}\n{STAGE_NAMES.get(k, '')}{extra}"


def plot_memory(reports: list[dict], out: str | Path, title: str | None = None) -> Path:
    if not reports:
        raise ValueError("no reports to plot")
    common.apply_style()
    stacks = [memory_stack(r) for r in reports]
    fig, ax = plt.subplots(figsize=(9.5, 6.2))
    fig.subplots_adjust(left=0.09, right=0.72, top=0.86, bottom=0.17)
    x = list(range(len(reports)))
    bottoms = [0.0] * len(reports)
    for i, (key, label, colour) in enumerate(CATEGORIES):
        vals = [st[i][1] / GIB for st in stacks]
        ax.bar(x, vals, bottom=bottoms, width=0.62, color=COLORS[colour], label=label, edgecolor="white",
               linewidth=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    caps = [float(r["memory_bytes"]["gpu_capacity"]) / GIB for r in reports]
    top = max(max(bottoms), max(caps))
    for xi, st in enumerate(stacks):  # value of each segment tall enough to hold it
        y = 0.0
        for key, v in st:
            g = v / GIB
            if g >= top * 0.045:
                ax.text(xi, y + g / 2, f"{g:.3g}", ha="center", va="center", fontsize=8.5, color="white",
                        fontweight="bold")
            y += g
    for xi, (tot, r) in enumerate(zip(bottoms, reports)):
        fits = tot <= caps[xi]
        ax.text(xi, tot + top * 0.012, f"{common.fmt_gib(tot * GIB)}\n{'fits' if fits else 'does not fit'}",
                ha="center", va="bottom", fontsize=9, color="#222222" if fits else COLORS["capacity"],
                fontweight="bold", zorder=5, bbox=dict(facecolor="white", edgecolor="none", alpha=0.9, pad=1.5))
    gpus = sorted({r["config"].get("gpu", "GPU") for r in reports})
    if len(set(caps)) == 1:
        ax.axhline(caps[0], color=COLORS["capacity"], linestyle="--", linewidth=1.6,
                   label=f"{'/'.join(gpus)} capacity ({common.fmt_gib(caps[0] * GIB)})")
    else:  # different GPUs: one capacity tick per bar
        for xi, c in enumerate(caps):
            ax.hlines(c, xi - 0.4, xi + 0.4, color=COLORS["capacity"], linestyle="--", linewidth=1.6,
                      label="GPU capacity" if xi == 0 else None)
    ax.set_xticks(x)
    ax.set_xticklabels([bar_label(r) for r in reports], fontsize=9)
    ax.set_ylim(0, top * 1.13)
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_xlabel("ZeRO stage")
    ax.grid(axis="x", visible=False)
    r0 = reports[0]
    name = common.scenario_name(r0)
    fig.suptitle(title or f"Memory per GPU by ZeRO stage: {name}", x=0.09, ha="left", fontweight="bold",
                 fontsize=12.5)
    c = r0["config"]
    fig.text(0.09, 0.905, f"{common.config_summary(r0)}; {c.get('precision', '?')}, micro-batch "
             f"{c.get('micro_batch', '?')}, recompute {c.get('recompute', '?')}", fontsize=9, color="#444444")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False,
              title="category (top to bottom)", title_fontsize=9)
    return common.save(fig, out)


def run_stages(dssim: str, scenario: str, stages: list[int], sets: list[str]) -> list[dict]:
    return [common.run_dssim(dssim, common.scenario_args(scenario, [*sets, f"zero.stage={k}"])) for k in stages]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="*", help="JSON reports (dssim scenario --json), one bar each")
    p.add_argument("-o", "--output", default="memory_breakdown.png", help="PNG to write")
    p.add_argument("--scenario", help="run dssim on this scenario once per ZeRO stage")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], help="ZeRO stages (default 0 1 2 3)")
    p.add_argument("--set", action="append", default=[], help="scenario override (repeatable)")
    p.add_argument("--dssim", default=common.default_dssim(), help="dssim binary (default: $DSSIM or build/dssim)")
    p.add_argument("--title", help="plot title")
    a = p.parse_args(argv)
    if bool(a.reports) == bool(a.scenario):
        p.error("give either REPORTS or --scenario")
    reports = run_stages(a.dssim, a.scenario, a.stages, a.set) if a.scenario else [common.load_json(f) for f in a.reports]
    print(plot_memory(reports, a.output, a.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Pipeline timeline: ranks × time from a dssim Chrome trace (the 1F1B picture).

Each rank gets two lanes: the compute stream (forward / backward / recompute / optimizer step, and
the tensor-parallel collectives that block it) and, below it, a thin lane with everything on the
communication streams (pipeline send/recv, data-parallel collectives, offload copies). Grey on the
compute lane is idle time: the pipeline bubble while a stage waits for its neighbours.

  dssim scenario scenarios/tiny/tiny_pp3.yaml --backend sim --trace t.json
  plots/pipeline_timeline.py t.json -o timeline.png
  # or let the script run dssim:
  plots/pipeline_timeline.py --scenario scenarios/tiny/tiny_pp3.yaml --dssim build/dssim \\
      --set parallel.pp=4 --set model.layers=8 --set training.global_batch=8 \\
      --set cluster.gpus_per_node=4 -o timeline.png
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (selects the Agg backend)
from common import COLORS, Slice, plt  # noqa: E402

CATEGORY_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "recompute": "recompute",
    "optimizer": "optimizer step",
    "collective": "collective (TP / DP / EP)",
    "p2p": "pipeline send / recv",
    "offload": "offload copy",
    "idle": "idle (bubble)",
}
LEGEND_ORDER = ["forward", "backward", "recompute", "optimizer", "collective", "p2p", "offload", "idle"]


@dataclass
class RankLanes:
    rank: int
    compute: list[Slice] = field(default_factory=list)
    comm: list[Slice] = field(default_factory=list)
    idle: list[tuple[float, float]] = field(default_factory=list)

    @property
    def idle_seconds(self) -> float:
        return sum(b - a for a, b in self.idle)


@dataclass
class Timeline:
    ranks: list[RankLanes]
    t_end: float

    def categories(self) -> set[str]:
        cats = {common.op_category(s.op) for r in self.ranks for s in (*r.compute, *r.comm)}
        if any(r.idle for r in self.ranks):
            cats.add("idle")
        return cats


def extract_timeline(trace: dict, ranks: list[int] | None = None) -> Timeline:
    """Trace -> per-rank compute / communication lanes and the idle gaps of the compute lane.

    Idle runs from time 0 to the end of the iteration (the last slice of any rank shown), so a
    rank that finishes early shows its wait for the slowest rank too.
    """
    by_rank = common.trace_slices(trace)
    if ranks:
        missing = [r for r in ranks if r not in by_rank]
        if missing:
            raise ValueError(f"ranks {missing} are not in the trace (it has {sorted(by_rank)})")
        by_rank = {r: by_rank[r] for r in ranks}
    if not by_rank:
        raise ValueError("the trace has no slices")
    cs = common.compute_stream(trace)
    t_end = max(s.end for v in by_rank.values() for s in v)
    out = []
    for rank, slices in by_rank.items():
        lanes = RankLanes(rank, [s for s in slices if s.stream == cs], [s for s in slices if s.stream != cs])
        lanes.idle = common.idle_intervals(lanes.compute, 0.0, t_end, min_gap=t_end * 1e-6)
        out.append(lanes)
    return Timeline(out, t_end)


def plot_timeline(tl: Timeline, out: str | Path, title: str | None = None, subtitle: str | None = None,
                  label_micro_batches: bool = True) -> Path:
    common.apply_style()
    n = len(tl.ranks)
    unit, scale = common.time_unit(tl.t_end)
    fig_w = 13.0
    fig_h = 1.9 + 0.62 * n
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    fig.subplots_adjust(left=0.075, right=0.905, top=1 - 0.85 / fig_h, bottom=0.95 / fig_h)
    ax.grid(axis="y", visible=False)

    cmp_h, gap, comm_h = 0.52, 0.04, 0.2  # lane heights in "row" units
    span = tl.t_end * scale
    # Points per data unit, to decide whether a micro-batch number fits inside its slice.
    pts_per_unit = ax.get_position().width * fig_w * 72 / span
    for i, r in enumerate(tl.ranks):
        y_c = i - (cmp_h + gap + comm_h) / 2  # top of the compute lane
        y_m = y_c + cmp_h + gap
        if r.idle:
            ax.broken_barh([(a * scale, (b - a) * scale) for a, b in r.idle], (y_c, cmp_h),
                           facecolors=COLORS["idle"], edgecolors="#BBBBBB", hatch="///", linewidth=0.0)
        for lane, y, h in ((r.compute, y_c, cmp_h), (r.comm, y_m, comm_h)):
            by_cat: dict[str, list[tuple[float, float]]] = {}
            for s in lane:
                by_cat.setdefault(common.op_category(s.op), []).append((s.start * scale, max(s.dur * scale, span * 4e-4)))
            for cat, bars in by_cat.items():
                ax.broken_barh(bars, (y, h), facecolors=COLORS[cat], edgecolors="white", linewidth=0.4)
        if label_micro_batches:
            for s in r.compute:
                if s.micro_batch < 0 or s.op not in ("forward", "backward", "recompute"):
                    continue
                text = str(s.micro_batch)
                if s.dur * scale * pts_per_unit < 6.5 * len(text) + 4:
                    continue
                ax.text((s.start + s.dur / 2) * scale, y_c + cmp_h / 2, text, ha="center", va="center",
                        fontsize=8.5, color="white", fontweight="bold", clip_on=True)
        busy = 1 - r.idle_seconds / tl.t_end
        ax.annotate(f"idle {r.idle_seconds / tl.t_end:.0%}\nbusy {busy:.0%}", xy=(1.006, i),
                    xycoords=("axes fraction", "data"), va="center", ha="left", fontsize=8.5, color="#444444")

    ax.set_xlim(0, span)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r.rank}" for r in tl.ranks])
    ax.set_xlabel(f"time since iteration start ({unit})")
    ax.set_ylabel("rank (pipeline stage order)")
    fig.text(0.075 * 0.5, 1 - 0.12 / fig_h, title or "Pipeline timeline", fontsize=12.5, fontweight="bold",
             va="top", ha="left")
    if subtitle:
        fig.text(0.075 * 0.5, 1 - 0.42 / fig_h, subtitle, fontsize=9, color="#444444", va="top", ha="left")
    cats = tl.categories()
    handles = common.legend_patches([(CATEGORY_LABELS[c], COLORS[c]) for c in LEGEND_ORDER if c in cats])
    for h in handles:
        if h.get_label() == CATEGORY_LABELS["idle"]:
            h.set_hatch("///")
            h.set_edgecolor("#BBBBBB")
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.05 / fig_h), ncol=len(handles),
               frameon=False, handlelength=1.6, columnspacing=1.4)
    return common.save(fig, out)


def describe(report: dict | None) -> tuple[str | None, str | None]:
    """Title and subtitle from a dssim report (None when there is none)."""
    if not report:
        return None, None
    c = report["config"]
    sched = "interleaved 1F1B" if c.get("interleave", 1) > 1 else "1F1B"
    title = (f"{sched} pipeline timeline: {common.scenario_name(report)}, {c['pp']} stages × "
             f"{c['grad_accum']} micro-batches")
    t = report["time_seconds"]
    it = report["throughput"]["iteration_seconds"]
    sub = (f"{common.config_summary(report)}; recompute {c.get('recompute', 'none')}. "
           f"Critical rank {report.get('critical_rank', 0)}: bubble {t['bubble'] / it:.0%} of the "
           f"{it * 1e3:.3g} ms iteration. Numbers in slices are micro-batches.")
    return title, sub


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", help="Chrome trace from `dssim scenario --backend sim --trace`")
    p.add_argument("-o", "--output", default="pipeline_timeline.png", help="PNG to write")
    p.add_argument("--report", help="the scenario's JSON report (for the title)")
    p.add_argument("--scenario", help="run dssim on this scenario instead of reading TRACE")
    p.add_argument("--set", action="append", default=[], help="scenario override (repeatable)")
    p.add_argument("--dssim", default=common.default_dssim(), help="dssim binary (default: $DSSIM or build/dssim)")
    p.add_argument("--ranks", help="comma-separated ranks to show (default: all in the trace)")
    p.add_argument("--title", help="plot title")
    p.add_argument("--no-labels", action="store_true", help="do not write micro-batch numbers in slices")
    a = p.parse_args(argv)
    if bool(a.trace) == bool(a.scenario):
        p.error("give either TRACE or --scenario")
    if a.scenario:
        report, trace = common.run_trace(a.dssim, a.scenario, a.set)
    else:
        trace = common.load_json(a.trace)
        report = common.load_json(a.report) if a.report else None
    ranks = [int(x) for x in a.ranks.split(",")] if a.ranks else None
    title, sub = describe(report)
    out = plot_timeline(extract_timeline(trace, ranks), a.output, a.title or title, sub, not a.no_labels)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

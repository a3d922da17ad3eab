#!/usr/bin/env python3
"""Simulated vs measured per instruction kind: paired bars from `dssim compare --json`.

Each kind (forward, backward, recompute, optimizer step, each collective kind, bubble) gets two
bars, the simulator's time and the measured time per iteration, with the signed error
(simulated - measured) / measured above the pair; errors beyond ±10 % are written in red.

  dssim compare scenario.yaml --backend cuda --json > compare.json
  plots/compare.py compare.json -o compare.png
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (selects the Agg backend)
from common import COLORS, plt  # noqa: E402

HIGHLIGHT = 0.10


@dataclass(frozen=True)
class KindTimes:
    kind: str
    simulated: float
    measured: float

    @property
    def error(self) -> float:
        return (self.simulated - self.measured) / self.measured if self.measured else float("inf")


def compare_kinds(doc: dict) -> list[KindTimes]:
    """`dssim compare --json` -> per-kind times, in the file's order; the file's `error`, when
    given, must match (simulated - measured) / measured."""
    if "kinds" not in doc:
        raise ValueError("not a `dssim compare --json` document: no 'kinds'")
    out = []
    for k in doc["kinds"]:
        kt = KindTimes(str(k["kind"]), float(k["simulated_seconds"]), float(k["measured_seconds"]))
        if kt.simulated < 0 or kt.measured < 0:
            raise ValueError(f"{kt.kind}: negative time")
        if "error" in k and kt.measured > 0 and abs(float(k["error"]) - kt.error) > 5e-3 * max(1.0, abs(kt.error)):
            raise ValueError(f"{kt.kind}: error {k['error']} but (simulated - measured) / measured = {kt.error:.4f}")
        out.append(kt)
    if not out:
        raise ValueError("no kinds to compare")
    return out


def plot_compare(kinds: list[KindTimes], out: str | Path, title: str | None = None, note: str | None = None,
                 log: bool = False) -> Path:
    common.apply_style()
    n = len(kinds)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.05 * n + 3), 5.6))
    fig.subplots_adjust(left=0.09, right=0.98, top=0.83, bottom=0.2)
    top = max(max(k.simulated, k.measured) for k in kinds)
    unit, scale = common.time_unit(top)
    w = 0.38
    x = list(range(n))
    ax.bar([i - w / 2 for i in x], [k.simulated * scale for k in kinds], w, color=COLORS["simulated"],
           label="simulated (dssim, sim backend)")
    ax.bar([i + w / 2 for i in x], [k.measured * scale for k in kinds], w, color=COLORS["measured"],
           label="measured")
    for i, k in enumerate(kinds):
        y = max(k.simulated, k.measured) * scale
        bad = abs(k.error) > HIGHLIGHT
        ax.annotate(f"{k.error * 100:+.1f}%", (i, y), textcoords="offset points", xytext=(0, 4), ha="center",
                    va="bottom", fontsize=9, fontweight="bold", color=COLORS["capacity"] if bad else "#333333")
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, top * scale * 1.15)
    ax.set_xticks(x)
    ax.set_xticklabels([k.kind.replace("_", " ") for k in kinds], rotation=20 if n > 6 else 0,
                       ha="right" if n > 6 else "center")
    ax.set_xlabel("instruction kind")
    ax.set_ylabel(f"time per iteration ({unit}{', log scale' if log else ''})")
    ax.grid(axis="x", visible=False)
    ax.legend(loc="upper right", title=f"numbers: (sim − meas) / meas, red beyond ±{HIGHLIGHT:.0%}",
              title_fontsize=8.5)
    fig.suptitle(title or "Simulated vs measured, per instruction kind", x=0.09, ha="left", fontweight="bold",
                 fontsize=12.5)
    if note:
        fig.text(0.09, 0.895, note, fontsize=9, color="#444444")
    return common.save(fig, out)


def describe(doc: dict) -> str | None:
    parts = []
    for key in ("scenario", "device", "date"):
        if isinstance(doc.get(key), str):
            parts.append(doc[key])
    it = doc.get("iteration_seconds")
    if isinstance(it, dict) and "simulated" in it and "measured" in it:
        parts.append(f"iteration {it['simulated']:.4g} s simulated vs {it['measured']:.4g} s measured")
    return "; ".join(parts) or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="output of `dssim compare --json`")
    p.add_argument("-o", "--output", default="compare.png", help="PNG to write")
    p.add_argument("--log", action="store_true", help="log-scale time axis")
    p.add_argument("--title", help="plot title")
    a = p.parse_args(argv)
    doc = common.load_json(a.json)
    print(plot_compare(compare_kinds(doc), a.output, a.title, describe(doc), a.log))
    return 0


if __name__ == "__main__":
    sys.exit(main())

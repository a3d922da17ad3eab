#!/usr/bin/env python3
"""Validation: dssim's predictions against published numbers (scatter, y = x line, ±10% band).

Reads the JSON of `dssim validate --json` (or runs it): one panel per table (Megatron-LM's
TFLOP/s per GPU, ZeRO's memory per GPU, ...), each point one row of the paper's table. Points on
the diagonal are exact; the shaded band is ±10 %; points outside it are ringed in red.

  dssim validate --json > validate.json && plots/validation.py validate.json -o validation.png
  plots/validation.py --dssim build/dssim -o validation.png
"""
from __future__ import annotations

import argparse
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (selects the Agg backend)
from common import COLORS, MARKERS, SERIES, below_axes_y, plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator  # noqa: E402

BAND = 0.10


@dataclass(frozen=True)
class Row:
    label: str
    published: float
    predicted: float
    error: float  # (predicted - published) / published

    @property
    def outside_band(self) -> bool:
        return abs(self.error) > BAND


@dataclass(frozen=True)
class Table:
    name: str
    citation: str
    metric: str
    unit: str
    rows: list[Row]
    mean_abs_error: float
    max_abs_error: float


def pct(x: float) -> str:
    return f"{x:.1%}" if x == 0 or x >= 1e-3 else f"{x:.2%}"


def validation_tables(doc: dict) -> list[Table]:
    """`dssim validate --json` -> tables. The error is recomputed from the two values (the file's
    `error` must agree with it), and so are mean/max when the file omits them."""
    if "tables" not in doc:
        raise ValueError("not a `dssim validate --json` document: no 'tables'")
    out = []
    for t in doc["tables"]:
        rows = []
        for r in t["rows"]:
            pub, pred = float(r["published"]), float(r["predicted"])
            if pub == 0:
                raise ValueError(f"{t['name']}: row {r['label']!r} has published = 0")
            err = (pred - pub) / pub
            if "error" in r and abs(float(r["error"]) - err) > 5e-3 * max(1.0, abs(err)):
                raise ValueError(f"{t['name']}: row {r['label']!r} error {r['error']} but "
                                 f"(predicted - published) / published = {err:.4f}")
            rows.append(Row(str(r["label"]), pub, pred, err))
        if not rows:
            continue
        errs = [abs(r.error) for r in rows]
        out.append(Table(t["name"], t.get("citation", ""), t.get("metric", "value"), t.get("unit", ""), rows,
                         float(t.get("mean_abs_error", sum(errs) / len(errs))),
                         float(t.get("max_abs_error", max(errs)))))
    if not out:
        raise ValueError("no table has rows")
    return out


def labelled_rows(rows: list[Row], max_labels: int = 14, worst: int = 6) -> list[Row]:
    """All rows when few; otherwise the `worst` largest |error| (a 50-point cloud of labels is unreadable)."""
    if len(rows) <= max_labels:
        return rows
    return sorted(rows, key=lambda r: -abs(r.error))[:worst]


def plot_validation(tables: list[Table], out: str | Path, title: str | None = None, note: str | None = None) -> Path:
    common.apply_style()
    n = len(tables)
    # At most three panels a row: seven tables in one row would be a 4,000-pixel-wide strip.
    ncols = min(n, 3)
    nrows = (n + ncols - 1) // ncols
    fig, grid = plt.subplots(nrows, ncols, figsize=(6.3 * ncols, 7.4 * nrows), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.subplots_adjust(left=0.085 / ncols * 1.3, right=0.98, top=1 - 0.12 / nrows, bottom=0.27 / nrows,
                        wspace=0.25, hspace=0.27 / (1 - 0.27 / nrows) * nrows)
    for i, (ax, t) in enumerate(zip(axes, tables)):
        vals = [v for r in t.rows for v in (r.published, r.predicted)]
        lo, hi = min(vals), max(vals)
        log = lo > 0 and hi / lo > 20
        if log:
            lo, hi = lo / 1.6, hi * 1.6
        else:
            pad = (hi - lo) * 0.15 or hi * 0.1
            lo, hi = max(0.0, lo - pad), hi + pad
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
            subs = (1.0, 2.0, 5.0) if hi / lo < 2e3 else (1.0,)
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(LogLocator(base=10, subs=subs))
                axis.set_minor_locator(NullLocator())
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            xs = [lo * (hi / lo) ** (k / 100) for k in range(101)]
        else:
            xs = [lo + (hi - lo) * k / 100 for k in range(101)]
        ax.fill_between(xs, [x * (1 - BAND) for x in xs], [x * (1 + BAND) for x in xs], color="#BBBBBB",
                        alpha=0.35, linewidth=0, label=f"±{BAND:.0%} band")
        ax.plot(xs, xs, color=COLORS["reference"], linewidth=1.2, label="y = x (exact)")
        colour, marker = SERIES[i % len(SERIES)], MARKERS[i % len(MARKERS)]
        inside = [r for r in t.rows if not r.outside_band]
        outside = [r for r in t.rows if r.outside_band]
        ax.scatter([r.published for r in inside], [r.predicted for r in inside], s=46, color=colour, marker=marker,
                   zorder=3, edgecolors="white", linewidths=0.6,
                   label=f"{len(t.rows)} rows: mean |error| {pct(t.mean_abs_error)}, max {pct(t.max_abs_error)}")
        if outside:
            ax.scatter([r.published for r in outside], [r.predicted for r in outside], s=60, color=colour,
                       marker=marker, zorder=4, edgecolors=COLORS["capacity"], linewidths=1.8,
                       label=f"{len(outside)} outside ±{BAND:.0%}")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal", adjustable="box")
        unit = f" ({t.unit})" if t.unit else ""
        metric = t.metric.replace("_", " ")
        ax.set_xlabel(f"published {metric}{unit}")
        ax.set_ylabel(f"predicted {metric}{unit}")
        if len(labelled_rows(t.rows)) < len(t.rows):
            ax.text(0.99, 0.01, f"labelled: the {len(labelled_rows(t.rows))} largest errors of {len(t.rows)}", transform=ax.transAxes,
                    ha="right", va="bottom", fontsize=7.5, color="#555555")
        ax.set_title(textwrap.fill(t.name, 48), fontsize=11)
        shown = labelled_rows(t.rows)
        common.legend_and_labels(ax, [r.published for r in shown], [r.predicted for r in shown],
                                 [f"{r.label} ({r.error * 100:+.1f}%)" for r in shown],
                                 legend_kw={"fontsize": 8.5}, outside_y=below_axes_y(ax), fontsize=7.5)
        leg = ax.get_legend()
        cite = textwrap.fill(t.citation, 95 if n == 1 else 80)
        if len(cite) > 900:  # a long provenance note: the first lines, the YAML has the rest
            cite = cite[:900].rsplit(" ", 1)[0] + " ..."
        y_cite = below_axes_y(ax, leg if leg.get_bbox_to_anchor().y0 < ax.get_window_extent().y0 else None)
        ax.text(0.0, y_cite, cite, transform=ax.transAxes, fontsize=7.5, color="#555555", va="top", ha="left")
    fig.suptitle(title or "dssim predicted vs published", x=0.02, ha="left", fontweight="bold", fontsize=12.5)
    if note:
        fig.text(0.02, 1 - 0.065 / nrows, note, fontsize=9, color="#444444")
    return common.save(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="?", help="output of `dssim validate --json`")
    p.add_argument("-o", "--output", default="validation.png", help="PNG to write")
    p.add_argument("--dssim", help="run `DSSIM validate --json` instead of reading JSON")
    p.add_argument("--title", help="plot title")
    a = p.parse_args(argv)
    if bool(a.json) == bool(a.dssim):
        p.error("give either JSON or --dssim")
    doc = common.run_dssim(a.dssim, ["validate"], ok_codes=None) if a.dssim else common.load_json(a.json)
    print(plot_validation(validation_tables(doc), a.output, a.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())

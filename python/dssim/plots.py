"""dssim's plots (plots/, docs/plots.md) from a notebook: each function takes the dicts that
dssim.predict / dssim.plan return (or a trace / JSON file), writes a PNG and returns its path as a
Png, which a notebook shows inline (it has _repr_png_). Matplotlib's Agg backend, as the scripts.

    reports = [dssim.predict("scenarios/gpt13b_zero2.yaml", ...) for ...]
    dssim.plots.memory_breakdown(reports)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from ._paths import SOURCE_ROOT

_PLOTS_DIR = os.path.join(SOURCE_ROOT, "plots")
if _PLOTS_DIR not in sys.path:
    sys.path.insert(0, _PLOTS_DIR)

import compare as _compare  # noqa: E402  (plots/compare.py; selects Agg through plots/common.py)
import memory_breakdown as _memory  # noqa: E402
import pipeline_timeline as _timeline  # noqa: E402
import plan_sweep as _plan_sweep  # noqa: E402
import scaling as _scaling  # noqa: E402
import validation as _validation  # noqa: E402

__all__ = ["Png", "memory_breakdown", "pipeline_timeline", "scaling", "plan_sweep", "compare", "validation"]


class Png(type(Path())):
    """The path of a written PNG; a notebook displays it."""

    def _repr_png_(self) -> bytes:
        return self.read_bytes()


def _out(out: str | os.PathLike | None, name: str) -> str:
    if out is not None:
        return os.fspath(out)
    fd, path = tempfile.mkstemp(prefix=f"dssim-{name}-", suffix=".png")
    os.close(fd)
    return path


def _doc(d: Mapping | str | os.PathLike) -> dict:
    if isinstance(d, Mapping):
        return dict(d)
    with open(d, encoding="utf-8") as f:
        return json.load(f)


def _reports(r: Mapping | Sequence[Mapping]) -> list[dict]:
    return [dict(r)] if isinstance(r, Mapping) else [dict(x) for x in r]


def memory_breakdown(reports: Mapping | Sequence[Mapping], out: str | os.PathLike | None = None,
                     title: str | None = None) -> Png:
    """Stacked memory per GPU by category, one bar per report (e.g. ZeRO stages 0..3)."""
    return Png(_memory.plot_memory(_reports(reports), _out(out, "memory"), title))


def pipeline_timeline(trace: Mapping | str | os.PathLike, report: Mapping | None = None,
                      out: str | os.PathLike | None = None, ranks: Sequence[int] | None = None,
                      title: str | None = None) -> Png:
    """Ranks x time from a simulator trace (dssim.predict(sc, backend="sim", trace=path))."""
    t, sub = _timeline.describe(dict(report) if report else None)
    tl = _timeline.extract_timeline(_doc(trace), list(ranks) if ranks else None)
    return Png(_timeline.plot_timeline(tl, _out(out, "timeline"), title or t, sub))


def scaling(reports: Sequence[Mapping], out: str | os.PathLike | None = None, title: str | None = None) -> Png:
    """Throughput and iteration time against GPU count, one series per backend."""
    return Png(_scaling.plot_scaling(_reports(reports), _out(out, "scaling"), title))


def plan_sweep(plan: Mapping, out: str | os.PathLike | None = None, title: str | None = None) -> Png:
    """The best layout per GPU count of dssim.plan(sc, gpus=[...], top=1)."""
    return Png(_plan_sweep.plot_sweep(dict(plan), _out(out, "plan-sweep"), title))


def compare(doc: Mapping | str | os.PathLike, out: str | os.PathLike | None = None, title: str | None = None,
            log: bool = False) -> Png:
    """Simulated vs measured seconds per instruction kind (`dssim compare --json`)."""
    d = _doc(doc)
    return Png(_compare.plot_compare(_compare.compare_kinds(d), _out(out, "compare"), title, _compare.describe(d), log))


def validation(doc: Mapping | str | os.PathLike, out: str | os.PathLike | None = None, title: str | None = None) -> Png:
    """Predicted vs published (`dssim validate --json`)."""
    return Png(_validation.plot_validation(_validation.validation_tables(_doc(doc)), _out(out, "validation"), title))

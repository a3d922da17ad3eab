"""Shared helpers for dssim's plots: loading JSON, running dssim, reading traces, style and colours.

Every plot script imports this module first: it selects matplotlib's headless Agg backend before
pyplot is loaded, so the scripts run in CI and over ssh without a display.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.patches import Patch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO_ROOT / "tests" / "data" / "plots"

GIB = float(1 << 30)

# --------------------------------------------------------------------------------------- colours
# One palette for every plot, so "forward" or "optimizer" looks the same wherever it appears.
COLORS = {
    # pipeline timeline (instruction categories)
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "recompute": "#8172B3",
    "optimizer": "#55A868",
    "p2p": "#C44E52",
    "collective": "#937860",
    "offload": "#DA8BC3",
    "idle": "#E6E6E6",
    # memory categories (memory_bytes in the report)
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer_states": "#55A868",
    "activations": "#C44E52",
    "comm_buffers": "#8172B3",
    "temporaries": "#937860",
    # series
    "simulated": "#4C72B0",
    "measured": "#DD8452",
    "predicted": "#4C72B0",
    "reference": "#444444",
    "capacity": "#D62728",
}
SERIES = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def apply_style() -> None:
    """Font sizes and grid that stay readable when a PNG is shown at README width."""
    plt.rcParams.update({
        "figure.dpi": 100,
        "savefig.dpi": 110,
        "font.size": 10,
        "axes.titlesize": 12,
        "axes.labelsize": 10,
        "legend.fontsize": 9,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "axes.axisbelow": True,
        "axes.spines.top": False,
        "axes.spines.right": False,
    })


def legend_patches(items: Iterable[tuple[str, str]], **kw) -> list[Patch]:
    """[(label, colour)] -> handles for ax.legend(handles=...)."""
    return [Patch(facecolor=c, edgecolor="none", label=l, **kw) for l, c in items]


def save(fig, path: str | os.PathLike) -> Path:
    """Write a PNG (creating its folder) and close the figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ JSON, dssim
class DssimError(RuntimeError):
    pass


def load_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def default_dssim() -> str:
    """$DSSIM, else build/dssim in the repository, else `dssim` on PATH."""
    if os.environ.get("DSSIM"):
        return os.environ["DSSIM"]
    candidate = REPO_ROOT / "build" / "dssim"
    return str(candidate) if candidate.exists() else "dssim"


def resolve_scenario(path: str | os.PathLike) -> str:
    """A scenario path as given, or relative to the repository root (scenarios/...)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return str(p)
    return str(REPO_ROOT / p)


def run_dssim(dssim: str, args: Sequence[str], ok_codes: Iterable[int] | None = (0, 3)) -> dict:
    """Run `dssim ARGS --json` and return the parsed report.

    `dssim scenario` exits 3 when the scenario does not fit in GPU memory but still prints the full
    report, so 0 and 3 count as success by default. ok_codes=None accepts any exit status whose
    stdout parses as JSON (verbs such as `validate` exit non-zero when a threshold is missed).
    """
    cmd = [dssim, *args]
    if "--json" not in cmd:
        cmd.append("--json")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise DssimError(f"cannot run {dssim}: {e}") from e
    if ok_codes is not None and proc.returncode not in set(ok_codes):
        raise DssimError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise DssimError(f"{' '.join(cmd)} exited {proc.returncode} without JSON: "
                         f"{proc.stderr.strip() or e}") from e


def scenario_args(scenario: str, sets: Sequence[str] = (), gpus: int | None = None,
                  backend: str | None = None) -> list[str]:
    args = ["scenario", resolve_scenario(scenario)]
    for s in sets:
        args += ["--set", s]
    if gpus:
        args += ["--gpus", str(gpus)]
    if backend:
        args += ["--backend", backend]
    return args


def run_trace(dssim: str, scenario: str, sets: Sequence[str] = (), trace_path: str | None = None,
              extra: Sequence[str] = ()) -> tuple[dict, dict]:
    """Simulate a scenario with the sim backend; return (report, trace)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        report = run_dssim(dssim, [*scenario_args(scenario, sets, backend="sim"), "--trace", path, *extra])
        return report, load_json(path)


# ------------------------------------------------------------------------------------------ traces
@dataclass(frozen=True)
class Slice:
    """One complete ("X") event of a dssim Chrome trace, times in seconds."""
    rank: int
    stream: int
    name: str
    op: str
    start: float
    dur: float
    micro_batch: int = -1
    purpose: str = "none"

    @property
    def end(self) -> float:
        return self.start + self.dur


COMPUTE_OPS = {"forward", "backward", "recompute", "optimizer_step", "host_optimizer_step"}
P2P_OPS = {"send", "recv"}
COLLECTIVE_OPS = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}
OFFLOAD_OPS = {"copy_h2d", "copy_d2h"}


def op_category(op: str) -> str:
    """Instruction kind (trace `cat`) -> colour category of the timeline."""
    if op in ("forward", "backward", "recompute"):
        return op
    if op in ("optimizer_step", "host_optimizer_step"):
        return "optimizer"
    if op in P2P_OPS:
        return "p2p"
    if op in COLLECTIVE_OPS:
        return "collective"
    if op in OFFLOAD_OPS:
        return "offload"
    raise ValueError(f"unknown instruction kind in trace: {op!r}")


def stream_names(trace: dict) -> dict[int, str]:
    """tid -> stream name from the thread_name metadata (compute, dp_comm, pp_comm, ...)."""
    names: dict[int, str] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names.setdefault(int(e["tid"]), e["args"]["name"])
    return names


def compute_stream(trace: dict) -> int:
    for tid, name in stream_names(trace).items():
        if name == "compute":
            return tid
    return 0


def trace_slices(trace: dict) -> dict[int, list[Slice]]:
    """Trace -> {rank: [Slice sorted by start]}; ts/dur are µs in the trace, seconds here."""
    if "traceEvents" not in trace:
        raise ValueError("not a Chrome trace: no traceEvents")
    ranks: dict[int, list[Slice]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        s = Slice(rank=int(e["pid"]), stream=int(e.get("tid", 0)), name=e["name"],
                  op=e.get("cat") or e["name"].split()[0], start=float(e["ts"]) * 1e-6,
                  dur=float(e["dur"]) * 1e-6, micro_batch=int(args.get("micro_batch", -1)),
                  purpose=args.get("purpose", "none"))
        ranks.setdefault(s.rank, []).append(s)
    for v in ranks.values():
        v.sort(key=lambda s: (s.start, s.stream))
    return dict(sorted(ranks.items()))


def busy_intervals(slices: Iterable[Slice]) -> list[tuple[float, float]]:
    """Union of the slices' [start, end) intervals, merged and sorted."""
    out: list[list[float]] = []
    for s in sorted(slices, key=lambda s: s.start):
        if out and s.start <= out[-1][1] + 1e-15:
            out[-1][1] = max(out[-1][1], s.end)
        else:
            out.append([s.start, s.end])
    return [(a, b) for a, b in out]


def idle_intervals(slices: Iterable[Slice], t_begin: float, t_end: float,
                   min_gap: float = 0.0) -> list[tuple[float, float]]:
    """Gaps [start, end) in [t_begin, t_end] not covered by any slice (longer than min_gap)."""
    gaps = []
    t = t_begin
    for a, b in busy_intervals(slices):
        if a > t + min_gap:
            gaps.append((t, min(a, t_end)))
        t = max(t, b)
    if t_end > t + min_gap:
        gaps.append((t, t_end))
    return [(a, b) for a, b in gaps if b > a]


# -------------------------------------------------------------------------------------------- units
def time_unit(seconds: float) -> tuple[str, float]:
    """A readable unit for a span: ('ms', 1e3) means multiply seconds by 1e3."""
    if seconds >= 10:
        return "s", 1.0
    if seconds >= 10e-3:
        return "ms", 1e3
    return "µs", 1e6


def fmt_gib(nbytes: float) -> str:
    g = nbytes / GIB
    return f"{g:.0f} GiB" if g >= 100 else f"{g:.1f} GiB" if g >= 1 else f"{nbytes / (1 << 20):.1f} MiB"


def config_summary(report: dict) -> str:
    """'12.9B params, 64 × A100-40GB, tp 1 · pp 1 · dp 64' from a report's config."""
    c = report.get("config", {})
    params = c.get("parameters", 0)
    size = next((f"{params / d:.3g}{u}" for d, u in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
                 if params >= d), f"{params:.0f}")
    return (f"{size} params, {c.get('gpus', '?')} × {c.get('gpu', '?')}, "
            f"tp {c.get('tp', '?')} · pp {c.get('pp', '?')} · dp {c.get('dp', '?')}")


def scenario_name(report: dict) -> str:
    return report.get("scenario", {}).get("name", "scenario")


# ---------------------------------------------------------------------------------- point labels
def place_labels(ax, xs: Sequence[float], ys: Sequence[float], texts: Sequence[str], fontsize: float = 8,
                 color: str = "#333333") -> list:
    """Write texts next to points, trying a few offsets and skipping a label that would overlap
    one already placed, a marker or the legend, or leave the axes. Call after the axis limits are
    final. Returns the annotations placed."""
    fig = ax.figure
    to_pts = 72.0 / fig.dpi
    placed: list[tuple[float, float, float, float]] = []
    markers = [tuple(v * to_pts for v in ax.transData.transform((x, y))) for x, y in zip(xs, ys)]
    for x, y in markers:
        placed.append((x - 4, y - 4, x + 4, y + 4))
    ab = ax.get_window_extent()
    inside = (ab.x0 * to_pts + 2, ab.y0 * to_pts + 2, ab.x1 * to_pts - 2, ab.y1 * to_pts - 2)
    if ax.get_legend() is not None:
        lb = ax.get_legend().get_window_extent()
        placed.append((lb.x0 * to_pts, lb.y0 * to_pts, lb.x1 * to_pts, lb.y1 * to_pts))
    made = []
    order = sorted(range(len(texts)), key=lambda i: (markers[i][1], markers[i][0]))
    for i in order:
        px, py = markers[i]
        w, h = 0.64 * fontsize * len(texts[i]), 1.25 * fontsize
        for dx, dy, ha, va in ((6, 0, "left", "center"), (-6, 0, "right", "center"), (6, 9, "left", "center"),
                               (-6, -9, "right", "center"), (6, -9, "left", "center"), (-6, 9, "right", "center"),
                               (0, 12, "center", "center"), (0, -12, "center", "center"), (6, 18, "left", "center"),
                               (-6, -18, "right", "center"), (6, -18, "left", "center"), (-6, 18, "right", "center"),
                               (0, 24, "center", "center"), (0, -24, "center", "center")):
            x0 = px + dx if ha == "left" else px + dx - w if ha == "right" else px - w / 2
            box = (x0, py + dy - h / 2, x0 + w, py + dy + h / 2)
            if box[0] < inside[0] or box[1] < inside[1] or box[2] > inside[2] or box[3] > inside[3]:
                continue
            if any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                continue
            far = abs(dy) >= 18  # far from its point: draw a leader line
            made.append(ax.annotate(texts[i], (xs[i], ys[i]), textcoords="offset points", xytext=(dx, dy), ha=ha,
                                    va=va, fontsize=fontsize, color=color,
                                    arrowprops=dict(arrowstyle="-", color="#888888", lw=0.6,
                                                    shrinkA=0, shrinkB=3) if far else None))
            placed.append(box)
            break
    return made


def legend_and_labels(ax, xs: Sequence[float], ys: Sequence[float], texts: Sequence[str],
                      locs: Sequence[str] = ("lower right", "upper left", "upper right", "lower left", "center right",
                                             "center left", "lower center", "upper center"),
                      legend_kw: dict | None = None, outside_y: float = -0.12, **label_kw) -> int:
    """Put the legend in the first corner where every point label fits (place_labels), else under
    the axes at axes-fraction y = outside_y; returns the number of labels placed."""
    best: tuple[int, str] | None = None
    for loc in locs:
        ax.legend(loc=loc, **(legend_kw or {}))
        ax.figure.canvas.draw()
        made = place_labels(ax, xs, ys, texts, **label_kw)
        for a in made:
            a.remove()
        if best is None or len(made) > best[0]:
            best = (len(made), loc)
        if len(made) == len(texts):
            break
    if best[0] < len(texts):  # no corner leaves room for every label: legend under the axes
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, outside_y), **(legend_kw or {}))
    else:
        ax.legend(loc=best[1], **(legend_kw or {}))
    ax.figure.canvas.draw()
    return len(place_labels(ax, xs, ys, texts, **label_kw))


def below_axes_y(ax, artist=None, gap: float = 0.02) -> float:
    """Axes-fraction y just under the x label (or under `artist`, e.g. a legend placed there)."""
    ax.figure.canvas.draw()
    boxes = [ax.xaxis.label.get_window_extent()]
    if artist is not None:
        boxes.append(artist.get_window_extent())
    y_px = min(b.y0 for b in boxes)
    return ax.transAxes.inverted().transform((0, y_px))[1] - gap

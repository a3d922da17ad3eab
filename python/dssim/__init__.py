"""dssim from Python: load a scenario, predict an iteration, plan a layout, plot (docs/python.md).

    import dssim
    report = dssim.predict("scenarios/gpt175b.yaml")           # the dict of `dssim scenario --json`
    print(report["iteration_seconds"], report["memory_bytes"]["total"] / 2**30)

Scenarios load as `dssim scenario` loads them (presets, ds_config.json, --set, --gpus); predict and
plan return the same dicts as `--json` (docs/report-json.md, docs/plan.md). Bad input raises
dssim.ConfigError (a ValueError) carrying the CLI's message.
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping, Sequence, Union

from . import _core
from ._core import ConfigError, Scenario

__all__ = ["ConfigError", "Scenario", "load_scenario", "predict", "plan", "has_sim", "plots"]

has_sim: bool = _core.has_sim

ScenarioLike = Union[Scenario, str, os.PathLike]


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _overrides(set: Mapping[str, object] | Iterable[str] | None) -> list[str]:
    if set is None:
        return []
    if isinstance(set, Mapping):
        return [f"{k}={_value(v)}" for k, v in set.items()]
    if isinstance(set, str):
        return [set]
    return [str(s) for s in set]


def load_scenario(path: str | os.PathLike, set: Mapping[str, object] | Iterable[str] | None = None,
                  deepspeed_config: str | os.PathLike | None = None, gpus: int = 0) -> Scenario:
    """A scenario as `dssim scenario PATH --set k=v ... --deepspeed_config F --gpus N` loads it.

    `set` is a dict ({"parallel.pp": 16, "zero.stage": 3}) or a list of "key=value" strings,
    applied in order after the ds_config; a relative `path` that does not exist is looked up under
    the repository's scenarios/ ("gpt175b" finds scenarios/gpt175b.yaml).
    """
    return _core.load_scenario(os.fspath(path), _overrides(set),
                               os.fspath(deepspeed_config) if deepspeed_config else "", int(gpus))


def _scenario(s: ScenarioLike) -> Scenario:
    return s if isinstance(s, Scenario) else load_scenario(s)


def predict(scenario: ScenarioLike, backend: str = "analytic", trace: str | os.PathLike | None = None) -> dict:
    """The report of one iteration: the dict `dssim scenario --json` prints.

    backend "analytic" (the closed-form estimator, milliseconds) or "sim" (the SimGrid simulator;
    `trace` writes its Chrome trace, for dssim.plots.pipeline_timeline). A scenario that does not
    fit is not an error: report["fits"] is False and report["suggestions"] lists what would fit.
    """
    return _core.predict(_scenario(scenario), backend, os.fspath(trace) if trace else "")


def plan(scenario: ScenarioLike, gpus: int | Sequence[int] | None = None, top: int = 10,
         vary: Sequence[str] | None = None, fix: Mapping[str, object] | None = None,
         objective: str = "throughput", max_tp: int = 0, exact: bool = False) -> dict:
    """`dssim plan --json` (schema dssim.plan/1): the fastest layouts that fit, best first.

    gpus: one count, a list of counts (a sweep; result["best"]["plan_index"] names the best), or
    None for the scenario's cluster. vary: dimensions to search (tp, pp, micro_batch, zero,
    recompute, interleave, sequence_parallel, offload, ep); fix: {"parallel.tp": 8, ...}.
    Raises ConfigError when nothing fits.
    """
    counts = [] if gpus is None else [int(gpus)] if isinstance(gpus, int) else [int(g) for g in gpus]
    fixes = [(k, _value(v)) for k, v in (fix or {}).items()]
    return _core.plan(_scenario(scenario), counts, int(top), list(vary or []), fixes, objective, int(max_tp), bool(exact))


def __getattr__(name: str):
    # dssim.plots imports matplotlib: only when asked for.
    if name == "plots":
        import importlib
        return importlib.import_module(".plots", __name__)
    raise AttributeError(f"module 'dssim' has no attribute {name!r}")

#!/usr/bin/env python3
"""Render every dssim plot into one folder (default build/plots/).

  plots/render_all.py --dssim build/dssim [-o build/plots] [--validate-json F] [--compare-json F]

- pipeline_timeline.png  tiny_pp3 stretched to 4 stages × 8 micro-batches, simulated (sim backend)
- memory_breakdown.png   gpt13b_zero2 at ZeRO stages 0–3
- scaling.png            gpt175b at 512..8192 GPUs, analytic and simulator
- validation.png         `dssim validate --json` (or --validate-json; if the verb is not there,
                         the sample tests/data/plots/validate_sample.json, marked as sample data)
- compare.png            --compare-json (the output of `dssim compare --json` on a GPU machine),
                         else the committed sample tests/data/plots/compare_sample.json
- plan_sweep.png         `dssim plan gpt13b_zero2 --gpus 16..512 --json`: the best configuration's
                         tokens/s per GPU and MFU per GPU count, annotated with its layout
- what_if.png            gpt13b_zero2: iteration time vs one GPU's slowdown (simulated what-ifs),
                         goodput vs checkpoint interval (closed form and Monte-Carlo)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (selects the Agg backend)
import compare  # noqa: E402
import memory_breakdown  # noqa: E402
import pipeline_timeline  # noqa: E402
import plan_sweep  # noqa: E402
import scaling  # noqa: E402
import validation  # noqa: E402
import what_if  # noqa: E402

TIMELINE_SCENARIO = "scenarios/tiny/tiny_pp3.yaml"
TIMELINE_SETS = ["parallel.pp=4", "model.layers=8", "training.global_batch=8", "cluster.gpus_per_node=4"]
MEMORY_SCENARIO = "scenarios/gpt13b_zero2.yaml"
SCALING_SCENARIO = "scenarios/gpt175b.yaml"
SCALING_GPUS = [512, 1024, 2048, 4096, 8192]
SWEEP_SCENARIO = "scenarios/gpt13b_zero2.yaml"
SWEEP_GPUS = "16..512"
SWEEP_VARY = "tp,pp,micro_batch,zero,recompute,offload"  # a few seconds; the full space takes ~1 min
WHAT_IF_SCENARIO = "scenarios/gpt13b_zero2.yaml"
WHAT_IF_FACTORS = [1, 0.9, 0.8, 0.7, 0.6, 0.5]
WHAT_IF_SCALES = [0.125, 0.25, 0.5, 1, 2, 4, 8]
# 64 GPUs fail rarely at Llama 3's rate (every 33 days); 250x it and slower storage show the trade-off.
WHAT_IF_RELIABILITY = ["reliability.failures_per_gpu_hour=5e-3", "reliability.write_bandwidth=5 GB/s"]
SAMPLE_NOTE = "SAMPLE DATA (hand-made {name}, shows the plot's layout; not a dssim result)"


def render_timeline(dssim: str, outdir: Path) -> Path:
    report, trace = common.run_trace(dssim, TIMELINE_SCENARIO, TIMELINE_SETS)
    title, sub = pipeline_timeline.describe(report)
    return pipeline_timeline.plot_timeline(pipeline_timeline.extract_timeline(trace), outdir / "pipeline_timeline.png",
                                           title, sub)


def render_memory(dssim: str, outdir: Path) -> Path:
    reports = memory_breakdown.run_stages(dssim, MEMORY_SCENARIO, [0, 1, 2, 3], [])
    return memory_breakdown.plot_memory(reports, outdir / "memory_breakdown.png")


def render_scaling(dssim: str, outdir: Path) -> Path:
    reports = scaling.run_scaling(dssim, SCALING_SCENARIO, SCALING_GPUS, ["analytic", "sim"], [])
    return scaling.plot_scaling(reports, outdir / "scaling.png")


def render_validation(dssim: str, outdir: Path, given: str | None) -> Path:
    note = None
    if given:
        doc = common.load_json(given)
    else:
        try:
            doc = common.run_dssim(dssim, ["validate"], ok_codes=None)
            validation.validation_tables(doc)
        except (common.DssimError, ValueError) as e:
            sample = common.SAMPLE_DATA / "validate_sample.json"
            print(f"render_all: `dssim validate --json` gave no tables ({str(e).splitlines()[0][:160]}); "
                  f"using {sample}", file=sys.stderr)
            doc, note = common.load_json(sample), SAMPLE_NOTE.format(name=sample.name)
    return validation.plot_validation(validation.validation_tables(doc), outdir / "validation.png", note=note)


def render_compare(outdir: Path, given: str | None) -> Path:
    path = Path(given) if given else common.SAMPLE_DATA / "compare_sample.json"
    doc = common.load_json(path)
    note = compare.describe(doc)
    if not given:
        note = SAMPLE_NOTE.format(name=path.name)
    return compare.plot_compare(compare.compare_kinds(doc), outdir / "compare.png", note=note)


def render_plan_sweep(dssim: str, outdir: Path) -> Path:
    doc = plan_sweep.run_sweep(dssim, SWEEP_SCENARIO, SWEEP_GPUS, ["--vary", SWEEP_VARY])
    return plan_sweep.plot_sweep(doc, outdir / "plan_sweep.png")


def render_what_if(dssim: str, outdir: Path) -> Path:
    slow = what_if.slowdown_points(dssim, WHAT_IF_SCENARIO, 17, WHAT_IF_FACTORS)
    good, auto = what_if.goodput_points(dssim, WHAT_IF_SCENARIO, WHAT_IF_SCALES, WHAT_IF_RELIABILITY)
    return what_if.plot_what_if(slow, good, auto, outdir / "what_if.png", "gpt13b_zero2", 17)


def render_all(dssim: str, outdir: Path, validate_json: str | None = None, compare_json: str | None = None,
               only: list[str] | None = None) -> list[Path]:
    jobs = {
        "pipeline_timeline": lambda: render_timeline(dssim, outdir),
        "memory_breakdown": lambda: render_memory(dssim, outdir),
        "scaling": lambda: render_scaling(dssim, outdir),
        "validation": lambda: render_validation(dssim, outdir, validate_json),
        "compare": lambda: render_compare(outdir, compare_json),
        "plan_sweep": lambda: render_plan_sweep(dssim, outdir),
        "what_if": lambda: render_what_if(dssim, outdir),
    }
    outdir.mkdir(parents=True, exist_ok=True)
    done = []
    for name, job in jobs.items():
        if only and name not in only:
            continue
        path = job()
        print(path)
        done.append(path)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dssim", default=common.default_dssim(), help="dssim binary (default: $DSSIM or build/dssim)")
    p.add_argument("-o", "--outdir", default=str(common.REPO_ROOT / "build" / "plots"), help="folder for the PNGs")
    p.add_argument("--validate-json", help="use this `dssim validate --json` output instead of running it")
    p.add_argument("--compare-json", help="`dssim compare --json` output (default: the committed sample)")
    p.add_argument("--only", nargs="+", help="render only these plots (names without .png)")
    a = p.parse_args(argv)
    try:
        render_all(a.dssim, Path(a.outdir), a.validate_json, a.compare_json, a.only)
    except (common.DssimError, ValueError, OSError) as e:
        print(f"render_all: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Unit tests of the plots' data extraction (python3 -m unittest, no dssim needed).

Run: python3 -m unittest discover -s tests/plots -p 'test_*.py'
"""
import copy
import json
import sys
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "plots"
sys.path.insert(0, str(ROOT / "plots"))

import common  # noqa: E402
import compare  # noqa: E402
import memory_breakdown  # noqa: E402
import pipeline_timeline  # noqa: E402
import plan_sweep  # noqa: E402
import scaling  # noqa: E402
import validation  # noqa: E402

US = 1e-6


def report(stage=0, gpus=64, backend="analytic", **mem):
    m = {"params": 10.0, "grads": 20.0, "optimizer": 30.0, "activations": 5.0, "comm_buffers": 2.0,
         "temporaries": 1.0}
    m.update(mem)
    m["total"] = sum(m.values())
    m["gpu_capacity"] = 100.0
    return {"backend": backend, "scenario": {"name": "t"}, "memory_bytes": m,
            "config": {"zero_stage": stage, "gpus": gpus, "dp": gpus // 8, "tp": 8, "pp": 1, "gpu": "G",
                       "parameters": 1e9, "global_batch": 8, "micro_batch": 1, "recompute": "none"},
            "throughput": {"iteration_seconds": 64.0 / gpus, "model_tflops_per_gpu": 100.0 + gpus,
                           "hardware_tflops_per_gpu": 130.0, "mfu": 0.3}}


class TraceTest(unittest.TestCase):
    def setUp(self):
        self.trace = common.load_json(DATA / "trace_mini.json")

    def test_slices_per_rank_in_seconds_sorted(self):
        s = common.trace_slices(self.trace)
        self.assertEqual(sorted(s), [0, 1])
        self.assertEqual(len(s[0]), 7)
        self.assertEqual(len(s[1]), 5)
        b = [x for x in s[0] if x.name == "backward mb0"][0]
        self.assertAlmostEqual(b.start, 400 * US)
        self.assertAlmostEqual(b.end, 600 * US)
        self.assertEqual(b.micro_batch, 0)
        self.assertEqual([x.start for x in s[0]], sorted(x.start for x in s[0]))

    def test_categories(self):
        self.assertEqual(common.op_category("send"), "p2p")
        self.assertEqual(common.op_category("reduce_scatter"), "collective")
        self.assertEqual(common.op_category("host_optimizer_step"), "optimizer")
        self.assertEqual(common.op_category("copy_d2h"), "offload")
        with self.assertRaises(ValueError):
            common.op_category("teleport")

    def test_lanes_and_idle(self):
        tl = pipeline_timeline.extract_timeline(self.trace)
        self.assertAlmostEqual(tl.t_end, 1000 * US)
        r0, r1 = tl.ranks
        self.assertEqual([s.op for s in r0.comm], ["send", "all_reduce"])  # off the compute stream
        self.assertEqual(len(r0.compute), 5)
        # rank 0 computes 0-200, 400-600, 700-900, 920-1000 µs: idle 200-400, 600-700, 900-920
        self.assertEqual(len(r0.idle), 3)
        self.assertAlmostEqual(r0.idle_seconds, 320 * US)
        # rank 1: idle 0-110 (waiting for mb0) and 650-1000 (done, waiting for rank 0); the
        # overlapping recompute/backward slices count once
        self.assertAlmostEqual(r1.idle[0][0], 0.0)
        self.assertAlmostEqual(r1.idle[0][1], 110 * US)
        self.assertAlmostEqual(r1.idle_seconds, 460 * US)
        self.assertEqual(tl.categories(), {"forward", "backward", "recompute", "optimizer", "p2p", "collective",
                                           "idle"})

    def test_rank_filter(self):
        tl = pipeline_timeline.extract_timeline(self.trace, [1])
        self.assertEqual([r.rank for r in tl.ranks], [1])
        self.assertAlmostEqual(tl.t_end, 650 * US)  # the iteration end of the ranks shown
        with self.assertRaises(ValueError):
            pipeline_timeline.extract_timeline(self.trace, [7])

    def test_not_a_trace(self):
        with self.assertRaises(ValueError):
            common.trace_slices({"tables": []})


class MemoryTest(unittest.TestCase):
    def test_stack_order_and_sum(self):
        st = memory_breakdown.memory_stack(report())
        self.assertEqual([k for k, _ in st], ["params", "grads", "optimizer", "activations", "comm_buffers",
                                              "temporaries"])
        self.assertEqual(sum(v for _, v in st), 68.0)

    def test_categories_must_sum_to_total(self):
        r = report()
        r["memory_bytes"]["total"] += 5
        with self.assertRaisesRegex(ValueError, "sum to"):
            memory_breakdown.memory_stack(r)

    def test_missing_category(self):
        r = report()
        del r["memory_bytes"]["temporaries"]
        with self.assertRaises(ValueError):
            memory_breakdown.memory_stack(r)

    def test_sample_dssim_reports_sum(self):
        """Every committed dssim report in tests/data/plots obeys total = sum of categories."""
        for path in sorted(DATA.glob("report_*.json")):
            with self.subTest(path=path.name):
                r = common.load_json(path)
                st = memory_breakdown.memory_stack(r)
                self.assertAlmostEqual(sum(v for _, v in st), r["memory_bytes"]["total"], delta=1.0)

    def test_bar_label(self):
        r = report(stage=3)
        r["config"]["offload_optimizer"] = True
        self.assertTrue(memory_breakdown.bar_label(r).startswith("ZeRO-3\n"))
        self.assertIn("offload: optimizer", memory_breakdown.bar_label(r))


class ScalingTest(unittest.TestCase):
    def test_points_grouped_and_sorted(self):
        pts = scaling.scaling_points([report(gpus=256), report(gpus=64), report(gpus=128, backend="sim")])
        self.assertEqual(sorted(pts), ["analytic", "sim"])
        self.assertEqual([p.gpus for p in pts["analytic"]], [64, 256])
        self.assertAlmostEqual(pts["analytic"][1].iteration_seconds, 0.25)
        self.assertAlmostEqual(pts["analytic"][0].model_tflops, 164.0)

    def test_duplicate_count_rejected(self):
        with self.assertRaises(ValueError):
            scaling.scaling_points([report(gpus=64), report(gpus=64)])

    def test_valid_gpu_counts(self):
        self.assertEqual(scaling.valid_gpu_counts([512, 1000, 1024], 8, 8), ([512, 1024], [1000]))


def plan_doc(sizes, best_index=0, empty=()):
    """A `dssim plan --gpus A..B --json` document with one ranked entry per size (none in `empty`)."""
    plans = []
    for n in sizes:
        cfg = {"tp": 2, "pp": 1, "dp": n // 2, "ep": 1, "micro_batch": 4, "grad_accum": 1, "zero_stage": 3,
               "offload": "optimizer", "recompute": "none", "interleave": 1, "sequence_parallel": True}
        ranked = [] if n in empty else [{"rank": 1, "key": f"tp2.dp{n // 2}", "config": cfg,
                                         "tokens_per_second": 1000.0 * n, "mfu": 0.5}]
        plans.append({"gpus": n, "global_batch": 512, "counts": {"scored": len(ranked)}, "ranked": ranked})
    return {"schema": "dssim.plan/1", "objective": "throughput", "plans": plans,
            "best": {"gpus": sizes[best_index], "key": "k", "plan_index": best_index}}


class PlanSweepTest(unittest.TestCase):
    def test_one_point_per_gpu_count_sorted(self):
        pts = plan_sweep.sweep_points(plan_doc([64, 16, 32], best_index=2, empty=(16,)))
        self.assertEqual([p.gpus for p in pts], [16, 32, 64])
        self.assertEqual([p.fits for p in pts], [False, True, True])
        self.assertAlmostEqual(pts[2].tokens_per_gpu, 1000.0)
        self.assertEqual([p.best for p in pts], [False, True, False])  # plan_index 2 is the 32-GPU plan

    def test_layout_label(self):
        pts = plan_sweep.sweep_points(plan_doc([64]))
        self.assertEqual(pts[0].layout, "TP2 PP1 DP32 SP\nmb 4 ZeRO-3 opt-off")

    def test_rejects_other_documents(self):
        with self.assertRaises(ValueError):
            plan_sweep.sweep_points({"schema": "dssim.report/1"})
        with self.assertRaises(ValueError):
            plan_sweep.sweep_points(plan_doc([16, 16]))


class ValidationTest(unittest.TestCase):
    def test_sample(self):
        tables = validation.validation_tables(common.load_json(DATA / "validate_sample.json"))
        self.assertEqual(len(tables), 2)
        meg = tables[0]
        self.assertEqual(len(meg.rows), 10)
        self.assertEqual(meg.unit, "TFLOP/s")
        self.assertAlmostEqual(meg.rows[0].error, (131.0 - 137) / 137)
        self.assertFalse(any(r.outside_band for r in meg.rows))

    def test_error_must_match_values(self):
        doc = common.load_json(DATA / "validate_sample.json")
        doc["tables"][0]["rows"][0]["error"] = 0.5
        with self.assertRaisesRegex(ValueError, "1.7B"):
            validation.validation_tables(doc)

    def test_mean_max_computed_when_absent(self):
        doc = {"tables": [{"name": "x", "rows": [{"label": "a", "published": 100, "predicted": 120},
                                                 {"label": "b", "published": 100, "predicted": 95}]}]}
        t = validation.validation_tables(doc)[0]
        self.assertAlmostEqual(t.mean_abs_error, 0.125)
        self.assertAlmostEqual(t.max_abs_error, 0.2)
        self.assertEqual([r.outside_band for r in t.rows], [True, False])

    def test_not_validate_json(self):
        with self.assertRaises(ValueError):
            validation.validation_tables({"kinds": []})


class CompareTest(unittest.TestCase):
    def test_sample(self):
        kinds = compare.compare_kinds(common.load_json(DATA / "compare_sample.json"))
        self.assertEqual(kinds[0].kind, "forward")
        self.assertAlmostEqual(kinds[0].error, (0.412 - 0.398) / 0.398)
        self.assertEqual(len(kinds), 8)

    def test_error_must_match(self):
        doc = copy.deepcopy(common.load_json(DATA / "compare_sample.json"))
        doc["kinds"][1]["error"] = 0.3
        with self.assertRaisesRegex(ValueError, "backward"):
            compare.compare_kinds(doc)


class HelpersTest(unittest.TestCase):
    def test_time_unit(self):
        self.assertEqual(common.time_unit(38e-3), ("ms", 1e3))
        self.assertEqual(common.time_unit(24.0), ("s", 1.0))
        self.assertEqual(common.time_unit(2e-3)[0], "µs")

    def test_idle_intervals_merge_overlaps(self):
        S = common.Slice
        sl = [S(0, 0, "a", "forward", 0.0, 2.0), S(0, 0, "b", "backward", 1.0, 2.0), S(0, 0, "c", "forward", 5.0, 1.0)]
        self.assertEqual(common.busy_intervals(sl), [(0.0, 3.0), (5.0, 6.0)])
        self.assertEqual(common.idle_intervals(sl, 0.0, 8.0), [(3.0, 5.0), (6.0, 8.0)])


if __name__ == "__main__":
    unittest.main()

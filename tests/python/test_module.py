"""`import dssim` (python/, docs/python.md): the same reports as the CLI, errors as exceptions,
plots from dicts. Run by CTest ("python: module") with PYTHONPATH=<build>/python and $DSSIM."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import unittest
from pathlib import Path

import dssim

ROOT = Path(__file__).resolve().parents[2]
DSSIM_BIN = os.environ.get("DSSIM", str(ROOT / "build" / "dssim"))
TINY = str(ROOT / "scenarios" / "tiny" / "tiny_pp3.yaml")
GPT13B = str(ROOT / "scenarios" / "gpt13b_zero2.yaml")


def cli(*args: str, ok=(0, 3)) -> subprocess.CompletedProcess:
    p = subprocess.run([DSSIM_BIN, *args], capture_output=True, text=True)
    if p.returncode not in ok:
        raise AssertionError(f"dssim {' '.join(args)} exited {p.returncode}: {p.stderr}")
    return p


def strip_volatile(d):
    """Wall-clock fields differ between two runs of the same prediction."""
    if isinstance(d, dict):
        return {k: strip_volatile(v) for k, v in d.items() if k not in ("run_stats", "search_seconds")}
    if isinstance(d, list):
        return [strip_volatile(x) for x in d]
    return d


class LoadScenario(unittest.TestCase):
    def test_load_and_overrides(self):
        sc = dssim.load_scenario(GPT13B)
        self.assertIsInstance(sc, dssim.Scenario)
        self.assertIn("dssim.Scenario", repr(sc))
        self.assertEqual(sc.gpus, 64)
        sc2 = dssim.load_scenario(GPT13B, set={"zero.stage": 1}, gpus=128)
        self.assertEqual(sc2.gpus, 128)
        self.assertIn("stage: 1", sc2.to_yaml())
        # a list of "key=value" strings, as --set
        sc3 = dssim.load_scenario(GPT13B, set=["zero.stage=3"])
        self.assertIn("stage: 3", sc3.to_yaml())

    def test_preset_name(self):
        self.assertEqual(dssim.load_scenario("gpt175b").gpus, dssim.load_scenario(ROOT / "scenarios/gpt175b.yaml").gpus)

    def test_deepspeed_config(self):
        with tempfile.TemporaryDirectory() as d:
            cfg = Path(d) / "ds.json"
            cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
            self.assertIn("stage: 3", dssim.load_scenario(GPT13B, deepspeed_config=cfg).to_yaml())

    def test_bad_key_raises_the_cli_message(self):
        with self.assertRaises(dssim.ConfigError) as ctx:
            dssim.load_scenario(GPT13B, set={"parallel.pq": 2})
        p = cli("scenario", GPT13B, "--backend", "analytic", "--set", "parallel.pq=2", ok=(2,))
        self.assertIn(str(ctx.exception), p.stderr)
        self.assertTrue(issubclass(dssim.ConfigError, ValueError))

    def test_missing_file(self):
        with self.assertRaises(dssim.ConfigError):
            dssim.load_scenario("no/such/scenario.yaml")


class Predict(unittest.TestCase):
    def test_analytic_equals_cli_json(self):
        r = dssim.predict(dssim.load_scenario(GPT13B), backend="analytic")
        c = json.loads(cli("scenario", GPT13B, "--backend", "analytic", "--json").stdout)
        self.assertEqual(strip_volatile(r), strip_volatile(c))
        self.assertEqual(set(r["memory_bytes"]), set(c["memory_bytes"]))

    def test_path_and_default_backend(self):
        r = dssim.predict(GPT13B)
        self.assertGreater(r["throughput"]["iteration_seconds"], 0)

    @unittest.skipUnless(dssim.has_sim, "built without SimGrid")
    def test_sim_equals_cli_and_writes_trace(self):
        with tempfile.TemporaryDirectory() as d:
            t = Path(d) / "t.json"
            r = dssim.predict(TINY, backend="sim", trace=t)
            self.assertTrue(t.exists())
            c = json.loads(cli("scenario", TINY, "--backend", "sim", "--json").stdout)
            self.assertEqual(strip_volatile(r), strip_volatile(c))
            self.assertIn("traceEvents", json.loads(t.read_text()))

    def test_does_not_fit_is_a_report(self):
        r = dssim.predict(dssim.load_scenario(GPT13B, set={"zero.stage": 0}))
        c = json.loads(cli("scenario", GPT13B, "--backend", "analytic", "--json", "--set", "zero.stage=0").stdout)
        self.assertEqual(r["fits"], c["fits"])

    def test_bad_backend(self):
        with self.assertRaises(dssim.ConfigError):
            dssim.predict(GPT13B, backend="gpu")
        with self.assertRaises(dssim.ConfigError):
            dssim.predict(GPT13B, backend="analytic", trace="t.json")


class Plan(unittest.TestCase):
    def test_plan_equals_cli_json(self):
        args = dict(vary=["tp", "pp", "micro_batch"], top=3)
        r = dssim.plan(GPT13B, **args)
        c = json.loads(cli("plan", GPT13B, "--vary", "tp,pp,micro_batch", "--top", "3", "--json").stdout)
        self.assertEqual(r["schema"], "dssim.plan/1")
        self.assertEqual(strip_volatile(r), strip_volatile(c))

    def test_plan_sweep_and_fix(self):
        r = dssim.plan(GPT13B, gpus=[32, 64], top=1, vary=["tp", "pp"], fix={"zero.stage": 1})
        self.assertEqual([p["gpus"] for p in r["plans"]], [32, 64])
        for p in r["plans"]:
            self.assertEqual(p["ranked"][0]["config"]["zero_stage"], 1)

    def test_nothing_fits_carries_the_cli_message(self):
        with self.assertRaises(dssim.ConfigError) as ctx:
            dssim.plan(GPT13B, gpus=1, vary=["tp", "micro_batch"])
        p = cli("plan", GPT13B, "--gpus", "1", "--vary", "tp,micro_batch", ok=(3,))
        self.assertIn("no configuration of", str(ctx.exception))
        self.assertIn(f"dssim plan: error: {ctx.exception}", p.stderr)

    def test_plan_errors(self):
        with self.assertRaises(dssim.ConfigError):
            dssim.plan(GPT13B, vary=["colour"])
        with self.assertRaises(dssim.ConfigError):
            dssim.plan(GPT13B, objective="speed")


class Plots(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise unittest.SkipTest("no matplotlib")
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def png(self, p):
        self.assertIsInstance(p, dssim.plots.Png)
        self.assertEqual(p.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
        self.assertEqual(p._repr_png_()[:4], b"\x89PNG")

    def test_memory_breakdown(self):
        reports = [dssim.predict(dssim.load_scenario(GPT13B, set={"zero.stage": k})) for k in range(4)]
        self.png(dssim.plots.memory_breakdown(reports, out=Path(self.tmp.name) / "m.png"))
        self.png(dssim.plots.memory_breakdown(reports[0]))  # one report, temporary file

    @unittest.skipUnless(dssim.has_sim, "built without SimGrid")
    def test_pipeline_timeline(self):
        t = Path(self.tmp.name) / "t.json"
        r = dssim.predict(TINY, backend="sim", trace=t)
        self.png(dssim.plots.pipeline_timeline(t, report=r, out=Path(self.tmp.name) / "t.png"))

    def test_scaling_and_plan_sweep(self):
        reports = [dssim.predict(dssim.load_scenario(GPT13B, gpus=n)) for n in (32, 64, 128)]
        self.png(dssim.plots.scaling(reports, out=Path(self.tmp.name) / "s.png"))
        doc = dssim.plan(GPT13B, gpus=[32, 64], top=1, vary=["tp", "pp"])
        self.png(dssim.plots.plan_sweep(doc, out=Path(self.tmp.name) / "p.png"))


if __name__ == "__main__":
    unittest.main()

"""bench/kernel_trace_summary.py --by-instruction on a hand-made kineto trace: each kernel goes to
the instruction whose range holds its launch (whichever thread launched it, wherever the GPU ran
it), under the op that launched it with its input shapes; kernels launched outside every range are
counted apart."""
import importlib.util
import os
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "kernel_trace_summary", os.path.join(HERE, "..", "..", "bench", "kernel_trace_summary.py"))
kts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kts)


def scope(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": 1}


def launch(corr, ts, tid, ext=None, driver=False):
    args = {"correlation": corr}
    if ext is not None:
        args["External id"] = ext
    return {"ph": "X", "cat": "cuda_driver" if driver else "cuda_runtime",
            "name": "cuLaunchKernelEx" if driver else "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid, "args": args}


def kernel(name, corr, ts, dur, ext=None):
    args = {"correlation": corr}
    if ext is not None:
        args["External id"] = ext
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}


class ByInstruction(unittest.TestCase):
    def setUp(self):
        self.events = [
            scope("dssim forward/none mb 0 layers 0+2", 0, 100),
            scope("dssim forward/none mb 1 layers 0+2", 100, 100),
            scope("dssim backward/none mb 0 layers 0+2", 200, 100),
            {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 5, "dur": 10, "tid": 1,
             "args": {"External id": 7, "Input Dims": [[6144], [16384, 2048], [2048, 6144], [], []]}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 105, "dur": 10, "tid": 1,
             "args": {"External id": 8, "Input Dims": [[6144], [16384, 2048], [2048, 6144], [], []]}},
            launch(1, 6, 1, 7), kernel("gemm", 1, 400, 600, 7),       # runs after its range: still forward mb 0
            launch(2, 106, 1, 8, driver=True), kernel("gemm", 2, 1000, 500, 8),  # forward mb 1, by the driver API
            launch(3, 150, 1), kernel("layernorm", 3, 1500, 20),      # forward mb 1, no op
            launch(4, 250, 2), kernel("dgrad", 4, 1600, 300),         # backward, launched by another thread
            launch(5, 350, 1), kernel("adam", 5, 2000, 40),           # outside every instruction
        ]
        self.kernels = sorted((e for e in self.events if e.get("cat") == "kernel"), key=lambda e: e["ts"])

    def test_attribution(self):
        kinds, unplaced = kts.attribute(self.events, self.kernels)
        self.assertEqual(list(kinds), ["forward/none", "backward/none"])
        fwd = kinds["forward/none"]
        self.assertEqual(fwd["instructions"], 2)
        self.assertEqual(fwd["us"], 600 + 500 + 20)
        self.assertEqual(fwd["rows"][("aten::addmm [6144] [16384,2048] [2048,6144]", "gemm")], [1100.0, 2])
        self.assertEqual(fwd["rows"][("(no op)", "layernorm")], [20.0, 1])
        # Per instruction, first kernel to last: mb 0 600 us, mb 1 from 1000 to 1520.
        self.assertEqual(fwd["span_us"], 600 + 520)
        bwd = kinds["backward/none"]
        self.assertEqual((bwd["instructions"], bwd["us"]), (1, 300))
        self.assertEqual(unplaced, 40)

    def test_trace_without_ranges_is_refused(self):
        events = [e for e in self.events if e.get("cat") != "user_annotation"]
        with self.assertRaises(SystemExit) as cm:
            kts.attribute(events, self.kernels)
        self.assertIn("no dssim instruction ranges", str(cm.exception))


if __name__ == "__main__":
    unittest.main()

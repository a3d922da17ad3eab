#!/usr/bin/env python3
"""SM clock and board power of a compute-bound and a memory-bound loop on one GPU.

dssim's cluster.gpu.power_limit (core/device_model.cpp power_limit_clock_factor) slows FLOP-bound
kernels by (limit / TDP)^(1/3) and leaves memory-bound kernels alone, on the premise that only the
former draw enough power to reach the board limit, which the driver then enforces by lowering the
SM clock. This script shows what a GPU does: it runs, for --seconds each,

  gemm: back-to-back bf16 matrix products (--size cubed, the tensor cores' sustained load),
  copy: back-to-back device-to-device copies of a --copy-gib buffer (HBM-bound),

while a sampler thread reads the SM clock, the board power, the power limit and the active
clock-throttle reasons every --interval seconds (pynvml when importable, else nvidia-smi). It
prints, per loop, the median SM MHz and watts over the loop's second half (after the clock has
settled), the achieved TFLOP/s or GB/s, and whether the power cap was among the throttle reasons.
Run it at the default limit and again under `nvidia-smi -pl <watts>` (root) to see the clock a
limit buys; the factor dssim assumes is the cube root of the power ratio.

    python3 bench/gemm_power_clock.py [--device 0] [--seconds 20] [--size 8192] [--copy-gib 4] [--json]

Needs torch with CUDA; no dssim build.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import threading
import time

import torch

THROTTLE_SW_POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap (nvml.h)
THROTTLE_HW_SLOWDOWN = 0x8


class Sampler:
    """Samples SM clock (MHz), power draw (W), power limit (W) and throttle-reason bits."""

    def __init__(self, index, interval):
        self.index, self.interval = index, interval
        self.samples = []  # (t, sm_mhz, watts, limit_w, reasons)
        self._stop = threading.Event()
        self._nvml = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            if shutil.which("nvidia-smi") is None:
                raise SystemExit("neither pynvml (pip install nvidia-ml-py) nor nvidia-smi is available")

    def read(self):
        if self._nvml:
            n, h = self._nvml, self._handle
            sm = n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)
            watts = n.nvmlDeviceGetPowerUsage(h) / 1000.0
            limit = n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            try:
                reasons = n.nvmlDeviceGetCurrentClocksThrottleReasons(h)
            except Exception:
                reasons = 0
            return sm, watts, limit, reasons
        out = subprocess.run(
            ["nvidia-smi", "-i", str(self.index), "--format=csv,noheader,nounits",
             "--query-gpu=clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active"],
            capture_output=True, text=True, check=True).stdout.strip().split(",")
        sm, watts, limit, reasons = (x.strip() for x in out)
        return float(sm), float(watts), float(limit), int(reasons, 16) if reasons.startswith("0x") else 0

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), *self.read()))
            self._stop.wait(self.interval)

    def start(self):
        self._stop.clear()
        self.samples = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.samples


def run_loop(name, step, seconds, sampler, device):
    """Runs step() back to back for `seconds`; returns calls and the steady-state samples."""
    step()
    torch.cuda.synchronize(device)
    sampler.start()
    t0 = time.monotonic()
    calls = 0
    while time.monotonic() - t0 < seconds:
        for _ in range(10):
            step()
        calls += 10
        torch.cuda.synchronize(device)
    elapsed = time.monotonic() - t0
    samples = sampler.stop()
    steady = [s for s in samples if s[0] - t0 >= seconds / 2] or samples
    return {
        "loop": name,
        "calls": calls,
        "seconds": elapsed,
        "sm_mhz": statistics.median(s[1] for s in steady),
        "sm_mhz_min": min(s[1] for s in steady),
        "sm_mhz_max": max(s[1] for s in steady),
        "watts": statistics.median(s[2] for s in steady),
        "power_limit_w": statistics.median(s[3] for s in steady),
        "power_capped": any(s[4] & THROTTLE_SW_POWER_CAP for s in steady),
        "hw_slowdown": any(s[4] & THROTTLE_HW_SLOWDOWN for s in steady),
        "samples": len(steady),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=20.0, help="per loop")
    ap.add_argument("--size", type=int, default=8192, help="GEMM m = n = k")
    ap.add_argument("--copy-gib", type=float, default=4.0, help="copy buffer size")
    ap.add_argument("--interval", type=float, default=0.1, help="sampling period, seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda", args.device)
    sampler = Sampler(args.device, args.interval)
    n = args.size
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    elems = int(args.copy_gib * 2**30) // 2
    src = torch.empty(elems, device=device, dtype=torch.bfloat16).fill_(1.0)
    dst = torch.empty_like(src)

    gemm = run_loop("gemm", lambda: torch.matmul(a, b, out=c), args.seconds, sampler, device)
    gemm["tflops"] = gemm["calls"] * 2.0 * n**3 / gemm["seconds"] / 1e12
    copy = run_loop("copy", lambda: dst.copy_(src), args.seconds, sampler, device)
    copy["gb_per_s"] = copy["calls"] * 2.0 * src.numel() * src.element_size() / copy["seconds"] / 1e9  # read + write

    rows = [gemm, copy]
    if args.json:
        print(json.dumps({"gpu": torch.cuda.get_device_name(device), "rows": rows}, indent=2))
        return
    print(f"GPU {args.device}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"{'loop':<6} {'SM MHz (median, min-max)':>26} {'watts':>7} {'limit W':>8} {'power-capped':>13}  rate")
    for r in rows:
        rate = f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else f"{r['gb_per_s']:.0f} GB/s"
        mhz = f"{r['sm_mhz']:.0f} ({r['sm_mhz_min']:.0f}-{r['sm_mhz_max']:.0f})"
        print(f"{r['loop']:<6} {mhz:>26} {r['watts']:>7.0f} {r['power_limit_w']:>8.0f} "
              f"{'yes' if r['power_capped'] else 'no':>13}  {rate}")
    g, cp = gemm, copy
    print(f"GEMM clock / copy clock = {g['sm_mhz'] / cp['sm_mhz']:.3f}; "
          f"dssim's factor at this limit would be (limit / TDP)^(1/3)")


if __name__ == "__main__":
    main()

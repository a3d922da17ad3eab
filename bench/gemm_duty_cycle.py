#!/usr/bin/env python3
"""Does a GEMM run faster between memory-bound kernels than back to back (as `dssim calibrate` times
it)? Times the 1.3B block's GEMM shapes and one of the 7B's (bf16, x @ W^T as the engine runs them),
each by CUDA events around every call: (a) back to back, (b) with a device copy of about the GEMM's
duration between calls, (c) with a 1 ms copy between. Prints the median ms and TFLOP/s of each, and
the SM clock and board power (gemm_power_clock.py's Sampler: pynvml, else nvidia-smi) read at the
end of each loop.

On an H200 (2026-12-06): back to back the GEMMs ran at 1,470-1,605 MHz, at the 700 W cap; with a
copy of about their duration between them at 1,665-1,875 MHz and 9-18 % more TFLOP/s; with 1 ms
copies at 1,965-1,980 MHz (docs/torch-backend.md, sixth stop).

    python3 bench/gemm_duty_cycle.py          # about 70 s; needs torch with CUDA, no dssim build
    python3 bench/gemm_duty_cycle.py --weights-std 0.02   # adds a back-to-back row per shape with W at
                                              # GPT's initial scale (does the data change the power?)
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_power_clock import Sampler  # noqa: E402  (pynvml, else nvidia-smi)

SHAPES = [("qkv 16384x6144x2048", 16384, 6144, 2048), ("mlp_up 16384x8192x2048", 16384, 8192, 2048),
          ("mlp_down 16384x2048x8192", 16384, 2048, 8192), ("proj 16384x2048x2048", 16384, 2048, 2048),
          ("7b qkv 4096x12288x4096", 4096, 12288, 4096)]


def run(m, n, k, gap_bytes, sampler, seconds=4.0, w_std=1.0):
    """Median ms of x @ W^T timed by CUDA events around each call, a copy of gap_bytes between calls
    (none for 0), over `seconds`; its TFLOP/s; the SM clock and board power read at the end."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * w_std
    src = torch.empty(max(gap_bytes // 2, 1), device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    times = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        evs = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.nn.functional.linear(x, w)
            b.record()
            evs.append((a, b))
            if gap_bytes:
                dst.copy_(src)
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) for a, b in evs]
    ms = statistics.median(times[len(times) // 4:])
    sm, watts, _, _ = sampler.read()
    return ms, 2.0 * m * n * k / (ms * 1e-3) / 1e12, "%d MHz, %.2f W" % (sm, watts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights-std", type=float, default=0.0,
                    help="also time each shape back to back with W ~ N(0, this std) (0: not)")
    args = ap.parse_args()
    sampler = Sampler(torch.cuda.current_device(), 0.1)
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, m, n, k in SHAPES:
        gemm_ms, _, _ = run(m, n, k, 0, sampler, 1.0)
        # A copy of about the GEMM's duration: bytes = 2 x size moved at ~3 TB/s.
        same = int(gemm_ms * 1e-3 * 3.0e12 / 2)
        rows = [("back to back", 0, 1.0), ("+ copy ~same time", same, 1.0), ("+ 1 ms copy", int(1e-3 * 3.0e12 / 2), 1.0)]
        if args.weights_std > 0:
            rows.insert(1, ("b2b W std %g" % args.weights_std, 0, args.weights_std))
        for label, gap, std in rows:
            ms, tf, ck = run(m, n, k, gap, sampler, w_std=std)
            print("%-26s %-18s %8.4f ms %7.1f TFLOP/s   clock,power at end: %s" % (name, label, ms, tf, ck))
            sys.stdout.flush()


if __name__ == "__main__":
    main()

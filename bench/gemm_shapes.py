#!/usr/bin/env python3
"""bf16 GEMM TFLOP/s on one GPU at a model's linear-layer shapes (forward y = x W^T), timed with
CUDA events, median of --iters after --warmup. A cross-check of a GPU preset's gemm_efficiency
plateau (scenarios/gpus/) against the GPU at hand, at the shapes a run actually has. Not a test.

    python3 bench/gemm_shapes.py [--tokens 16384] [--shapes 4096x4096,4096x1024,4096x14336,14336x4096]
                                 [--peak-tflops 989.5]

Each shape is K x N: x is [tokens, K], W is [N, K]. Defaults: Llama 3 8B's q / o (4096 x 4096), k / v
(4096 x 1024), w1 / w3 (4096 x 14336) and w2 (14336 x 4096) at 16,384 tokens (torchtitan's local
batch 2 x 8,192), and 8192^3.
"""
import argparse

import torch

from attention_backends import timed  # CUDA-event median (this folder is on sys.path when run as a script)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shapes", default="4096x4096,4096x1024,4096x14336,14336x4096")
    ap.add_argument("--peak-tflops", type=float, default=989.5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    shapes = [(a.tokens, int(k), int(n)) for k, n in (s.split("x") for s in a.shapes.split(","))] + [(8192, 8192, 8192)]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16, y = x W^T")
    print(f"{'M x K x N':>22s} {'ms':>8s} {'TFLOP/s':>8s} {'of peak':>8s}")
    for m, k, n in shapes:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        ms = timed(lambda: torch.nn.functional.linear(x, w), a.warmup, a.iters)
        tf = 2.0 * m * k * n / ms / 1e9
        print(f"{f'{m} x {k} x {n}':>22s} {ms:8.3f} {tf:8.1f} {tf / a.peak_tflops:8.3f}")


if __name__ == "__main__":
    main()

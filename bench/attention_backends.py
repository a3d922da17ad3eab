#!/usr/bin/env python3
"""Causal attention on one GPU, backend by backend: the time of PyTorch's scaled_dot_product_attention
forward and forward + backward with each kernel it can dispatch to (flash, cuDNN, memory-efficient),
and which one its default dispatch picks, at a GPT shape. Prints ms per call and the attention's
TFLOP/s (causal: half of 4 b h s^2 d forward, 2.5x that for forward + backward). Timed with CUDA
events, median of --iters calls after --warmup. A diagnostic for backends/torch (which kernel the
engine should ask for): not a test.

    python3 bench/attention_backends.py [--batch 8 --heads 16 --seq 2048 --head-dim 128] [--packed]
"""
import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--packed", action="store_true", help="q, k, v as strided views of one [B, S, 3, a, d] tensor")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    if a.packed:  # dssim's engine: q, k, v as strided views of the QKV projection's [B, S, 3, a, d] output
        qkv = torch.randn(a.batch, a.seq, 3, a.heads, a.head_dim, dtype=dt, device=dev)
        q, k, v = (qkv[:, :, i].transpose(1, 2).detach().requires_grad_(True) for i in range(3))
    else:
        q, k, v = (torch.randn(shape, dtype=dt, device=dev).requires_grad_(True) for _ in range(3))
    go = torch.randn(shape, dtype=dt, device=dev)
    flops_fwd = 2.0 * a.batch * a.heads * a.seq * a.seq * a.head_dim  # causal: half of 4 b h s^2 d
    ref = None
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, "
          f"q/k/v {list(shape)} bf16, causal, {'packed [B, S, 3, a, d] views' if a.packed else 'contiguous'}")
    if hasattr(torch._C, "_get_sdp_priority_order"):  # 0 math, 1 flash, 2 efficient, 3 cudnn, 4 overrideable
        print("priority order:", list(torch._C._get_sdp_priority_order()))
    print(f"{'backend':22s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'fwd TF/s':>9s} {'f+b TF/s':>9s} {'max |diff|':>11s}")
    for name, be in [("default dispatch", None), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        ctx = sdpa_kernel([be]) if be is not None else contextlib.nullcontext()
        try:
            with ctx:
                def fwd():
                    with torch.no_grad():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def fwd_bwd():
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    torch.autograd.backward([out], [go])
                    for t in (q, k, v):
                        t.grad = None

                out = fwd()
                if ref is None:
                    ref = out.float()
                diff = (out.float() - ref).abs().max().item()
                tf, tb = timed(fwd, a.warmup, a.iters), timed(fwd_bwd, a.warmup, a.iters)
            print(f"{name:22s} {tf:8.3f} {tb:11.3f} {flops_fwd / tf / 1e9:9.1f} {3.5 * flops_fwd / tb / 1e9:9.1f} {diff:11.2e}")
        except Exception as e:  # a backend this build or shape cannot run
            print(f"{name:22s} not available: {str(e).splitlines()[0][:80]}")
    if hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        print(f"cudnn_sdp_enabled {torch.backends.cuda.cudnn_sdp_enabled()}, flash_sdp_enabled {torch.backends.cuda.flash_sdp_enabled()}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where a GPT block's forward and backward time goes on a GPU, kernel by kernel.

The block is backends/torch/gpt.cpp's, op for op (LayerNorm, QKV linear unbound into q, k, v, causal SDPA, projection,
residual, LayerNorm, MLP with tanh GELU, residual), with the parameters' .grad preset to views of
a flat buffer as the engine's (so autograd accumulates in place), plus the head (final LayerNorm,
tied logits, fp32 cross-entropy) and the embedding. torch.profiler sums CUDA kernel time per
kernel name over a few iterations; the table groups them. A diagnostic for the device model
(core/model.cpp's op list): it is not used by dssim itself.

    python3 bench/profile_layer.py [--hidden 2048 --heads 16 --tokens 16384 --seq 2048 --vocab 51200]
"""
import argparse
import collections

import torch
import torch.nn.functional as F


def block_params(h, f, dtype, dev):
    shapes = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (f, h), (f,), (h, f), (h,)]
    n = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.randn(n, dtype=dtype, device=dev) * 0.02
    grad = torch.zeros(n, dtype=dtype, device=dev)
    ps, off = [], 0
    for s in shapes:
        k = torch.Size(s).numel()
        p = flat[off:off + k].view(s).detach().requires_grad_(True)
        p.grad = grad[off:off + k].view(s)
        ps.append(p)
        off += k
    return ps


UNBIND = False
QKV_FUNCTION = False


class QkvAttention(torch.autograd.Function):
    """Causal attention on q, k, v read from the QKV projection's output [B, S, 3h] (as
    backends/torch/gpt.cpp's QkvAttention): the backward writes dq, dk, dv straight into one
    [B, S, 3, heads, d] gradient instead of autograd's stack + contiguous copy of unbind / permute."""

    @staticmethod
    def forward(ctx, qkv, heads):
        B, S, three_h = qkv.shape
        d = three_h // 3 // heads
        with torch.enable_grad():
            base = qkv.detach().view(B, S, 3, heads, d)
            q, k, v = (base[:, :, i].transpose(1, 2).requires_grad_(True) for i in range(3))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ctx.graph = (q, k, v, out)
        return out.detach()

    @staticmethod
    def backward(ctx, go):
        q, k, v, out = ctx.graph
        dq, dk, dv = torch.autograd.grad([out], [q, k, v], [go])
        B, heads, S, d = dq.shape
        g = torch.empty(B, S, 3, heads, d, dtype=dq.dtype, device=dq.device)
        for i, t in enumerate((dq, dk, dv)):
            g[:, :, i].copy_(t.transpose(1, 2))
        del ctx.graph
        return g.view(B, S, 3 * heads * d), None


def block(ps, x, heads):
    B, S, h = x.shape
    d = h // heads
    y = F.layer_norm(x, (h,), ps[0], ps[1], 1e-5)
    if QKV_FUNCTION:
        core = QkvAttention.apply(F.linear(y, ps[2], ps[3]), heads)
    else:
        qkv = F.linear(y, ps[2], ps[3]).view(B, S, 3, heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0) if UNBIND else (qkv[0], qkv[1], qkv[2])
        core = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    att = core.transpose(1, 2).reshape(B, S, h)
    x1 = x + F.linear(att, ps[4], ps[5])
    y2 = F.layer_norm(x1, (h,), ps[6], ps[7], 1e-5)
    m = F.gelu(F.linear(y2, ps[8], ps[9]), approximate="tanh")
    return x1 + F.linear(m, ps[10], ps[11])


def category(name):
    n = name.lower()
    for key, cat in [("flash", "attention (flash)"), ("fmha", "attention (flash)"), ("attention", "attention (flash)"),
                     ("gemm", "gemm"), ("cutlass", "gemm"), ("sm90", "gemm"), ("nvjet", "gemm"), ("ampere", "gemm"),
                     ("layer_norm", "layer_norm"), ("layernorm", "layer_norm"), ("gelu", "gelu"),
                     ("reduce", "reduction (bias grad, sums)"), ("softmax", "log_softmax"), ("nll", "nll_loss"),
                     ("embedding", "embedding"), ("index", "embedding"), ("sort", "embedding"),
                     ("copy", "copy / cast"), ("fill", "fill / zero"), ("add", "add / accumulate"),
                     ("mul", "elementwise other")]:
        if key in n:
            return cat
    return "other: " + name[:40]


RAW = False


def profile(fn, iters=3):
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    by = collections.defaultdict(float)
    for e in p.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        by[e.key[:90] if RAW else category(e.key)] += us / 1e6 / iters
    return by


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--select", action="store_true", help="q, k, v = qkv[i] instead of gpt.cpp's qkv.unbind(0)")
    ap.add_argument("--block-only", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="one row per kernel name instead of per group")
    ap.add_argument("--qkv-function", action="store_true", help="QkvAttention (one gradient write) instead of unbind")
    ap.add_argument("--compile", action="store_true", help="the block and the head under torch.compile (what Inductor fuses)")
    a = ap.parse_args()
    global UNBIND, RAW
    UNBIND = not a.select
    RAW = a.kernels
    global QKV_FUNCTION
    QKV_FUNCTION = a.qkv_function
    dev, dt = "cuda", torch.bfloat16
    blk = torch.compile(block) if a.compile else block
    h, f, B, S = a.hidden, 4 * a.hidden, a.tokens // a.seq, a.seq
    ps = block_params(h, f, dt, dev)
    x = (torch.randn(B, S, h, dtype=dt, device=dev)).requires_grad_(True)
    g = torch.randn(B, S, h, dtype=dt, device=dev)

    def fwd():
        with torch.no_grad():
            blk(ps, x, a.heads)

    def fwd_bwd():
        out = blk(ps, x, a.heads)
        torch.autograd.backward([out], [g])
        x.grad = None

    wte = (torch.randn(a.vocab, h, dtype=dt, device=dev) * 0.02).requires_grad_(True)
    wte.grad = torch.zeros_like(wte)
    lnw = torch.ones(h, dtype=dt, device=dev, requires_grad=True)
    lnb = torch.zeros(h, dtype=dt, device=dev, requires_grad=True)
    tgt = torch.randint(0, a.vocab, (B * S,), device=dev)
    xh = torch.randn(B, S, h, dtype=dt, device=dev).requires_grad_(True)

    def head_loss(xh, lnw, lnb, wte, tgt):
        y = F.layer_norm(xh, (h,), lnw, lnb, 1e-5)
        return F.cross_entropy((y @ wte.t()).view(-1, a.vocab).float(), tgt)

    hl = torch.compile(head_loss) if a.compile else head_loss

    def head_fwd():
        with torch.no_grad():
            hl(xh, lnw, lnb, wte, tgt)

    def head_fwd_bwd():
        hl(xh, lnw, lnb, wte, tgt).backward()
        xh.grad = None

    if a.qkv_function:  # the same gradients as the unbind path
        grads = []
        for flag in (False, True):
            QKV_FUNCTION = flag
            for p in ps:
                p.grad.zero_()
            out = block(ps, x, a.heads)
            torch.autograd.backward([out], [g])
            grads.append([x.grad.float().clone()] + [p.grad.float().clone() for p in ps] + [out.detach().float()])
            x.grad = None
        QKV_FUNCTION = True
        diff = max((u - w).abs().max().item() for u, w in zip(*grads))
        scale = max(u.abs().max().item() for u in grads[0])
        print(f"QkvAttention vs unbind: max |difference| of output, input and parameter gradients {diff:.3e} (largest value {scale:.3e})")
    rows = []
    qs = [torch.randn(B, a.heads, S, h // a.heads, dtype=dt, device=dev).requires_grad_(True) for _ in range(3)]
    go = torch.randn(B, a.heads, S, h // a.heads, dtype=dt, device=dev)

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(*qs, is_causal=True)

    def sdpa_fwd_bwd():
        torch.autograd.backward([F.scaled_dot_product_attention(*qs, is_causal=True)], [go])
        for t in qs:
            t.grad = None

    todo = [("block", fwd, fwd_bwd), ("sdpa alone", sdpa_fwd, sdpa_fwd_bwd)]
    if not a.block_only:
        todo.append(("head", head_fwd, head_fwd_bwd))
    for label, f1, f2 in todo:
        fw = profile(f1)
        both = profile(f2)
        cats = sorted(set(fw) | set(both), key=lambda c: -both.get(c, 0))
        torch.cuda.reset_peak_memory_stats()
        f2()
        torch.cuda.synchronize()
        print(f"\n{label}{' (torch.compile)' if a.compile else ''}: peak memory of forward + backward {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        print(f"{label}: h {h}, tokens {a.tokens}, seq {S} (ms per call)")
        W = 90 if RAW else 34
        print(f"  {'kernel group':{W}s} {'forward':>9s} {'backward':>9s}")
        tf = tb = 0.0
        for c in cats:
            vf = fw.get(c, 0.0) * 1e3
            vb = max(0.0, both.get(c, 0.0) * 1e3 - vf)
            tf += vf
            tb += vb
            print(f"  {c:{W}s} {vf:9.3f} {vb:9.3f}")
        print(f"  {'total':{W}s} {tf:9.3f} {tb:9.3f}   backward / forward {tb / tf if tf else 0:.2f}")
        rows.append((label, tf, tb))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The same GPT as dssim's torch backend, trained by plain PyTorch: the baseline that
scripts/gpu_bench.sh runs next to `dssim run`. Pre-LN blocks, causal SDPA (flash on GPUs), GELU MLP,
tied LM head; fp32 parameters with bf16 autocast and fused AdamW (the standard PyTorch recipe),
eager, or with `--compile` the same model under torch.compile (default mode, Inductor). Prints one
JSON line with tokens/s, MFU (Megatron's model-FLOP formula) and peak memory."""
import argparse, json, math, statistics, time
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, ffn)
        self.fc2 = nn.Linear(ffn, h)

    def forward(self, x):
        B, S, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, h, heads, vocab, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, 4 * h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if n.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif "ln" in n and n.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        S = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(S, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def model_flops(l, h, V, s, batch):  # Megatron (Narayanan et al. 2021) eq. 3, as dssim's core
    return 72.0 * batch * s * l * h * h * (1 + s / (6.0 * h) + V / (12.0 * h * l))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.5)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (compiled in the warm-up steps)")
    ap.add_argument("--trace", metavar="FILE", help="write a kineto trace (Chrome JSON) of the last step, for "
                    "bench/kernel_trace_summary.py; that step is not timed")
    a = ap.parse_args()
    torch.manual_seed(1234)
    dev = "cuda"
    model = GPT(a.layers, a.hidden, a.heads, a.vocab, a.seq).to(dev)
    step_model = torch.compile(model) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    times, losses = [], []
    total_steps = a.warmup + a.steps + (1 if a.trace else 0)
    for step in range(total_steps):
        tracing = a.trace and step == total_steps - 1
        if tracing:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(a.grad_accum):
            idx = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_model(idx[:, :-1], idx[:, 1:]) / a.grad_accum
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(float(total))
        if tracing:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(a.trace)
            print(f"plain: trace of step {step + 1} written to {a.trace}", flush=True)
        elif step >= a.warmup:
            times.append(dt)
        if step == a.warmup - 1:
            torch.cuda.reset_peak_memory_stats()  # compilation's own workspace is not the step's
        print(f"plain step {step + 1}/{total_steps}  loss {losses[-1]:.4f}  {dt:.3f} s", flush=True)
    t = statistics.median(times)
    batch = a.micro_batch * a.grad_accum
    flops = model_flops(a.layers, a.hidden, a.vocab, a.seq, batch)
    out = {"iteration_seconds": t, "tokens_per_second": batch * a.seq / t,
           "model_tflops_per_gpu": flops / t / 1e12, "mfu": flops / t / (a.peak_tflops * 1e12),
           "peak_memory_bytes": torch.cuda.max_memory_allocated(), "losses": losses,
           "mode": "compile" if a.compile else "eager", "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    print("PLAIN_JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

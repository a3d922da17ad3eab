#!/usr/bin/env python3
"""Host (CPU) time of DeepSpeed ZeRO-3's gradient reduce path per call, without the collective.

DeepSpeed's stage-3 engine reduces each gradient bucket with
deepspeed/runtime/comm/coalesced_collectives.py reduce_scatter_coalesced (the same algorithm from
v0.6 to today): for every tensor of the bucket it makes one view per data-parallel rank
(N Python slices), interleaves them rank-major into a list (N x k entries, padding where a tensor
does not divide N), concatenates the list into one flat buffer (torch.cat of N x k inputs, unless
the bucket is one tensor that divides N), pre-divides, chunks it N ways and launches one
reduce-scatter. All of it runs on the host thread inside the backward hook, so it delays the launch
of the next backward kernels. This script times that host work (the reduce-scatter itself is not
called: one GPU), written from the algorithm's description, for bucket shapes of GPT-3 175B's
layers, over the data-parallel sizes of the Azure ZeRO-3 runs, and prints the host seconds per
call and per (tensor x rank) pair, which core/zero3_placement prices as ZeroSpec's host cost.

    python3 bench/zero3_host_overhead.py [--device cuda|cpu] [--repeats R] [--json]
"""
import argparse
import json
import math
import time

import torch


def host_reduce_path(tensors, world):
    """The host work of one coalesced reduce-scatter call for `world` ranks (no collective)."""
    slices = []
    for t in tensors:
        flat = t.view(-1)
        chunk = math.ceil(t.numel() / world)
        slices.append([flat[r * chunk:r * chunk + chunk] for r in range(world)])
    padded = tuple(math.ceil(t.numel() / world) for t in tensors)
    if len(tensors) == 1 and tensors[0].numel() % world == 0:
        buf = tensors[0].view(-1)
    else:
        pieces = []
        for r in range(world):
            for i in range(len(tensors)):
                piece = slices[i][r]
                pieces.append(piece)
                pad = padded[i] - piece.numel()
                if pad > 0:
                    pieces.append(torch.empty(pad, dtype=piece.dtype, device=piece.device))
        buf = torch.cat(pieces)
    buf.div_(world)
    mine = torch.chunk(buf, world)[0]
    out, off = [], 0
    for i in range(len(tensors)):
        out.append(mine.narrow(0, off, slices[i][0].numel()))
        off += padded[i]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--scale", type=int, default=64,
                    help="tensor sizes divided by this (host cost does not depend on the bytes)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    h = 12288 // a.scale * 8  # keeps every size a multiple of the rank counts below
    # Buckets as the 9e7-element reduce bucket cuts a GPT-3 layer in backward order: a matrix alone
    # (one tensor), and the run of small tensors (biases, norms) between matrices (k tensors).
    shapes = {
        "one matrix (k=1, divides N)": [[4 * h * h]],
        "matrix + bias (k=2)": [[4 * h * h], [4 * h]],
        "small tensors (k=6)": [[h], [h], [h], [3 * h], [h], [4 * h]],
    }
    rows = []
    for world in (128, 256, 512, 1024, 2048):
        for label, sizes in shapes.items():
            tensors = [torch.randn(s, device=dev, dtype=torch.float16) for s in sizes]
            host_reduce_path(tensors, world)  # warm-up
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = math.inf
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                host_reduce_path(tensors, world)
                best = min(best, time.perf_counter() - t0)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            k = len(sizes)
            rows.append({"ranks": world, "bucket": label, "tensors": k, "host_seconds": best,
                         "per_tensor_rank_seconds": best / (k * world)})
    if a.json:
        print(json.dumps({"torch": torch.__version__, "device": str(dev), "rows": rows}, indent=1))
        return
    print("torch %s, %s; host time of one reduce_scatter_coalesced call without the collective (best of %d)"
          % (torch.__version__, dev, a.repeats))
    print("%6s  %-28s %10s %14s" % ("ranks", "bucket", "host ms", "us/(tensor*rank)"))
    for r in rows:
        print("%6d  %-28s %10.3f %14.2f" % (r["ranks"], r["bucket"], 1e3 * r["host_seconds"],
                                           1e6 * r["per_tensor_rank_seconds"]))


if __name__ == "__main__":
    main()

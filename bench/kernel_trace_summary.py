#!/usr/bin/env python3
"""Where a step's GPU time goes, from a kineto trace (DSSIM_KERNEL_TRACE=FILE on `dssim run
--backend cuda`, or torch.profiler's export_chrome_trace): the span from the first kernel to the
last, the time the GPU ran at least one kernel, the idle gaps, and kernel time by name.

    python3 bench/kernel_trace_summary.py TRACE.json [--top 30]
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    events = json.load(open(a.trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit("no CUDA kernels in %s" % a.trace)
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, gaps, end = 0.0, [], spans[0][0]
    for s, t in spans:
        if s > end:
            gaps.append(s - end)
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
    span = end - spans[0][0]
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e["name"]][0] += float(e["dur"])
        by_name[e["name"]][1] += 1
    total = sum(v[0] for v in by_name.values())
    print("kernels %d, span %.2f ms, GPU busy %.2f ms (%.1f %%), idle %.2f ms in %d gaps (%d over 20 us: %.2f ms)" % (
        len(kernels), span / 1e3, busy / 1e3, 100 * busy / span, (span - busy) / 1e3, len(gaps),
        sum(g > 20 for g in gaps), sum(g for g in gaps if g > 20) / 1e3))
    print("%10s %7s %6s  %s" % ("ms", "calls", "%", "kernel"))
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print("%10.3f %7d %5.1f%%  %s" % (us / 1e3, n, 100 * us / total, name[:110]))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where a step's GPU time goes, from a kineto trace (DSSIM_KERNEL_TRACE=FILE on `dssim run
--backend cuda`, or torch.profiler's export_chrome_trace): the span from the first kernel to the
last, the time the GPU ran at least one kernel, the idle gaps, kernel time by name, and the largest
gaps with the kernels either side (where the GPU waits for the host).

    python3 bench/kernel_trace_summary.py TRACE.json [--top 30] [--gaps 15]
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gaps", type=int, default=15, help="list the N largest idle gaps")
    a = ap.parse_args()
    events = json.load(open(a.trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit("no CUDA kernels in %s" % a.trace)
    kernels.sort(key=lambda e: float(e["ts"]))
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
    busy, gaps, end, last = 0.0, [], spans[0][0], None
    where = []  # (gap us, start offset us, kernel before, kernel after)
    for e, (s, t) in zip(kernels, spans):
        if s > end:
            gaps.append(s - end)
            where.append((s - end, end - spans[0][0], last["name"] if last else "", e["name"]))
        busy += max(0.0, t - max(s, end))
        if t >= end:
            last = e
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
    if a.gaps > 0 and where:
        # What the host ran meanwhile: the longest CPU ops that started in the gap.
        host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")]
        print("largest idle gaps: us, at ms, kernel before -> kernel after; host ops that started in the gap (us)")
        for g, at, before, after in sorted(where, reverse=True)[: a.gaps]:
            print("%9.1f %9.3f  %s -> %s" % (g, at / 1e3, before[:60], after[:60]))
            t0 = spans[0][0] + at
            ops = sorted((e for e in host if t0 <= float(e["ts"]) < t0 + g), key=lambda e: -float(e["dur"]))[:4]
            if ops:
                print("                     host: " + ", ".join("%s %.0f" % (e["name"][:40], float(e["dur"])) for e in ops))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where a step's GPU time goes, from a kineto trace (DSSIM_KERNEL_TRACE=FILE on `dssim run
--backend cuda`, or torch.profiler's export_chrome_trace): the span from the first kernel to the
last, the time the GPU ran at least one kernel, the idle gaps, kernel time by name, and the largest
gaps with the kernels either side (where the GPU waits for the host).

    python3 bench/kernel_trace_summary.py TRACE.json [--top 30] [--gaps 15]
    python3 bench/kernel_trace_summary.py TRACE.json --by-instruction [--top 30]

--by-instruction: the engine names each instruction's range in the trace ("dssim forward/none mb 0
layers 0+24"); each kernel goes to the instruction whose range holds its launch, and within an
instruction kind the kernels are summed by the op that launched them (with its input shapes) and
the kernel's name, per instruction: what to set against the device model's op list for the same
scenario (build/bench/layer_ops SCENARIO).
"""
import argparse
import bisect
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gaps", type=int, default=15, help="list the N largest idle gaps")
    ap.add_argument("--by-instruction", action="store_true",
                    help="kernel time per instruction kind, by launching op and kernel")
    a = ap.parse_args()
    events = json.load(open(a.trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit("no CUDA kernels in %s" % a.trace)
    if a.by_instruction:
        return by_instruction(events, kernels, a.top)
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


def dims(op):
    d = op.get("args", {}).get("Input Dims") or []
    return " ".join("[%s]" % ",".join(str(x) for x in t) for t in d if t)


def attribute(events, kernels):
    """Kernels by instruction kind: {kind: {"instructions", "us", "span_us", "rows": {(op label,
    kernel name): [us, calls]}}} over all instructions of the kind, and the microseconds of kernels
    launched outside every instruction's range. A kernel belongs to the instruction whose range holds
    its launch (the cuda_runtime event with its correlation id), whichever thread launched it."""
    scopes = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                     and e.get("name", "").startswith("dssim ")), key=lambda e: float(e["ts"]))
    if not scopes:
        raise SystemExit("no dssim instruction ranges in the trace (taken before the engine named them?)")
    starts = [float(e["ts"]) for e in scopes]
    # Launches through the runtime (cudaLaunchKernel) and the driver (cuLaunchKernelEx: cuBLAS's
    # GEMMs, among others).
    launch_ts = {e["args"]["correlation"]: float(e["ts"]) for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = {e["args"]["External id"]: e for e in events
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    kinds = collections.OrderedDict()
    first_last = {}  # scope index -> [first kernel start, last kernel end]
    unplaced = 0.0
    for k in kernels:
        t = launch_ts.get(k.get("args", {}).get("correlation"))
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        if i < 0 or t > starts[i] + float(scopes[i]["dur"]):
            unplaced += float(k["dur"])
            continue
        kind = scopes[i]["name"].split()[1]
        entry = kinds.setdefault(kind, {"scopes": set(), "us": 0.0, "rows": collections.defaultdict(lambda: [0.0, 0])})
        entry["scopes"].add(i)
        entry["us"] += float(k["dur"])
        op = ops.get(k.get("args", {}).get("External id"))
        label = (op["name"] + " " + dims(op)).strip() if op else "(no op)"
        row = entry["rows"][(label, k["name"])]
        row[0] += float(k["dur"])
        row[1] += 1
        s, e = float(k["ts"]), float(k["ts"]) + float(k["dur"])
        fl = first_last.setdefault(i, [s, e])
        fl[0], fl[1] = min(fl[0], s), max(fl[1], e)
    out = collections.OrderedDict()
    for kind, entry in kinds.items():
        out[kind] = {"instructions": len(entry["scopes"]), "us": entry["us"],
                     "span_us": sum(first_last[i][1] - first_last[i][0] for i in entry["scopes"]),
                     "rows": dict(entry["rows"])}
    return out, unplaced


def by_instruction(events, kernels, top):
    kinds, unplaced = attribute(events, kernels)
    for kind, entry in kinds.items():
        n = entry["instructions"]
        print("\n%s: %d instructions; per instruction: kernels %.3f ms, first kernel to last %.3f ms" % (
            kind, n, entry["us"] / n / 1e3, entry["span_us"] / n / 1e3))
        print("%10s %7s  %-60s %s" % ("ms/instr", "calls", "op [input dims]", "kernel"))
        for (label, name), (us, calls) in sorted(entry["rows"].items(), key=lambda kv: -kv[1][0])[:top]:
            print("%10.3f %7.1f  %-60s %s" % (us / n / 1e3, calls / n, label[:60], name[:70]))
    if unplaced:
        print("\nkernels launched outside any instruction: %.3f ms" % (unplaced / 1e3))


if __name__ == "__main__":
    main()

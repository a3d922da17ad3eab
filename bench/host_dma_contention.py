#!/usr/bin/env python3
"""Does a device-to-host copy into pinned memory slow the host's gradient sum (bf16 -> fp32
accumulate, as ZeRO-Offload's copy_gradients_to_host does) running at the same time? Times
acc.add_(g16) over N elements on 14 threads alone, then while a queue of D2H copies of the same
size streams into another pinned buffer; and the copies' bandwidth alone and during the sums.

The question behind it (docs/torch-backend.md, sixth stop): the offload records' copy_d2h is
under-predicted by 16-24 %; core/device_model.cpp prices the host's sum at 10 bytes an element, and
the copies' own writes into host memory (2 more) are not among them. Not yet run.

    python3 bench/host_dma_contention.py      # needs torch with CUDA and ~3 GB of pinned memory
"""
import statistics
import time

import torch


N = 200_000_000  # elements: about one GPT 7B layer's gradients


def main():
    torch.set_num_threads(14)
    g16 = torch.ones(N, dtype=torch.bfloat16).pin_memory()
    acc = torch.zeros(N, dtype=torch.float32)
    dev = torch.ones(N, dtype=torch.bfloat16, device="cuda")
    land = torch.empty(N, dtype=torch.bfloat16).pin_memory()
    stream = torch.cuda.Stream()

    def sum_once():
        t = time.perf_counter()
        acc.add_(g16)
        return time.perf_counter() - t

    def queue_copies(count):
        with torch.cuda.stream(stream):
            for _ in range(count):
                land.copy_(dev, non_blocking=True)

    for _ in range(3):
        sum_once()
    alone = [sum_once() for _ in range(7)]
    # The copies' bandwidth alone.
    torch.cuda.synchronize()
    t = time.perf_counter()
    queue_copies(5)
    stream.synchronize()
    d2h_alone = 5 * 2 * N / (time.perf_counter() - t)
    # The sum while copies land.
    both = []
    for _ in range(7):
        queue_copies(6)
        time.sleep(0.002)  # the copies are running
        both.append(sum_once())
        stream.synchronize()
    # The copies' bandwidth while sums run back to back.
    torch.cuda.synchronize()
    t = time.perf_counter()
    queue_copies(5)
    sums = 0
    while not stream.query():
        sum_once()
        sums += 1
    d2h_both = 5 * 2 * N / (time.perf_counter() - t)
    a, b = statistics.median(alone), statistics.median(both)
    print(torch.cuda.get_device_name(), "threads", torch.get_num_threads())
    print("host sum of %d bf16 into fp32 (10 bytes an element): alone %.2f ms (%.1f GB/s), during D2H %.2f ms "
          "(%.1f GB/s): x%.3f" % (N, a * 1e3, 10 * N / a / 1e9, b * 1e3, 10 * N / b / 1e9, b / a))
    print("D2H pinned: alone %.1f GB/s, during sums %.1f GB/s (%d sums)" % (d2h_alone / 1e9, d2h_both / 1e9, sums))


if __name__ == "__main__":
    main()

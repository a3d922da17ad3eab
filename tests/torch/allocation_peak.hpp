// Every byte libtorch's CPU allocator hands out or takes back on this thread while a guard holds
// this reporter (c10's memory reporting hook, the one its profiler uses): the running total from
// zero, and its peak. Exact, unlike the process's resident set.
//
//   auto peak = std::make_shared<AllocationPeak>();
//   { c10::DebugInfoGuard g(c10::DebugInfoKind::PROFILER_STATE, peak); ...; }  // peak->peak, peak->now
#pragma once
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <algorithm>
#include <cstdint>

namespace dssim::test {

// The hook's totals are int64_t in libtorch 1.13 and size_t in later releases: take its own types.
template <class> struct ReportTotals;
template <class C, class Ptr, class Bytes, class Total, class Reserved, class Device>
struct ReportTotals<void (C::*)(Ptr, Bytes, Total, Reserved, Device)> {
  using Allocated = Total;
  using Held = Reserved;
};
using HookTotals = ReportTotals<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>;

struct AllocationPeak final : c10::MemoryReportingInfoBase {
  int64_t now = 0, peak = 0;
  void reportMemoryUsage(void*, int64_t bytes, HookTotals::Allocated, HookTotals::Held, c10::Device) override {
    now += bytes;
    peak = std::max(peak, now);
  }
  bool memoryProfilingEnabled() const override { return true; }
};

}  // namespace dssim::test

#include "core/zero3_placement.hpp"

#include <algorithm>

namespace dssim {

int zero3_fetch_calls(const std::vector<int64_t>& tensors, const ZeroSpec& z) {
  if (z.engine == ZeroEngine::fsdp) return tensors.empty() ? 0 : 1;
  int calls = 0;
  int64_t open = 0;  // elements in the open all-gather
  for (int64_t n : tensors) {
    if (n <= z.param_persistence_threshold) continue;  // persistent: never gathered
    if (open == 0) ++calls;
    open += n;
    if (open >= z.prefetch_bucket_size) open = 0;  // the call is full: the next submodule opens one
  }
  return calls == 0 && !tensors.empty() ? 1 : calls;
}

std::vector<int> zero3_reduce_calls(const std::vector<std::vector<int64_t>>& groups, const ZeroSpec& z) {
  std::vector<int> calls(groups.size(), 0);
  if (z.engine == ZeroEngine::fsdp) return std::vector<int>(groups.size(), 1);
  int64_t open = 0;  // elements in the bucket
  for (size_t g = groups.size(); g-- > 0;) {
    for (auto it = groups[g].rbegin(); it != groups[g].rend(); ++it) {
      if (open > 0 && open + *it > z.reduce_bucket_size) {
        ++calls[g];
        open = 0;
      }
      open += *it;
    }
  }
  if (open > 0 && !groups.empty()) ++calls[0];  // the epilogue's flush
  for (int& c : calls) c = std::max(c, 1);
  return calls;
}

double zero3_reduce_host_seconds(int64_t tensors, int ranks, const ZeroSpec& z) {
  if (z.engine != ZeroEngine::deepspeed || ranks <= 1 || tensors <= 0) return 0;
  return double(tensors) * double(ranks) * kDeepSpeedReduceHostSecondsPerSlice;
}

bool zero3_prefetch(const ZeroSpec& z, int ahead, int64_t in_flight, int64_t next_elems) {
  if (ahead <= 0) return true;  // the running segment's own gather
  if (z.engine == ZeroEngine::fsdp) return ahead == 1;
  // DeepSpeed keeps prefetching while less than prefetch_bucket_size elements are in flight;
  // prefetch_bucket_size 0 turns prefetching off.
  if (z.prefetch_bucket_size == 0) return false;
  return ahead == 1 || in_flight + next_elems <= z.prefetch_bucket_size;
}

}  // namespace dssim

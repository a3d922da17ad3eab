// The simulation controller's timer queue (simulator/executor.cpp): a priority queue of
// (time, rank, instruction) that pops at equal times in push order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dssim::sim {

// The controller's timers, earliest first and, at equal times, in the order they were set (what
// a binary heap of (time, sequence number) gave). Ranks that run in step set many timers at the
// same instant: one bucket per distinct time, in push order, and a heap of the distinct times
// (8 bytes each), so that popping walks a heap of times rather than one of every timer (the heap's
// comparisons were most of the controller's own CPU at 65,536 GPUs).
class TimerQueue {
 public:
  struct Timer { double t; int v; uint32_t i; };
  bool empty() const { return times_.empty(); }
  double top_time() const { return times_.front(); }
  void push(double t, int v, uint32_t i) {
    t += 0.0;  // -0.0 and 0.0 are one time, as in the heap's comparison
    auto [it, fresh] = index_.try_emplace(t, 0);
    if (fresh) {
      if (free_.empty()) { it->second = static_cast<int>(buckets_.size()); buckets_.emplace_back(); }
      else { it->second = free_.back(); free_.pop_back(); }
      times_.push_back(t);
      std::push_heap(times_.begin(), times_.end(), std::greater<double>());
    }
    buckets_[it->second].items.emplace_back(v, i);
  }
  Timer pop() {
    const double t = times_.front();
    auto it = index_.find(t);
    Bucket& b = buckets_[it->second];
    const auto [v, i] = b.items[b.head++];
    if (b.head == b.items.size()) {
      b.items.clear();
      b.head = 0;
      free_.push_back(it->second);
      index_.erase(it);
      std::pop_heap(times_.begin(), times_.end(), std::greater<double>());
      times_.pop_back();
    }
    return {t, v, i};
  }

 private:
  struct Bucket {
    std::vector<std::pair<int, uint32_t>> items;
    size_t head = 0;
  };
  std::vector<double> times_;                 // min-heap of the distinct times
  std::unordered_map<double, int> index_;     // time -> its bucket
  std::vector<Bucket> buckets_;
  std::vector<int> free_;
};

}  // namespace dssim::sim

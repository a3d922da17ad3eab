// ZeRO-Offload's host side of the offloaded gradients (the engine's CopyD2H): a worker thread
// that sums each copied layer's gradients into the host fp32 buffer.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace dssim::tb {

// ZeRO-Offload's host side of the gradient copies: a worker thread adds each copied layer's
// gradients into the host fp32 buffer while the main thread goes on issuing the backward (as
// DeepSpeed overlaps its CPU-side gradient handling); jobs run in submission order, so the sums
// are the same as done inline. drain() waits for all and rethrows a job's error.
class HostAccumulator {
 public:
  ~HostAccumulator() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }
  // At most kMaxQueued jobs wait (each holds a layer's pinned copy): the submitter waits beyond.
  static constexpr size_t kMaxQueued = 8;
  void submit(std::function<void()> job) {
    {
      std::unique_lock<std::mutex> l(mu_);
      if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
      const auto t0 = std::chrono::steady_clock::now();
      done_cv_.wait(l, [this] { return jobs_.size() < kMaxQueued; });
      stats_.submit_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }
  // Where the offloaded gradients' host side spends its time: the worker's busy seconds, and the
  // seconds the submitting (GPU-driving) thread waited for room in the queue.
  struct Stats {
    double busy_seconds = 0, submit_wait_seconds = 0;
  };
  Stats take_stats() {
    std::lock_guard<std::mutex> l(mu_);
    return std::exchange(stats_, Stats{});
  }
  void drain() {
    std::unique_lock<std::mutex> l(mu_);
    done_cv_.wait(l, [this] { return jobs_.empty() && !busy_; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      l.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      try {
        job();
      } catch (...) {
        std::lock_guard<std::mutex> g(mu_);
        if (!error_) error_ = std::current_exception();
      }
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      l.lock();
      stats_.busy_seconds += dt;
      busy_ = false;
      done_cv_.notify_all();  // drain() and a waiting submit()
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::function<void()>> jobs_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  Stats stats_;
  std::thread worker_;
};

}  // namespace dssim::tb

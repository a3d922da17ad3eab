// ZeRO-Offload's host side (zero_state.hpp): reduced gradients copied to pinned host buffers and
// summed there by the worker thread beside the backward, the host optimizer step that writes the
// updated 16-bit parameters back, and ZeRO-3's per-layer parameter fetches (offload_param).
// DeepSpeed does the same in its ZeRO optimizers' cpu_offload paths and DeepSpeedCPUAdam.
#include <algorithm>
#include <stdexcept>
#include "backends/torch/zero_state.hpp"
#include "backends/torch/torch_compat.hpp"

namespace dssim::tb {

void ZeroState::copy_gradients_to_host(int bucket) {
  auto it = d2h_pending_.find(bucket);
  if (it == d2h_pending_.end()) return;
  for (auto& [off, t] : it->second) {
    count_copy(Op::CopyD2H, Purpose::OffloadGradient, double(t.numel()) * elt16());
    at::Tensor acc = grad_acc_.narrow(0, off, t.numel());
    if (t.is_cpu()) {
      host_accumulate(acc, t, scale_for_average());
      continue;
    }
    // Into a pinned buffer of its own (the copy runs at the bus's pinned rate) on a side stream,
    // then added on the host by the worker once copied, leaving two cores to the thread that
    // drives the GPU: the copy and the sum overlap the backward, as DeepSpeed's do.
    at::Tensor host = at::empty({t.numel()}, t.options().device(at::kCPU).pinned_memory(true));
    auto copied = copy_to_host_async(host, t);
    const double scale = scale_for_average();
    const int threads = host_accumulate_threads();
    if (measuring_) host_acc_bytes_ += 10.0 * double(t.numel());  // read 2 + 4, write 4 (host_accumulate)
    host_acc_.submit([acc, host, scale, threads, copied, waited = &host_copy_wait_seconds_]() mutable {
      const auto t0 = Clock::now();
      copied();
      *waited += seconds_since(t0);  // only the worker writes it; read after drain()
      host_accumulate(acc, host, scale, threads);
    });
  }
  d2h_pending_.erase(it);
}

// The host's gradient sums must be complete before the step reads them; the wait is the part of
// the offloaded gradients' handling that did not overlap the backward (timed as CopyD2H).
void ZeroState::drain_host_accumulation() {
  if (!offload_) return;
  auto t0 = Clock::now();
  host_acc_.drain();
  inner_seconds_["copy_d2h"] += seconds_since(t0);
}

// ZeRO-Offload's step on the host, chunk by chunk, each chunk's updated parameters written in
// the same pass into a pinned 16-bit buffer and copied to the device (DeepSpeed's CPUAdam
// step-plus-copy): the Program's HostOptimizerStep and its CopyH2D, the copy timed as the latter.
void ZeroState::host_step_and_publish(const at::Tensor& g, const AdamWHyper& hyper, int64_t adam_step) {
  const bool pieces = stage_ == 3 && cfg_.ft.active;  // the trainable shards, then into shard16_
  at::Tensor dst = stage_ == 0 ? flat16_ : stage_ <= 2 ? flat16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel)
                               : pieces ? at::empty({master_.numel()}, shard16_.options())
                                        : shard16_;
  inner_seconds_["copy_h2d"] += dssim::tb::host_step_and_publish(master_, g, exp_avg_, exp_avg_sq_, adam_step, hyper,
                                                                 dst, staging16_);
  if (pieces) trainable_pieces(dst, shard16_, true);
  const int64_t n = master_.numel();
  count_copy(Op::CopyH2D, Purpose::OffloadParam, double(n) * elt16());  // the Program's CopyH2D
}

void ZeroState::copy_d2h(const Instruction& in) {
  flush([](const Deferred& d) { return d.kind == Deferred::Reduce; });
  if (!offload_ || in.purpose != Purpose::OffloadGradient)
    throw std::runtime_error("Program error: device-to-host copy without optimizer offload");
  if (in.bucket >= 0 && in.bucket < int(grad_dirty_.size())) fold_local_bucket(in.bucket);
  copy_gradients_to_host(in.bucket);
}

void ZeroState::copy_h2d(const Instruction& in) {
  if (in.purpose != Purpose::OffloadParam) throw std::runtime_error("Program error: unexpected host-to-device copy");
  if (in.layer_begin >= 0) {  // ZeRO-3 offload_param: fetch a layer's 16-bit shard
    if (!offload_param_) throw std::runtime_error("Program error: parameter fetch without offload_param");
    const int g = in.layer_begin;
    const auto& grp = part_.stage3_groups.at(g);
    check_bytes(in, double(grp.shard_numel) * elt16());
    staged_[g] = shard16_.narrow(0, group_shard_offset_[g], grp.shard_numel).to(dev_);
    count_copy(Op::CopyH2D, Purpose::OffloadParam, double(grp.shard_numel) * elt16());
    // A group no all-gather refills (one rank: no data-parallel group) stays resident: the
    // fetched shard, updated by the last step, refills it here (it was used stale before).
    if (std::find(persistent_.begin(), persistent_.end(), g) != persistent_.end()) gather_group(g, nullptr);
    return;
  }
  // The updated shard came back to the device inside the host step (host_step_and_publish).
}

void ZeroState::host_offload_stats(std::map<std::string, double>& out) {
  const auto st = host_acc_.take_stats();
  out["accumulate_seconds"] = st.busy_seconds;
  out["accumulate_bytes"] = host_acc_bytes_;
  out["submit_wait_seconds"] = st.submit_wait_seconds;
  out["copy_wait_seconds"] = host_copy_wait_seconds_;
}

}  // namespace dssim::tb

#include "backends/torch/zero_state.hpp"
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include "backends/torch/env.hpp"
#include "backends/torch/torch_compat.hpp"
#include "core/memory.hpp"

namespace dssim::tb {

namespace {

int layer_of_unit(const GptConfig& c, int u) {
  return u == 0 ? 0 : u >= c.final_unit() ? c.layers - 1 : u - 1;
}

// Squared L2 norm: one reduction pass, no full-size temporary (the offloaded shard of a 7B
// model is 27 GB); inf / nan gradients give a non-finite norm.
// 16-bit gradients are squared and summed in fp32.
at::Tensor sum_of_squares(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return at::norm(t).square();
  return at::norm(t, 2, at::kFloat).square();
}

}  // namespace

ZeroPartitionSpec partition_spec(const GptConfig& c, const ZeroSpec& z, int dp, const std::vector<int>& units) {
  // As core/stage_plan lays it out: the embedding belongs to layer 0, the final norm (and the
  // last stage's copy of the tied embedding) to the last layer; stage 0 all-reduces the unpadded
  // buffer (one "rank", no alignment).
  // Fine-tuning (lora.hpp): stages 0-2 partition the trainable tensors only (the frozen ones stay
  // whole on every rank), stage 3 every tensor with its trainable flag.
  ZeroPartitionSpec spec;
  for (int u : units) {
    const auto ps = unit_params(c, u);
    for (size_t i = 0; i < ps.size(); ++i) {
      const bool tr = param_trainable(c, u, int(i));
      if (!tr && z.stage < 3) continue;
      spec.numel.push_back(ps[i].numel());
      spec.layer.push_back(layer_of_unit(c, u));
      if (c.ft.active) spec.trainable.push_back(tr);
    }
  }
  spec.dp = z.stage == 0 ? 1 : dp;
  spec.alignment = z.stage == 0 ? 1 : 2;
  spec.reduce_bucket_size = std::max<int64_t>(1, z.reduce_bucket_size);
  spec.allgather_bucket_size = std::max<int64_t>(1, z.allgather_bucket_size);
  return spec;
}

void check_bytes(const Instruction& in, double engine_bytes) {
  const double program_bytes = in.bytes * std::max(1, in.repeat);
  if (in.bytes > 0 && std::abs(program_bytes - engine_bytes) > 0.5)
    throw std::runtime_error("Program/engine mismatch: " + std::string(to_string(in.op)) + " bucket " +
                             std::to_string(in.bucket) + " is " + std::to_string(program_bytes) +
                             " bytes in the Program, " + std::to_string(engine_bytes) + " in the engine layout");
}

ZeroState::ZeroState(const Scenario& sc, const GptConfig& cfg, const StageLayout& layout, const Context& ctx)
    : sc_(sc), cfg_(cfg), layout_(layout), stage_(ctx.stage), dp_(ctx.dp), dpr_(ctx.dpr), tp_rank_(ctx.tp_rank),
      dtype_(ctx.dtype), dev_(ctx.device), state_device_(ctx.state_device), offload_(ctx.offload),
      offload_param_(ctx.offload_param), overlap_(ctx.overlap), dp_comm_(ctx.dp_comm), measuring_(*ctx.measuring),
      local_grads_(*ctx.local_grads), inner_seconds_(*ctx.inner_seconds), timing_sync(ctx.timing_sync),
      grads_in_place_(ctx.grads_in_place) {
  part_ = make_zero_partition(partition_spec(cfg_, sc.zero, dp_, layout_.units));
  allocate();
  plan_gradient_norm();
}

// ---- memory ---------------------------------------------------------------------------------
// Stages 0-2: where unit u's trainable tensors start in the flat partition, and how many
// elements they are (all of the unit's without fine-tuning; frozen tensors live in frozen16_).
int64_t ZeroState::unit_offset(int u) const {
  return first_tensor_[u] < int(part_.offsets.size()) ? part_.offsets[first_tensor_[u]] : part_.numel;
}

void ZeroState::allocate() {
  at::NoGradGuard ng;
  auto dev16 = at::TensorOptions().dtype(dtype_).device(dev_);
  auto st32 = at::TensorOptions().dtype(at::kFloat).device(state_device_);
  // Offloaded states stay pageable: the copies go through small pinned staging buffers
  // (copy_gradients_to_host, host_step_and_publish), and the host allocator would round a
  // pinned 27 GB tensor of a 7B shard up to 32 GB.
  // The partition's tensors (stages 0-2: the trainable ones, stage 3: all) and, at stages 0-2,
  // the frozen ones' places in frozen16_.
  int t = 0;
  int64_t frozen_total = 0;
  first_tensor_.assign(cfg_.units(), -1);
  unit_train_numel_.assign(cfg_.units(), 0);
  unit_train_count_.assign(cfg_.units(), 0);
  frozen_offset_.assign(cfg_.units(), {});
  for (int u : layout_.units) {
    first_tensor_[u] = t;
    const auto ps = unit_params(cfg_, u);
    frozen_offset_[u].assign(ps.size(), -1);
    for (int i = 0; i < int(ps.size()); ++i) {
      const bool tr = param_trainable(cfg_, u, i);
      if (stage_ == 3 || tr) {
        tensor_leaf_.push_back({u, i});
        part_trainable_.push_back(tr);
        ++t;
        if (tr) unit_train_numel_[u] += ps[i].numel();
        unit_train_count_[u] += 1;
      } else {
        frozen_offset_[u][i] = frozen_total;
        frozen_total += ps[i].numel();
      }
    }
  }
  p16_.resize(cfg_.units());
  if (stage_ <= 2) {
    flat16_ = at::zeros({part_.padded_numel}, dev16);
    frozen16_ = at::zeros({frozen_total}, dev16);
    const int64_t n = stage_ == 0 ? part_.padded_numel : part_.shard_numel;
    if (stage_ <= 1) {
      grad16_ = at::zeros({part_.padded_numel}, dev16);
    } else {
      // Stage 2 (DeepSpeed's averaged_gradients): only this rank's partition of the reduced
      // gradients, 16-bit, accumulated over the micro-batches and copied to fp32 at the step;
      // backward writes into per-bucket buffers (bucket_grad) that live until their reduction
      // is folded in. With the optimizer offloaded, the partition is the host's fp32 buffer.
      // One rank without per-bucket work to do (no offload copies, no sequence-parallel sums)
      // has no buckets: the partition is the whole buffer and backward accumulates into it.
      direct_partition_ = dp_ == 1 && !offload_ && !(sc_.parallel.tp > 1 && cfg_.sequence_parallel);
      grad_acc_ = offload_ ? at::zeros({n}, st32) : at::zeros({n}, dev16);
      bucket16_.assign(part_.grad_buckets.size(), at::Tensor());
    }
    master_ = at::zeros({n}, st32);
    auto full32 = at::zeros({part_.padded_numel}, dev16.dtype(at::kFloat));
    for (int u : layout_.units) {
      // The whole unit from the seed; its trainable tensors to the partition, frozen ones aside.
      auto u32 = at::zeros({unit_numel(cfg_, u)}, full32.options());
      init_unit(cfg_, u, u32, sc_.training.seed);
      const auto views = unit_views(cfg_, u, u32);
      int ti = first_tensor_[u];
      for (size_t i = 0; i < views.size(); ++i) {
        const int64_t n = views[i].numel();
        if (frozen_offset_[u][i] >= 0) frozen16_.narrow(0, frozen_offset_[u][i], n).copy_(views[i].reshape({-1}));
        else full32.narrow(0, part_.offsets[ti++], n).copy_(views[i].reshape({-1}));
      }
    }
    flat16_.copy_(full32);
    if (stage_ == 0) master_.copy_(full32);
    else master_.copy_(full32.narrow(0, part_.shard(dpr_).begin, part_.shard_numel));
    for (int u : layout_.units) {
      const at::Tensor g = stage_ <= 1        ? grad16_
                           : direct_partition_ ? grad_acc_
                                               : at::Tensor();  // bound to its bucket by prepare_grad
      p16_[u] = partition_leaves(u, g);
    }
    grad_dirty_.assign(part_.grad_buckets.size(), false);
    held_for_step_.assign(part_.grad_buckets.size(), false);
  } else {
    int64_t shard_total = 0, train_total = 0;
    for (const auto& g : part_.stage3_groups) {
      group_shard_offset_.push_back(shard_total);
      group_train_offset_.push_back(train_total);
      shard_total += g.shard_numel;
      train_total += g.trainable_shard_numel;
    }
    master_ = at::zeros({train_total}, st32);  // the optimizer steps the trainable tensors' shards
    shard16_ = at::zeros({shard_total}, dev16);
    const int G = int(part_.stage3_groups.size());
    group_units_.assign(G, {});
    unit_group_offset_.assign(cfg_.units(), 0);
    for (int u : layout_.units) {
      const int g = layer_of_unit(cfg_, u);
      auto& us = group_units_.at(g);
      unit_group_offset_[u] = 0;
      for (int v : us) unit_group_offset_[u] += unit_numel(cfg_, v);
      us.push_back(u);
    }
    full16_.resize(G);
    gradg_.resize(G);
    // One rank: a layer's partition is the whole layer (per-tensor ceil(n / 1) = n, no padding),
    // so the gathered parameters are the shard itself rather than a second copy of it.
    aliased_ = dp_ == 1 && !offload_param_;
    for (int g = 0; g < G; ++g) {
      auto full32 = at::zeros({part_.stage3_groups[g].numel}, dev16.dtype(at::kFloat));
      for (int u : group_units_[g])
        init_unit(cfg_, u, full32.narrow(0, unit_group_offset_[u], unit_numel(cfg_, u)), sc_.training.seed);
      master_.narrow(0, group_train_offset_[g], part_.stage3_groups[g].trainable_shard_numel)
          .copy_(full_to_shard(g, full32, dpr_, true));
      shard16_.narrow(0, group_shard_offset_[g], part_.stage3_groups[g].shard_numel)
          .copy_(full_to_shard(g, full32, dpr_));
      if (aliased_) {
        if (part_.stage3_groups[g].shard_numel != part_.stage3_groups[g].numel)
          throw std::logic_error("ZeRO-3 on one rank: a layer's partition is not the whole layer");
        full16_[g] = shard16_.narrow(0, group_shard_offset_[g], part_.stage3_groups[g].numel);
      } else {
        full16_[g] = full32.to(dtype_).clone();
      }
      for (int u : group_units_[g])
        p16_[u] = leaves(full16_[g].narrow(0, unit_group_offset_[u], unit_numel(cfg_, u)), at::Tensor(), u);
    }
    gathered_.assign(G, true);
    grad_dirty_.assign(G, false);
    // Until the Program gathers them, stage-3 parameters are not resident.
    if (!aliased_)
      for (int g = 0; g < G; ++g) release_group(g);
  }
  exp_avg_ = at::zeros_like(master_);
  exp_avg_sq_ = at::zeros_like(master_);
  // Stage 3's gradient partition: the training dtype unless zero.grad_accum_dtype is fp32, as
  // DeepSpeed's grad_partitions_flat_buffer (gradient_accumulation_dtype); stages 0/1 that fold at
  // the step and offload keep fp32.
  if (!grad_acc_.defined() && !grads_in_place_)
    grad_acc_ = at::zeros(master_.sizes(), sc_.zero.model_dtype_grad_partition() ? dev16 : st32);
  // Stage 3 on one rank, the partition in the training dtype: the partition is laid out as the
  // layers' parameters (nothing frozen, no padding), so the leaves' gradients are its views and
  // backward accumulates into it; nothing is folded per micro-batch. (DSSIM_ZERO3_FOLD=1 folds
  // anyway: the A/B switch of the measurement in docs/torch-backend.md, which the model does not price.)
  if (stage_ == 3 && dssim::zero3_backward_into_partition(sc_) && env_str("DSSIM_ZERO3_FOLD", "0") == "0") {
    if (!aliased_ || master_.numel() != shard16_.numel())
      throw std::logic_error("ZeRO-3 on one rank: the gradient partition is not laid out as the parameters");
    direct_partition_ = true;
    for (int g = 0; g < int(part_.stage3_groups.size()); ++g)
      bind_group_grads(g, grad_acc_.narrow(0, group_train_offset_[g], part_.stage3_groups[g].numel));
  }
  if (offload_param_) shard16_ = shard16_.to(at::kCPU);
}

// One autograd leaf per parameter tensor, a view into the flat buffer, with its .grad a view
// into the flat gradient buffer: backward accumulates straight into the buckets (no slice
// backward through a flat leaf), as DeepSpeed's params point into its flat groups.
std::vector<at::Tensor> ZeroState::leaves(const at::Tensor& flat, const at::Tensor& grad_flat, int u) {
  std::vector<at::Tensor> out;
  auto views = unit_views(cfg_, u, flat);
  std::vector<at::Tensor> gviews;
  if (grad_flat.defined()) gviews = unit_views(cfg_, u, grad_flat);
  for (size_t i = 0; i < views.size(); ++i) {
    out.push_back(views[i].detach().requires_grad_(param_trainable(cfg_, u, int(i))));  // frozen: no gradient
    if (grad_flat.defined()) out.back().mutable_grad() = gviews[i];
  }
  return out;
}

// Stages 0-2: unit u's leaves, the trainable ones views of flat16_ (their .grad views of
// `grad_flat` at the same partition offsets, when given), the frozen ones of frozen16_.
std::vector<at::Tensor> ZeroState::partition_leaves(int u, const at::Tensor& grad_flat) {
  std::vector<at::Tensor> out;
  const auto ps = unit_params(cfg_, u);
  int ti = first_tensor_[u];
  for (size_t i = 0; i < ps.size(); ++i) {
    const int64_t n = ps[i].numel();
    if (frozen_offset_[u][i] >= 0) {
      out.push_back(frozen16_.narrow(0, frozen_offset_[u][i], n).view(ps[i].shape).detach());
      continue;
    }
    const int64_t off = part_.offsets[ti++];
    out.push_back(flat16_.narrow(0, off, n).view(ps[i].shape).detach().requires_grad_(true));
    if (grad_flat.defined()) out.back().mutable_grad() = grad_flat.narrow(0, off, n).view(ps[i].shape);
  }
  return out;
}

const std::vector<at::Tensor>& ZeroState::param(int u, const char* why) {
  if (stage_ == 3 && !deferred_.empty()) {
    const int g = group_of(u);
    flush([g](const Deferred& d) { return d.kind == Deferred::Gather3 && d.key == g; });
  }
  if (stage_ == 3 && !gathered_[group_of(u)])
    throw std::runtime_error(std::string("Program error: ") + why + " of layer " + std::to_string(group_of(u)) +
                             " before its ZeRO-3 parameters were gathered");
  return p16_[u];
}

void ZeroState::prepare_grad(int u) {
  if (stage_ == 2 && !direct_partition_) {
    const int64_t b = unit_offset(u), e = b + train_numel(u);
    for (size_t k = 0; k < part_.grad_buckets.size(); ++k) {
      const Range& r = part_.grad_buckets[k].range;
      if (r.begin < e && b < r.end()) bucket_grad(int(k));
    }
    return;
  }
  if (stage_ < 3 || direct_partition_) return;
  const int g = group_of(u);
  if (part_.stage3_groups[g].trainable_numel == 0) return;  // every tensor frozen: no gradient
  if (!gradg_[g].defined()) {
    gradg_[g] = at::zeros({part_.stage3_groups[g].numel}, full16_[g].options());
    gradg_bytes_ += bytes(gradg_[g]);
    gradg_peak_ = std::max(gradg_peak_, gradg_bytes_);
    bind_group_grads(g, gradg_[g]);
  }
}

void ZeroState::mark_dirty(int u) {
  if (stage_ == 3) {
    if (part_.stage3_groups[group_of(u)].trainable_numel > 0) grad_dirty_[group_of(u)] = true;
    return;
  }
  const int64_t b = unit_offset(u), e = b + train_numel(u);
  for (size_t k = 0; k < part_.grad_buckets.size(); ++k) {
    const Range& r = part_.grad_buckets[k].range;
    if (!(r.begin < e && b < r.end())) continue;
    if (held_for_step_[k])  // its reduced sum would be added to: the Program reduced it too early
      throw std::runtime_error("Program error: a backward writes into gradient bucket " + std::to_string(k) +
                               " after its reduction in the same step");
    grad_dirty_[k] = true;
  }
}

int ZeroState::group_of(int u) const { return layer_of_unit(cfg_, u); }

// ---- communication ------------------------------------------------------------------------
void ZeroState::reduce_gradients(const Instruction& in) {
  const int k = in.bucket;
  if (stage_ <= 2) {
    if (k < 0 || k >= int(part_.grad_buckets.size()))
      throw std::runtime_error("Program error: gradient bucket " + std::to_string(k) + " does not exist");
    const auto& b = part_.grad_buckets[k];
    check_bytes(in, double(b.range.count) * elt16());
    auto buf = stage_ == 2 ? take_bucket(k) : grad16_.narrow(0, b.range.begin, b.range.count);
    grad_dirty_[k] = false;
    if (in.op == Op::AllReduce || stage_ == 0) {
      auto work = dp_comm_->allreduce(buf, in.purpose);
      defer({Deferred::Reduce, k, in.micro_batch, work, [this, buf, k]() mutable {
               if (grads_in_place_) return keep_for_step(k);
               fold_full(part_.grad_buckets[k].range, buf, k);
               recycle(buf);
             }});
    } else {
      // DeepSpeed reduces each rank's intersection with the bucket to its owner; the same data
      // moves as in a reduce-scatter of the bucket.
      auto work = reduce_to_owners(buf, in);
      defer({Deferred::Reduce, k, in.micro_batch, work, [this, buf, k]() mutable {
               if (grads_in_place_) return keep_for_step(k);
               const auto& b = part_.grad_buckets[k];
               const Range mine = b.sub_shards[dpr_];
               if (mine.count > 0) {
                 const Range shard = part_.shard(dpr_);
                 accumulate(k, mine.begin - shard.begin, buf.narrow(0, mine.begin - b.range.begin, mine.count));
               }
               recycle(buf);
             }});
    }
  } else {
    const int gi = k;
    if (gi < 0 || gi >= int(part_.stage3_groups.size()))
      throw std::runtime_error("Program error: ZeRO-3 group " + std::to_string(gi) + " does not exist");
    const auto& g = part_.stage3_groups[gi];
    // Only the trainable tensors' gradients (all of them without fine-tuning).
    check_bytes(in, double(g.trainable_padded_numel()) * elt16());
    if (!gradg_[gi].defined()) throw std::runtime_error("Program error: reducing gradients of layer " +
                                                        std::to_string(gi) + " before its backward");
    std::vector<at::Tensor> parts;
    for (int r = 0; r < dp_; ++r) parts.push_back(full_to_shard(gi, gradg_[gi], r, true));
    auto input = at::cat(parts);
    auto out = at::empty({g.trainable_shard_numel}, input.options());
    auto work = dp_comm_->reduce_scatter(out, input, in.purpose);
    drop_group_grad(gi);  // the input is a copy
    defer({Deferred::Reduce, gi, in.micro_batch, work, [this, gi, out, input]() {
             accumulate(gi, group_train_offset_[gi], out);
           }});
  }
}

std::shared_ptr<Work> ZeroState::reduce_to_owners(at::Tensor& buf, const Instruction& in) {
  // A bucket's owners hold uneven intersections of it (DeepSpeed's average_tensor).
  const auto& b = part_.grad_buckets[in.bucket];
  std::vector<std::pair<int64_t, int64_t>> owners;
  for (const Range& r : b.sub_shards) owners.push_back({r.begin - b.range.begin, r.count});
  return dp_comm_->reduce_to_owners(buf, owners, in.purpose);
}

// Reduced gradients (this rank's part) into the fp32 accumulator of the optimizer. With the
// optimizer offloaded, they wait on the device for the Program's CopyD2H of their bucket.
void ZeroState::accumulate(int bucket, int64_t acc_offset, const at::Tensor& reduced) {
  if (!offload_) {
    grad_acc_.narrow(0, acc_offset, reduced.numel()).add_(reduced, scale_for_average());
    return;
  }
  d2h_pending_[bucket].push_back({acc_offset, reduced.clone()});
}

void ZeroState::count_copy(Op op, Purpose p, double bytes) {
  copy_bytes_[{op, p}] += bytes;
  copy_calls_[{op, p}] += 1;
}

// dp == 1 has no reduction instructions: local gradients are the reduced gradients.
void ZeroState::fold_full(const Range& r, const at::Tensor& buf, int bucket) {
  if (stage_ == 0) {
    accumulate(bucket, r.begin, buf);
    return;
  }
  const Range shard = part_.shard(dpr_);
  const int64_t b = std::max(r.begin, shard.begin), e = std::min(r.end(), shard.end());
  if (e > b) accumulate(bucket, b - shard.begin, buf.narrow(0, b - r.begin, e - b));
}

void ZeroState::fold_local_bucket(int k) {
  if (!grad_dirty_[k]) return;
  if (dp_ > 1 && !local_grads_)
    throw std::runtime_error("Program error: gradients of bucket " + std::to_string(k) + " left unreduced");
  if (stage_ == 2) {
    if (!direct_partition_) {  // direct: backward accumulated into the partition itself
      auto buf = take_bucket(k);
      fold_full(part_.grad_buckets[k].range, buf, k);
      free_bucket(buf);
    }
  } else if (stage_ <= 1 && grads_in_place_) {
    keep_for_step(k);
  } else if (stage_ <= 1) {
    const auto& r = part_.grad_buckets[k].range;
    auto buf = grad16_.narrow(0, r.begin, r.count);
    fold_full(r, buf, k);
    buf.zero_();
  } else if (!direct_partition_) {  // stage 3 (direct: backward accumulated into the partition)
    accumulate(k, group_train_offset_[k],
               dp_ == 1 && !cfg_.ft.active ? gradg_[k] : full_to_shard(k, gradg_[k], 0, true));
    drop_group_grad(k);
  }
  grad_dirty_[k] = false;
}

// Stages 0/1 without an fp32 accumulator: bucket k, reduced (or, with dp = 1, complete), stays
// in grad16_ for the step, which reads this rank's shard of it and zeroes it; the rest of the
// bucket (other ranks' parts at stage 1) is zeroed now for the next step's backward.
void ZeroState::keep_for_step(int k) {
  const Range& r = part_.grad_buckets[k].range;
  if (stage_ == 1) {
    const Range shard = part_.shard(dpr_);
    const int64_t b = std::max(r.begin, shard.begin), e = std::min(r.end(), shard.end());
    if (e <= b) {
      grad16_.narrow(0, r.begin, r.count).zero_();
    } else {
      if (b > r.begin) grad16_.narrow(0, r.begin, b - r.begin).zero_();
      if (e < r.end()) grad16_.narrow(0, e, r.end() - e).zero_();
    }
  }
  held_for_step_[k] = true;
  grad_dirty_[k] = false;
}

// ---- stage 2: per-bucket gradient buffers (DeepSpeed's ipg buckets) ----------------------------
// Bucket k's 16-bit gradients: allocated (zeroed) when backward first writes into the bucket,
// the leaves of its tensors pointing into it.
at::Tensor& ZeroState::bucket_grad(int k) {
  at::Tensor& buf = bucket16_.at(k);
  if (buf.defined()) return buf;
  make_room_for_bucket();
  const GradBucket& gb = part_.grad_buckets[k];
  buf = at::zeros({gb.range.count}, flat16_.options());
  for (int t = gb.first_tensor; t <= gb.last_tensor; ++t) {
    at::Tensor& leaf = leaf_of_tensor(t);
    leaf.mutable_grad() = buf.narrow(0, part_.offsets[t] - gb.range.begin, leaf.numel()).view(leaf.sizes());
  }
  bucket_bytes_ += bytes(buf);
  bucket_peak_ = std::max(bucket_peak_, bucket_bytes_);
  return buf;
}

// The bucket handed to its reduction (or local fold): its leaves let go of it, so a later
// backward writing into the bucket gets a new buffer.
at::Tensor ZeroState::take_bucket(int k) {
  at::Tensor buf = bucket_grad(k);  // zeros if no backward wrote into it
  const GradBucket& gb = part_.grad_buckets[k];
  for (int t = gb.first_tensor; t <= gb.last_tensor; ++t) leaf_of_tensor(t).mutable_grad() = at::Tensor();
  bucket16_[k] = at::Tensor();
  return buf;
}

void ZeroState::free_bucket(at::Tensor& buf) {
  bucket_bytes_ -= bytes(buf);
  buf = at::Tensor();
}

// After its reduction is folded: stage 2 frees the bucket, stages 0/1 zero their slice of grad16_.
void ZeroState::recycle(at::Tensor& buf) {
  if (stage_ == 2) free_bucket(buf);
  else buf.zero_();
}

// With overlap_comm DeepSpeed double-buffers the ipg bucket: a new bucket starts filling once
// the reductions issued before the newest one have completed (at most one in flight).
void ZeroState::make_room_for_bucket() {
  const Deferred* newest = nullptr;
  for (const auto& d : deferred_)
    if (d.kind == Deferred::Reduce) newest = &d;
  if (newest) flush([newest](const Deferred& d) { return d.kind == Deferred::Reduce && &d != newest; });
}

// Stage 2 on one rank (no reductions): a bucket is complete for the micro-batch once the unit of
// its first tensor has run its backward, and is folded into the partition then, unless the
// Program sums it over the TP group first (reduce_sequence_parallel_grads folds it after that).
void ZeroState::complete_buckets(int u) {
  if (stage_ != 2 || direct_partition_ || dp_ != 1) return;
  const int t0 = first_tensor_[u], t1 = t0 + unit_train_count_[u];
  for (int k = 0; k < int(part_.grad_buckets.size()); ++k) {
    const int ft = part_.grad_buckets[k].first_tensor;
    if (ft >= t0 && ft < t1 && !has_sp_sum(k)) fold_local_bucket(k);
  }
}

bool ZeroState::has_sp_sum(int k) const {
  if (sc_.parallel.tp <= 1 || !cfg_.sequence_parallel) return false;
  const Range& r = part_.grad_buckets[k].range;
  for (const auto& [off, n] : replicated_ranges_)
    if (std::max(off, r.begin) < std::min(off + n, r.end())) return true;
  return false;
}

void ZeroState::fold_unreduced() {
  for (int k = 0; k < int(grad_dirty_.size()); ++k) fold_local_bucket(k);
  std::vector<int> left;
  for (auto& [k, v] : d2h_pending_) left.push_back(k);
  for (int k : left) copy_gradients_to_host(k);
}

void ZeroState::gather_params(const Instruction& in) {
  if (stage_ <= 2) {
    const int k = in.bucket;
    if (k < 0 || k >= int(part_.allgather_buckets.size()))
      throw std::runtime_error("Program error: all-gather bucket " + std::to_string(k) + " does not exist");
    const auto& b = part_.allgather_buckets[k];
    check_bytes(in, double(b.count_per_rank) * dp_ * elt16());
    auto mine = flat16_.narrow(0, part_.shard(dpr_).begin + b.shard_offset, b.count_per_rank).clone();
    auto out = at::empty({b.count_per_rank * dp_}, mine.options());
    auto work = dp_comm_->all_gather(out, mine, in.purpose);
    defer({Deferred::Gather12, k, -1, work, [this, out, mine, k]() {
             const auto& b = part_.allgather_buckets[k];
             auto rows = out.view({dp_, b.count_per_rank});
             at::NoGradGuard ng;
             for (int r = 0; r < dp_; ++r)
               flat16_.narrow(0, part_.shard(r).begin + b.shard_offset, b.count_per_rank).copy_(rows[r]);
           }});
  } else {
    if (in.bucket < 0 || in.bucket >= int(part_.stage3_groups.size()))
      throw std::runtime_error("Program error: ZeRO-3 all-gather of group " + std::to_string(in.bucket));
    gather_group(in.bucket, &in);
  }
}

// ---- overlap (zero_state.hpp) ----------------------------------------------------------------
void ZeroState::defer(Deferred d) {
  if (!overlap_) {
    finish(d);
    return;
  }
  deferred_.push_back(std::move(d));
}

void ZeroState::finish(Deferred& d) {
  auto t0 = Clock::now();
  d.work->wait();
  comm_wait_seconds_ += seconds_since(t0);
  d.post();
}

// ---- optimizer ----------------------------------------------------------------------------
// Which gradients this rank counts in the global norm: a TP-replicated tensor on TP rank 0
// only, the last stage's copy of the tied embedding never (the first stage counts it).
void ZeroState::plan_gradient_norm() {
  if (cfg_.ft.active) return;  // tp = pp = 1 (checked): the whole accumulator counts
  for (int u : layout_.units) {
    int64_t off = unit_offset(u);
    const auto ps = unit_params(cfg_, u);
    for (size_t i = 0; i < ps.size(); ++i) {
      if (u != cfg_.head_copy_unit() && replicated_over_tp(cfg_, u, int(i))) replicated_ranges_.push_back({off, ps[i].numel()});
      off += ps[i].numel();
    }
  }
  if (sc_.parallel.tp == 1 && sc_.parallel.pp == 1) return;
  if (stage_ > 2) throw std::logic_error("gradient norm weights: ZeRO-3 with tp / pp > 1");
  // Excluded ranges of the flat layout, then the counted rest of this rank's accumulator.
  std::vector<std::pair<int64_t, int64_t>> excluded;
  if (tp_rank_ != 0) excluded = replicated_ranges_;
  if (layout_.owns(cfg_.head_copy_unit()))
    excluded.push_back({unit_offset(cfg_.head_copy_unit()), unit_numel(cfg_, cfg_.head_copy_unit())});
  std::sort(excluded.begin(), excluded.end());
  const int64_t base = stage_ == 0 ? 0 : part_.shard(dpr_).begin;
  const int64_t end = base + (stage_ == 0 ? part_.padded_numel : part_.shard_numel);
  int64_t at = base;
  for (const auto& [off, n] : excluded) {
    const int64_t b = std::clamp(off, base, end), e = std::clamp(off + n, base, end);
    if (b > at) norm_ranges_.push_back({at - base, b - at});
    at = std::max(at, e);
  }
  if (end > at) norm_ranges_.push_back({at - base, end - at});
  norm_by_ranges_ = true;
}

// The updated parameters' 16-bit home that the step writes directly: this rank's part of the
// 16-bit buffer (stage 3: its shard); undefined where the trainable pieces are scattered (stage 3
// with frozen tensors: publish_master copies them).
at::Tensor ZeroState::publish_target() {
  if (stage_ == 0) return flat16_;
  if (stage_ <= 2) return flat16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel);
  if (cfg_.ft.active) return at::Tensor();
  return shard16_;
}

at::Tensor ZeroState::step_gradient_buffer(double& pre) {
  fold_unreduced();
  drain_host_accumulation();
  if (bucket_bytes_ != 0) throw std::logic_error("ZeRO-2: gradient bucket buffers left at the step");
  // Stage 2 keeps its partition in 16 bits (DeepSpeed's averaged_gradients), stages 0/1 their
  // reduced buckets (this rank's shard of grad16_, not yet averaged); stage 3 its partition in the
  // training dtype (fp32 with zero.grad_accum_dtype: fp32), offload an fp32 accumulator. The step
  // reads each where it is.
  at::Tensor acc = grad_acc_;
  if (grads_in_place_) {
    acc = stage_ == 0 ? grad16_ : grad16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel);
    pre = scale_for_average();
  }
  return acc;
}

at::Tensor ZeroState::counted_sum_of_squares(const at::Tensor& acc) const {
  at::Tensor sumsq;
  if (!norm_by_ranges_) {
    sumsq = sum_of_squares(acc);
  } else {  // the counted ranges only, without a full-size temporary
    sumsq = at::zeros({}, acc.options().dtype(at::kFloat));
    for (const auto& [off, n] : norm_ranges_) sumsq.add_(sum_of_squares(acc.narrow(0, off, n)));
  }
  return sumsq;
}

// The updated master shard -> this rank's 16-bit copy (the Program's all-gathers send the rest).
void ZeroState::publish_master() {
  at::NoGradGuard ng;
  if (stage_ == 0) flat16_.copy_(master_);
  else if (stage_ <= 2) flat16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel).copy_(master_);
  else if (cfg_.ft.active) trainable_pieces(master_, shard16_, true);
  else shard16_.copy_(master_);
}

// ---- checkpoints and dumps ------------------------------------------------------------------
void ZeroState::regather_params() {
  // Every rank's 16-bit copy is whole again (stages 1/2: all-gather the shards, uncounted).
  if (stage_ >= 1 && stage_ <= 2 && dp_ > 1) {
    auto mine = flat16_.narrow(0, part_.shard(dpr_).begin, part_.shard_numel).clone();
    dp_comm_->all_gather(flat16_, mine, Purpose::None)->wait();
  }
}

// The whole fp32 master of this rank's units, its shards all-gathered over the data-parallel group
// (model order, unpadded): what dump_params writes for one stage and TP rank.
at::Tensor ZeroState::full_master() {
  at::NoGradGuard ng;
  at::Tensor full;
  if (stage_ == 0) full = master_.to(at::kCPU);
  else if (stage_ <= 2) {
    auto mine = master_.to(dev_).contiguous();
    full = at::empty({part_.padded_numel}, mine.options());
    dp_comm_->all_gather(full, mine, Purpose::None)->wait();
    full = full.to(at::kCPU);
  } else {
    std::vector<at::Tensor> groups;
    for (int gi = 0; gi < int(part_.stage3_groups.size()); ++gi) {
      const auto& g = part_.stage3_groups[gi];
      auto mine = master_.narrow(0, group_shard_offset_[gi], g.shard_numel).to(dev_).contiguous();
      auto out = at::empty({g.padded_numel()}, mine.options());
      dp_comm_->all_gather(out, mine, Purpose::None)->wait();
      auto f = at::empty({g.numel}, mine.options());
      gathered_to_full(gi, out, f);
      groups.push_back(f.to(at::kCPU));
    }
    full = at::cat(groups);
  }
  full = full.narrow(0, 0, part_.numel).contiguous();
  return full;
}

// Fine-tuning: per unit, its tensors in fp32 on the CPU, the trainable ones from the master (all-
// gathered over the data-parallel group), the frozen ones from their compute-dtype copy.
std::vector<std::vector<at::Tensor>> ZeroState::unit_params_fp32() {
  at::NoGradGuard ng;
  std::vector<std::vector<at::Tensor>> units(cfg_.units());  // per unit, its tensors in fp32 (CPU)
  if (stage_ <= 2) {
    at::Tensor train = master_.to(at::kCPU);
    if (stage_ >= 1) {
      auto mine = master_.to(dev_).contiguous();
      auto all = at::empty({part_.padded_numel}, mine.options());
      dp_comm_->all_gather(all, mine, Purpose::None)->wait();
      train = all.to(at::kCPU);
    }
    const at::Tensor frozen = frozen16_.to(at::kCPU).to(at::kFloat);
    for (int u : layout_.units) {
      const auto ps = unit_params(cfg_, u);
      int ti = first_tensor_[u];
      for (size_t i = 0; i < ps.size(); ++i) {
        const int64_t n = ps[i].numel();
        units[u].push_back(frozen_offset_[u][i] >= 0 ? frozen.narrow(0, frozen_offset_[u][i], n)
                                                     : train.narrow(0, part_.offsets[ti++], n));
      }
    }
  } else {
    // This rank's shards in fp32: the frozen tensors' from the compute-dtype shard, the
    // trainable ones' from the master; gathered per group.
    at::Tensor shard32 = shard16_.to(at::kFloat).to(dev_);
    trainable_pieces(master_.to(dev_), shard32, true);
    for (int gi = 0; gi < int(part_.stage3_groups.size()); ++gi) {
      const auto& g = part_.stage3_groups[gi];
      auto mine = shard32.narrow(0, group_shard_offset_[gi], g.shard_numel).contiguous();
      auto out = at::empty({g.padded_numel()}, mine.options());
      dp_comm_->all_gather(out, mine, Purpose::None)->wait();
      auto f = at::empty({g.numel}, mine.options());
      gathered_to_full(gi, out, f);
      f = f.to(at::kCPU);
      for (int u : group_units_[gi])
        for (const auto& v : unit_views(cfg_, u, f.narrow(0, unit_group_offset_[u], unit_numel(cfg_, u))))
          units[u].push_back(v.reshape({-1}));
    }
  }
  return units;
}

// ---- measurements ---------------------------------------------------------------------------
void ZeroState::start_measuring() {
  copy_bytes_.clear();
  copy_calls_.clear();
  host_acc_.drain();
  host_acc_.take_stats();
  host_acc_bytes_ = 0;
  host_copy_wait_seconds_ = 0;
}

// The engine's own buffers by category (engine.cpp run() adds the experts' and 1-bit Adam's).
// With the optimizer offloaded the fp32 gradient buffer is a host one, counted with the states.
// Stage 2: the 16-bit partition and the bucket buffers at their peak.
ZeroState::MemoryBytes ZeroState::memory_bytes() const {
  MemoryBytes m;
  m.grads = bytes(grad16_) + (offload_ ? 0 : bytes(grad_acc_)) + bucket_peak_;
  m.optim = bytes(master_) + bytes(exp_avg_) + bytes(exp_avg_sq_) + (offload_ ? bytes(grad_acc_) : 0);
  m.layer_grads_peak = gradg_peak_;
  if (stage_ <= 2) m.params = bytes(flat16_) + bytes(frozen16_);
  else {
    m.params = shard16_.is_cuda() || !dev_.is_cuda() ? bytes(shard16_) : 0;
    if (!aliased_)
      for (int g : persistent_) m.params += double(part_.stage3_groups[g].numel) * elt16();
  }
  return m;
}

}  // namespace dssim::tb

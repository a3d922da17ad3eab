// ZeRO-3's per-layer groups (zero_state.hpp): a group's parameters gathered from the shards and
// released after use (plan_residency decides which stay resident), its gradients bound to a
// buffer or, on one rank, to the partition itself, and folded into the partition when complete.
// DeepSpeed splits the same work between its PartitionedParameterCoordinator (fetch, release) and
// its stage-3 optimizer (the gradient partitions).
#include <algorithm>
#include <stdexcept>
#include "backends/torch/zero_state.hpp"
#include "backends/torch/torch_compat.hpp"

namespace dssim::tb {

// Stage 3: a group's full flat tensor -> rank r's partition (per tensor ceil(n / dp), zero
// padded); trainable_only: of its trainable tensors (what is reduce-scattered and stepped).
at::Tensor ZeroState::full_to_shard(int gi, const at::Tensor& full, int r, bool trainable_only) const {
  const auto& g = part_.stage3_groups[gi];
  auto out = at::zeros({trainable_only ? g.trainable_shard_numel : g.shard_numel}, full.options());
  int64_t in_off = 0, out_off = 0;
  for (int ti : g.tensors) {
    const int64_t n = part_.offsets.size() > 0 ? tensor_numel(ti) : 0;
    const int64_t c = (n + dp_ - 1) / dp_;
    if (trainable_only && !part_trainable_[ti]) {
      in_off += n;
      continue;
    }
    const int64_t b = std::min<int64_t>(n, int64_t(r) * c), e = std::min<int64_t>(n, int64_t(r + 1) * c);
    if (e > b) out.narrow(0, out_off, e - b).copy_(full.narrow(0, in_off + b, e - b));
    in_off += n;
    out_off += c;
  }
  return out;
}

// Stage 3 with frozen tensors: the trainable pieces of this rank's shards (laid out as master_)
// into `shard` (laid out as shard16_), or back (to_shard false).
void ZeroState::trainable_pieces(const at::Tensor& train, const at::Tensor& shard, bool to_shard) const {
  at::NoGradGuard ng;
  for (int gi = 0; gi < int(part_.stage3_groups.size()); ++gi) {
    int64_t s_off = group_shard_offset_[gi], t_off = group_train_offset_[gi];
    for (int ti : part_.stage3_groups[gi].tensors) {
      const int64_t c = (tensor_numel(ti) + dp_ - 1) / dp_;
      if (part_trainable_[ti]) {
        if (to_shard) shard.narrow(0, s_off, c).copy_(train.narrow(0, t_off, c));
        else train.narrow(0, t_off, c).copy_(shard.narrow(0, s_off, c));
        t_off += c;
      }
      s_off += c;
    }
  }
}

// Stage 3: all-gathered [dp * shard] -> the group's full flat tensor.
void ZeroState::gathered_to_full(int gi, const at::Tensor& gathered, at::Tensor full) const {
  const auto& g = part_.stage3_groups[gi];
  auto rows = gathered.view({dp_, g.shard_numel});
  int64_t out_off = 0, in_off = 0;
  for (int ti : g.tensors) {
    const int64_t n = tensor_numel(ti), c = (n + dp_ - 1) / dp_;
    full.narrow(0, out_off, n).copy_(rows.narrow(1, in_off, c).reshape({-1}).narrow(0, 0, n));
    out_off += n;
    in_off += c;
  }
}

int64_t ZeroState::tensor_numel(int ti) const {
  return ti + 1 < int(part_.offsets.size()) ? part_.offsets[ti + 1] - part_.offsets[ti]
                                             : part_.numel - part_.offsets[ti];
}

void ZeroState::release_group(int g) {
  if (stage_ < 3 || aliased_ || !gathered_[g]) return;
  release_storage(full16_[g]);  // the units' leaves share this storage
  gathered_[g] = false;
}

// Stage 3: the trainable leaves of layer group g take their gradients as views of `flat`, laid
// out as the group's parameters.
void ZeroState::bind_group_grads(int g, const at::Tensor& flat) {
  for (int v : group_units_[g]) {
    const auto views = unit_views(cfg_, v, flat.narrow(0, unit_group_offset_[v], unit_numel(cfg_, v)));
    for (size_t i = 0; i < views.size(); ++i)
      if (p16_[v][i].requires_grad()) p16_[v][i].mutable_grad() = views[i];
  }
}

// ZeRO-3 on one rank has no reduce-scatter in the Program: a layer group's gradients go to the
// fp32 accumulator as soon as its backward is done (what the reduce-scatter would do), so at
// most one group's 16-bit gradients are alive, as with dp > 1.
// With the optimizer offloaded they go on to the host at once (DeepSpeed copies each reduced
// partition out in the backward hooks), timed as the Program's CopyD2H.
void ZeroState::fold_group_now(int g) {
  if (stage_ != 3 || dp_ != 1 || !grad_dirty_[g]) return;
  fold_local_bucket(g);
  if (!offload_) return;
  if (measuring_) timing_sync();
  auto t0 = Clock::now();
  copy_gradients_to_host(g);
  inner_seconds_["copy_d2h"] += seconds_since(t0);
}

// Stage 3 frees the units an instruction used unless the Program uses them again before
// gathering them again.
void ZeroState::after_use(size_t pc, const std::vector<int>& groups) {
  if (stage_ < 3) return;
  for (int g : groups)
    if (!keep_after_use_[pc][g]) release_group(g);
}

void ZeroState::gather_persistent() {
  if (!aliased_)
    for (int g : persistent_) gather_group(g, nullptr);
}

// Stage 3: for instruction i and group g, whether g is used again (forward / backward) before
// the Program gathers it again: then it stays resident. Groups the Program never gathers (dp = 1
// has no data-parallel group) are gathered once and kept.
void ZeroState::plan_residency(const RankProgram& rp,
                               const std::function<std::vector<int>(const Instruction&)>& groups_of) {
  if (stage_ < 3) return;
  const int n = int(rp.instructions.size()), G = int(part_.stage3_groups.size());
  keep_after_use_.assign(n, std::vector<bool>(G, false));
  std::vector<int> next(G, 0);  // 0 none, 1 use, 2 gather
  auto visit = [&](int i, bool record) {
    const auto& in = rp.instructions[i];
    if (in.op == Op::Forward || in.op == Op::Backward) {
      const auto gs = groups_of(in);
      if (record) for (int g : gs) keep_after_use_[i][g] = next[g] == 1;
      for (int g : gs) next[g] = 1;
    } else if (in.op == Op::AllGather && in.purpose == Purpose::ParamGather && in.bucket >= 0 && in.bucket < G) {
      next[in.bucket] = 2;
    }
  };
  // The step repeats: after the last instruction comes the first event of the next step.
  for (int i = n - 1; i >= 0; --i) visit(i, false);
  for (int i = n - 1; i >= 0; --i) visit(i, true);
  for (int g = 0; g < G; ++g) {
    bool gathered_ever = false;
    for (const auto& in : rp.instructions)
      if (in.op == Op::AllGather && in.purpose == Purpose::ParamGather && in.bucket == g) gathered_ever = true;
    if (!gathered_ever) {
      persistent_.push_back(g);
      for (auto& row : keep_after_use_) row[g] = true;
    }
  }
}

void ZeroState::drop_group_grad(int g) {
  for (int v : group_units_[g])
    for (auto& leaf : p16_[v]) leaf.mutable_grad() = at::Tensor();
  gradg_bytes_ -= bytes(gradg_[g]);
  gradg_[g] = at::Tensor();
  grad_dirty_[g] = false;
}

void ZeroState::gather_group(int gi, const Instruction* in) {
  const auto& g = part_.stage3_groups[gi];
  if (in) check_bytes(*in, double(g.padded_numel()) * elt16());
  at::Tensor mine = shard16_.narrow(0, group_shard_offset_[gi], g.shard_numel);
  if (offload_param_) {
    auto st = staged_.find(gi);
    if (st != staged_.end()) {
      mine = st->second;
      staged_.erase(st);
    } else {
      mine = mine.to(dev_);  // not fetched by the Program (dp = 1 or a persistent layer)
    }
  }
  auto out = at::empty({g.padded_numel()}, mine.options());
  auto refill = [this, gi, out, mine]() {
    at::NoGradGuard ng;
    const int64_t numel = part_.stage3_groups[gi].numel;
    reallocate_storage(full16_[gi], size_t(numel) * size_t(elt16()));
    // Write through an alias with its own version counter: the leaves (views of full16_) that
    // autograd saved in forward must not look modified when their layer is refilled for
    // backward (DeepSpeed writes param.data for the same reason).
    at::Tensor alias = at::empty({0}, full16_[gi].options());
    alias.set_(full16_[gi].storage(), 0, {numel}, {1});
    gathered_to_full(gi, out, alias);
    gathered_[gi] = true;
  };
  if (!in && dp_ == 1) {
    out.copy_(mine);
    refill();
    return;
  }
  auto work = dp_comm_->all_gather(out, mine, in ? in->purpose : Purpose::None);
  // A prefetched layer is refilled when it is first used.
  if (in) defer({Deferred::Gather3, gi, -1, work, refill});
  else {
    work->wait();
    refill();
  }
}

}  // namespace dssim::tb

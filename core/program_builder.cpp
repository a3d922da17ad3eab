// Program builder: turns a Scenario into per-rank instruction streams.
//
// Structure: everything that is the same for all ranks of a pipeline stage (layer range, compute
// segments and their kernel lists, ZeRO partitions and buckets: core/stage_plan.hpp; the ordered
// list of pipeline actions: core/schedule.hpp) is planned once per stage (StagePlan); each rank
// then walks its stage's action list and appends instructions, filling in its own groups and peers
// (RankEmitter).
//
// Deadlock freedom. Every stream runs in order and every wait points at an earlier instruction, so
// a rank's Program is a relaxation of one sequential order (the order instructions are appended).
// That sequential order is deadlock-free across ranks:
//  - interleave = 1: it is DeepSpeed's TrainSchedule, whose steps can be separated by barriers;
//    with parallel.pipeline_engine deepspeed its p2p instructions are on the compute stream, in
//    the step's order (blocking pairs that line up between neighbours by the steps' parity), and
//    the gradient reductions and the tied-embedding sync follow the last step on every rank;
//  - interleave > 1: Megatron's interleaved order for compute, and the p2p instructions of every
//    rank sorted by one global key (the sender's finish time in a unit-cost run of the schedule,
//    ties broken by sender virtual stage, micro-batch, direction), so the pending pair with the
//    smallest key can always proceed;
//  - data-parallel, tensor-parallel, expert and embedding collectives run among ranks of one stage
//    (or first/last stage at the end), which have identical streams. The reductions a first / last
//    stage holds back until after the EmbeddingSync (tied embeddings) are the same buckets on every
//    rank of the stage, so its DP groups still see one order; the embedding group's two members
//    both reach the sync after their last backward.
//  - with sequence parallelism, the TP group's gradient sums run on the reduction stream while
//    the compute stream issues its own TP collectives: the TP members' Programs are identical, so
//    both streams' collectives are matched in one per-group order.
#include "core/program_builder.hpp"

#include <algorithm>
#include <numeric>
#include <span>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <cstring>

#include "core/chain_index.hpp"
#include "core/grid.hpp"
#include "core/memory.hpp"
#include "core/optimizer_step.hpp"
#include "core/pipeline_engine.hpp"
#include "core/schedule.hpp"
#include "core/stage_plan.hpp"
#include "core/zero_partition.hpp"
#include "core/zero3_placement.hpp"

namespace dssim {
namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

using Act = PipeAct;  // (core/schedule.hpp)
using Action = PipeAction;

int micro_batches_of(const Scenario& sc) {
  if (sc.training.grad_accum > 0) return sc.training.grad_accum;
  const int64_t per_step = int64_t(std::max(1, sc.training.micro_batch)) * sc.parallel.dp;
  if (sc.training.global_batch > 0 && sc.training.global_batch % per_step == 0)
    return int(sc.training.global_batch / per_step);
  throw std::invalid_argument("build_program: gradient accumulation steps unknown (set grad_accum)");
}

class Builder {
  // The step takes a global norm of the gradients: fp16's overflow check, gradient clipping.
  bool step_takes_norm() const {
    return sc_.precision.dtype == Dtype::fp16 || sc_.training.gradient_clipping > 0;
  }

 public:
  Builder(const Scenario& sc, const BuildOptions& opts)
      : sc_(sc), opts_(opts), grid_(sc.parallel), m_(sc.model) {
    p_ = sc.parallel.pp;
    v_ = std::max(1, sc.parallel.interleave);
    t_ = sc.parallel.tp;
    M_ = micro_batches_of(sc);
    b_ = std::max(1, sc.training.micro_batch);
    g_ = bytes_of(sc.precision.dtype);
    zero_ = sc.zero.stage;
    cg_ = sc.precision.communication_bytes();
    // ZeRO++ (stage 3): hpZ's secondary partition over hpz_ DP ranks; qgZ's two levels, the DP
    // ranks of one node (qgz_local_) then the nodes. See docs/simulator.md, "ZeRO++".
    if (zero_ == 3 && sc.parallel.dp > 1) {
      hpz_ = sc.zero.hpz() && sc.zero.hpz_partition_size < sc.parallel.dp &&
                     sc.parallel.dp % sc.zero.hpz_partition_size == 0
                 ? sc.zero.hpz_partition_size : 1;
      qwz_ = sc.zero.quantized_weights;
      qgz_ = sc.zero.quantized_gradients;
      const int gpn = std::max(1, sc.cluster.gpus_per_node);
      const int local = t_ <= gpn && gpn % t_ == 0 ? gpn / t_ : 1;
      qgz_local_ = local > 1 && local < sc.parallel.dp && sc.parallel.dp % local == 0 ? local : 1;
    }
    if (zero_ < 0 || zero_ > 3) throw std::invalid_argument("zero.stage must be 0..3");
    if (m_.layers < 1 || m_.hidden < 1 || m_.seq_len < 1)
      throw std::invalid_argument("build_program: model needs layers, hidden and seq_len");
    if (v_ > 1 && M_ % p_ != 0)
      throw std::invalid_argument("interleaved pipeline schedule: micro-batches (" + std::to_string(M_) +
                                  ") must be a multiple of the pipeline size (" + std::to_string(p_) + ")");
    act_bytes_ = double(b_) * m_.seq_len * m_.hidden * g_;
    // The pipeline engine (core/pipeline_engine.hpp): where p2p runs, TP partitioning of the
    // messages (Megatron's scatter/gather, DeepSpeed's pipe_partitioned), when gradients reduce.
    engine_ = pipeline_engine_model(sc);
    if (engine_.engine == PipelineEngine::deepspeed && p_ > 1 && (v_ > 1 || zero_ >= 2))
      throw std::invalid_argument("build_program: parallel.pipeline_engine deepspeed runs neither parallel.interleave > 1 "
                                  "nor zero.stage >= 2 (core/pipeline_engine.cpp)");
    const bool sp = sc.parallel.sequence_parallel;
    p2p_act_bytes_ = (sp || engine_.partition_activations) ? act_bytes_ / t_ : act_bytes_;
    p2p_grad_bytes_ = (sp || engine_.partition_gradients) ? act_bytes_ / t_ : act_bytes_;
    // DeepSpeed's dispatch buffer [experts, capacity, h] of the b s tokens a TP rank gates, split
    // over the TP group (drop_tokens). Without dropping the capacity is the busiest expert's load,
    // known at run time only: priced as top_k x capacity_factor slots per token.
    moe_buffer_bytes_ = moe_routed_slots(m_, double(b_) * m_.seq_len) * m_.hidden * g_;
    a2a_bytes_ = moe_buffer_bytes_ / t_;
    onebit_ = sc.optimizer.onebit_compressed(zero_);
  }

  Program build() {
    Program prog;
    prog.world = grid_.world();
    prog.representative_only = opts_.representative_only;
    group_ids_.assign(7, {});
    for (int k = 0; k < 7; ++k) group_ids_[k].assign(grid_.group_count(GroupKind(k)), -1);
    plans_ = plan_stages(sc_, grid_, engine_, prog, opts_.stage_plans);
    stage_actions_.resize(p_);
    for (int s = 0; s < p_; ++s) stage_actions_[s] = &schedule()[s];
    std::vector<int> ranks;
    if (opts_.representative_only) {
      for (int s = 0; s < p_; ++s) ranks.push_back(grid_.rank_of(0, s, 0));
    } else {
      for (int r = 0; r < grid_.world(); ++r) ranks.push_back(r);
    }
    prog.ranks.resize(ranks.size());
    // Ranks of one stage have the same number of instructions, other stages about as many.
    std::vector<std::pair<size_t, size_t>> reserve(p_, {0, 0});  // (instructions, deps) per stage
    std::pair<size_t, size_t> last{0, 0};
    for (size_t i = 0; i < ranks.size(); ++i) {
      const int stage = grid_.coord(ranks[i]).pp;
      RankProgram& rp = prog.ranks[i];
      rp.rank = ranks[i];
      const auto [ni, nd] = reserve[stage].first > 0 ? reserve[stage] : last;
      rp.instructions.reserve(ni + ni / 8);
      rp.deps.reserve(nd + nd / 8);
      emit_rank(prog, rp);
      last = reserve[stage] = {rp.instructions.size(), rp.deps.size()};
    }
    return prog;
  }

 private:
  // ---- planning (per stage) ----

  // Every stage's action list (core/schedule.hpp stage_actions: shared and cached per (pp,
  // interleave, micro-batches)).
  const std::vector<std::vector<Action>>& schedule() {
    if (!schedule_) schedule_ = stage_actions(p_, v_, M_);
    return *schedule_;
  }

  // ---- emission (per rank) ----

  int group_id(Program& prog, GroupKind kind, int rank) {
    const int gi = grid_.group_index(kind, rank);
    if (gi < 0) return -1;
    int& id = group_ids_[int(kind)][gi];
    if (id < 0) {
      id = int(prog.groups.size());
      prog.groups.push_back({kind, grid_.group_of(kind, rank)});
    }
    return id;
  }

  // ZeRO++ sub-groups of the DP groups of `rank`'s stage: DPIntra of `size` consecutive DP ranks,
  // DPInter of `size` ranks striding dp / size. All of the stage's are registered at once (in a
  // fixed order) so that a Program of stage representatives carries every rank's own sub-group.
  int sub_group(Program& prog, int rank, GroupKind kind, int size) {
    const RankCoord c = grid_.coord(rank);
    const int dp = sc_.parallel.dp, n_groups = dp / size;
    int mine = -1;
    for (int t = 0; t < t_; ++t)
      for (int k = 0; k < n_groups; ++k) {
        std::vector<int> ranks;
        for (int i = 0; i < size; ++i)
          ranks.push_back(grid_.rank_of(kind == GroupKind::DPIntra ? k * size + i : i * n_groups + k, c.pp, t));
        auto [it, fresh] = sub_groups_.try_emplace({int(kind), ranks}, int(prog.groups.size()));
        if (fresh) prog.groups.push_back({kind, ranks});
        if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) mine = it->second;
      }
    return mine;
  }

  struct RankCtx {
    RankProgram* rp = nullptr;
    const StagePlan* plan = nullptr;
    RankCoord c;
    int tp_g = -1, dp_g = -1, ep_g = -1, edp_g = -1, emb_g = -1;
    int hpz_g = -1, qgz_intra_g = -1, qgz_inter_g = -1;  // ZeRO++ sub-groups of the DP group
    int dp_n = 1, edp_n = 1;
    std::vector<uint32_t> deps;
    uint32_t last_compute = kNone;
    Program* prog = nullptr;
    uint32_t chain = kNone;            // collapse_chains: the open chain's instruction
    // Per (send / recv kind, chunk) the instruction of the first micro-batch: the later ones are
    // copies with their micro-batch and tag patched in place (p2p_from).
    std::vector<Instruction> p2p_proto;
    std::vector<char> p2p_made;
    std::vector<uint32_t> chain_deps;  // and what its first member waits for
    // collapse_chains: per (chunk, forward / backward) the one instruction a micro-batch's pass
    // emits (emit_compute_action), and whether it waits for the micro-batch's Recv.
    struct Template { bool tried = false, ok = false, waits = false; Instruction in{}; };
    std::vector<Template> templates;
    uint32_t last_reduce = kNone;   // last DP reduction (stream DpComm or Compute)
    uint32_t last_d2h = kNone;
    std::vector<uint32_t> recv_act, recv_grad, fwd_out, bwd_out;  // [chunk * M + mb]
    // stage 3: per compute segment in program order, the AG instructions it waits for
    std::vector<std::pair<uint32_t, uint32_t>> ag;  // (dense, expert)
    size_t ag_emitted = 0;
    size_t seg_cursor = 0;
    // Reductions of buckets holding the (tied) word embedding, emitted after the EmbeddingSync.
    struct Postponed {
      Op op;
      bool expert;
      int bucket;
      double elems, mine_elems;
      int mb, chunk, layer;
      uint32_t sp_sum;  // the bucket's SP gradient all-reduce (kNone: none)
      Stream st;
    };
    std::vector<Postponed> postponed;
  };

  struct SegRef {
    bool forward;
    int chunk;
    int seg;
  };

  // Appends `in` (or, with collapse_chains, folds it into the open chain it runs right after);
  // the id it returns is final: nothing is folded into it later. An instruction of another stream
  // waits for a compute-stream one only through an id from add or compute_tail, so a chain's
  // members other than its last are never waited for.
  uint32_t add(RankCtx& x, const Instruction& in, std::initializer_list<uint32_t> waits) {
    const Stream stream = in.stream;  // (read before: `in` may be the caller's only copy)
    const uint32_t id = add_link(x, in, waits);
    if (stream == Stream::Compute) finish_chain(x);
    return id;
  }

  // Appends an instruction that joins no chain; on the compute stream it is the last compute and
  // closes the open chain.
  uint32_t append(RankCtx& x, const Instruction& in, const uint32_t* deps, size_t n) {
    const bool compute = in.stream == Stream::Compute;  // (read before: `in` may be the caller's only copy)
    const uint32_t id = x.rp->add(in, deps, n);
    if (compute) {
      x.last_compute = id;
      finish_chain(x);
    }
    return id;
  }

  // As add, but the instruction stays open for the next compute-stream instruction to fold into
  // (collapse_chains): for instructions whose id the caller does not keep.
  uint32_t add_link(RankCtx& x, const Instruction& in, std::initializer_list<uint32_t> waits) {
    x.deps.clear();
    for (uint32_t w : waits)
      if (w != kNone) x.deps.push_back(w);
    const bool compute = in.stream == Stream::Compute;
    const bool link = opts_.collapse_chains && compute && starts_on_arrival(*x.prog, in);
    if (link && x.chain != kNone) {
      // It starts when the chain's last member ends if it waits for nothing the chain's first did not.
      bool covered = true;
      for (uint32_t w : x.deps)
        if (std::find(x.chain_deps.begin(), x.chain_deps.end(), w) == x.chain_deps.end()) { covered = false; break; }
      if (covered) {
        Instruction& head = x.rp->instructions[x.chain];
        Program& prog = *x.prog;
        if (head.chain < 0) {
          head.chain = static_cast<int32_t>(prog.chains.size());
          prog.chains.push_back({static_cast<uint32_t>(prog.chain_members.size()), 1});
          prog.chain_members.push_back(head);
          prog.chain_members.back().chain = -1;
        }
        prog.chain_members.push_back(in);
        prog.chain_members.back().deps_begin = prog.chain_members.back().deps_count = 0;
        ++prog.chains[head.chain].count;
        return x.chain;
      }
    }
    const uint32_t id = append(x, in, x.deps.data(), x.deps.size());
    if (!compute) return id;  // (other streams neither extend nor close the chain)
    x.chain = link ? id : kNone;
    if (link) x.chain_deps.assign(x.deps.begin(), x.deps.end());
    return id;
  }

  // The last compute-stream instruction, for a later instruction to wait for: closes its chain.
  uint32_t compute_tail(RankCtx& x) {
    finish_chain(x);
    return x.last_compute;
  }

  // Closes the open chain. A chain whose members cost what an earlier one's do (the forward of a
  // chunk is the same run for every micro-batch) shares that one's members: Program::chains stays
  // small and the estimator prices each distinct chain once.
  void finish_chain(RankCtx& x) {
    if (x.chain == kNone) return;
    Instruction& head = x.rp->instructions[x.chain];
    x.chain = kNone;
    if (head.chain < 0) return;
    Program& prog = *x.prog;
    const Chain c = prog.chains[head.chain];  // the last chain: members at the end of chain_members
    uint64_t h = c.count;
    for (uint32_t k = c.begin; k < c.begin + c.count; ++k) h = h * 1000003u ^ cost_hash(prog.chain_members[k]);
    for (int32_t other : chain_index_.find(h)) {
      const Chain& o = prog.chains[other];
      if (o.count != c.count) continue;
      bool equal = true;
      for (uint32_t k = 0; k < c.count && equal; ++k)
        equal = same_cost(prog.chain_members[o.begin + k], prog.chain_members[c.begin + k]);
      if (!equal) continue;
      prog.chain_members.resize(c.begin);
      prog.chains.pop_back();
      head.chain = other;
      return;
    }
    chain_index_.insert(h, head.chain);
  }

  // What pricing and attributing an instruction read (not its micro-batch).
  static bool same_cost(const Instruction& a, const Instruction& b) {
    return a.op == b.op && a.stream == b.stream && a.purpose == b.purpose && a.chunk == b.chunk &&
           a.layer_begin == b.layer_begin && a.layer_count == b.layer_count && a.group == b.group &&
           a.peer == b.peer && a.bucket == b.bucket && a.repeat == b.repeat && a.flops == b.flops &&
           a.bytes == b.bytes && a.memory_bytes == b.memory_bytes && a.gemm_flops == b.gemm_flops && a.ops == b.ops;
  }
  static uint64_t cost_hash(const Instruction& a) {
    uint64_t bits[4];
    std::memcpy(&bits[0], &a.flops, 8);
    std::memcpy(&bits[1], &a.bytes, 8);
    std::memcpy(&bits[2], &a.memory_bytes, 8);
    bits[3] = uint64_t(a.op) | uint64_t(a.purpose) << 8 | uint64_t(uint32_t(a.group)) << 16 | uint64_t(uint32_t(a.repeat)) << 40 |
              uint64_t(uint32_t(a.ops)) << 52;
    uint64_t h = 1469598103934665603ull;
    for (uint64_t b : bits) h = (h ^ b) * 1099511628211ull;
    return h ^ uint64_t(uint32_t(a.layer_begin)) * 0x9E3779B97F4A7C15ull;
  }

  // Runs as soon as the stream reaches it: compute, copies, and collectives of a group with one
  // materialized member (BuildOptions::representative_only: TP, DP, EP groups of a stage).
  bool starts_on_arrival(const Program& prog, const Instruction& in) {
    switch (in.op) {
      case Op::Forward: case Op::Backward: case Op::Recompute: case Op::OptimizerStep:
      case Op::CopyH2D: case Op::CopyD2H:
        return true;
      case Op::AllReduce: case Op::ReduceScatter: case Op::AllGather: case Op::AllToAll: {
        if (in.group < 0) return false;
        if (single_member_.size() <= size_t(in.group)) single_member_.resize(in.group + 1, -1);
        int8_t& known = single_member_[in.group];
        if (known < 0) {
          int materialized = 0;
          for (int r : prog.groups[in.group].ranks) {
            const RankCoord c = grid_.coord(r);
            if (!opts_.representative_only || (c.dp == 0 && c.tp == 0)) ++materialized;
          }
          known = materialized == 1 ? 1 : 0;
        }
        return known == 1;
      }
      default:
        return false;
    }
  }

  static Instruction make(Op op, Stream st, Purpose pu, int mb = -1, int chunk = -1) {
    Instruction in{};
    in.op = op;
    in.stream = st;
    in.purpose = pu;
    in.micro_batch = mb;
    in.chunk = chunk;
    return in;
  }

  void emit_rank(Program& prog, RankProgram& rp) {
    RankCtx x;
    x.rp = &rp;
    x.prog = &prog;
    x.c = grid_.coord(rp.rank);
    x.plan = &(*plans_)[x.c.pp];
    const std::vector<Action>& actions = *stage_actions_[x.c.pp];
    const StagePlan& plan = *x.plan;
    x.tp_g = t_ > 1 ? group_id(prog, GroupKind::TP, rp.rank) : -1;
    x.dp_n = sc_.parallel.dp;
    x.edp_n = grid_.expert_dp();
    x.dp_g = x.dp_n > 1 ? group_id(prog, GroupKind::DP, rp.rank) : -1;
    if (x.dp_g >= 0 && hpz_ > 1) x.hpz_g = sub_group(prog, rp.rank, GroupKind::DPIntra, hpz_);
    if (x.dp_g >= 0 && qgz_ && qgz_local_ > 1) {
      x.qgz_intra_g = sub_group(prog, rp.rank, GroupKind::DPIntra, qgz_local_);
      x.qgz_inter_g = sub_group(prog, rp.rank, GroupKind::DPInter, sc_.parallel.dp / qgz_local_);
    }
    x.edp_g = (plan.has_expert && x.edp_n > 1) ? group_id(prog, GroupKind::ExpertDP, rp.rank) : -1;
    x.ep_g = (m_.is_moe() && sc_.parallel.ep > 1) ? group_id(prog, GroupKind::EP, rp.rank) : -1;
    const bool emb_member = p_ > 1 && m_.tied_embeddings && (x.c.pp == 0 || x.c.pp == p_ - 1);
    x.emb_g = emb_member ? group_id(prog, GroupKind::Embedding, rp.rank) : -1;
    x.recv_act.assign(v_ * M_, kNone);
    x.recv_grad.assign(v_ * M_, kNone);
    x.fwd_out.assign(v_ * M_, kNone);
    x.bwd_out.assign(v_ * M_, kNone);
    x.templates.assign(2 * v_, {});
    x.p2p_proto.assign(4 * v_, Instruction{});
    x.p2p_made.assign(4 * v_, 0);

    // Stage 3: the compute segments in program order (for the prefetching gathers).
    std::vector<SegRef> segs;
    if (zero_ == 3) {
      for (const Action& a : actions) {
        if (a.act == Act::Fwd)
          for (int k = 0; k < int(plan.chunks[a.chunk].fwd.size()); ++k) segs.push_back({true, a.chunk, k});
        if (a.act == Act::Bwd)
          for (int k = int(plan.chunks[a.chunk].fwd.size()) - 1; k >= 0; --k)
            segs.push_back({false, a.chunk, k});
      }
      x.ag.assign(segs.size(), {kNone, kNone});
    }

    for (const Action& a : actions) {
      const Chunk& ch = plan.chunks[a.chunk];
      const int slot = a.chunk * M_ + a.mb;
      switch (a.act) {
        case Act::RecvAct:
          x.recv_act[slot] = add_p2p(x, 0, a, Op::Recv, Purpose::PipelineActivation, peer_of(x.c, ch.vs - 1),
                                     tag_of(ch.vs - 1, a.mb, 0), kNone);
          break;
        case Act::SendAct:
          add_p2p(x, 1, a, Op::Send, Purpose::PipelineActivation, peer_of(x.c, ch.vs + 1), tag_of(ch.vs, a.mb, 0),
                  x.fwd_out[slot]);
          break;
        case Act::RecvGrad:
          x.recv_grad[slot] = add_p2p(x, 2, a, Op::Recv, Purpose::PipelineGradient, peer_of(x.c, ch.vs + 1),
                                      tag_of(ch.vs + 1, a.mb, 1), kNone);
          break;
        case Act::SendGrad:
          add_p2p(x, 3, a, Op::Send, Purpose::PipelineGradient, peer_of(x.c, ch.vs - 1), tag_of(ch.vs, a.mb, 1),
                  x.bwd_out[slot]);
          break;
        case Act::Fwd: emit_compute_action(prog, x, segs, a, true); break;
        case Act::Bwd: emit_compute_action(prog, x, segs, a, false); break;
      }
    }
    emit_batch_end(x);
    finish_chain(x);
  }

  // A pipeline send / receive (`kind`: 0 RecvAct, 1 SendAct, 2 RecvGrad, 3 SendGrad) of action `a`,
  // waiting for `wait` (kNone: nothing). After a chunk's first, a copy of that one with its
  // micro-batch and tag written in place: an instruction assembled field by field on the stack and
  // then copied into the Program stalled on reading back its fresh stores.
  uint32_t add_p2p(RankCtx& x, int kind, const Action& a, Op op, Purpose purpose, int peer, int tag, uint32_t wait) {
    const int k = kind * v_ + a.chunk;
    if (!x.p2p_made[k]) {
      Instruction& in = x.p2p_proto[k];
      in = make(op, engine_.p2p_stream, purpose, a.mb, a.chunk);
      in.peer = peer;
      in.bytes = purpose == Purpose::PipelineActivation ? p2p_act_bytes_ : p2p_grad_bytes_;
      x.p2p_made[k] = 1;
    }
    // Not a compute instruction that starts on arrival (no chain to join): appended.
    const uint32_t id = append(x, x.p2p_proto[k], &wait, wait != kNone ? 1 : 0);
    Instruction& in = x.rp->instructions[id];
    in.micro_batch = a.mb;
    in.tag = tag;
    return id;
  }

  // A forward (or a backward that reduces nothing) of a chunk emits the same instructions for
  // every micro-batch; with collapse_chains that is one instruction (a chain) waiting for the
  // micro-batch's Recv, so after the first it is copied instead of emitted again (ZeRO 0-2; ZeRO-3's
  // gathers and reductions interleave with the compute).
  void emit_compute_action(Program& prog, RankCtx& x, const std::vector<SegRef>& segs, const Action& a, bool forward) {
    const int slot = a.chunk * M_ + a.mb;
    const bool reduces = !forward && (zero_ >= 2 || a.mb == M_ - 1);
    if (!opts_.collapse_chains || zero_ == 3 || reduces) {
      forward ? emit_forward(prog, x, segs, a) : emit_backward(prog, x, segs, a);
      return;
    }
    RankCtx::Template& t = x.templates[a.chunk * 2 + (forward ? 0 : 1)];
    const uint32_t recv = forward ? x.recv_act[slot] : x.recv_grad[slot];
    finish_chain(x);
    if (t.ok && t.waits == (recv != kNone)) {
      // (Copied from the template, then patched in place: see add_p2p.)
      const uint32_t id = t.waits ? x.rp->add(t.in, {recv}) : x.rp->add(t.in, {});
      x.rp->instructions[id].micro_batch = a.mb;
      x.last_compute = id;
      (forward ? x.fwd_out : x.bwd_out)[slot] = id;
      return;
    }
    const size_t before = x.rp->instructions.size();
    forward ? emit_forward(prog, x, segs, a) : emit_backward(prog, x, segs, a);
    if (t.tried) return;
    t.tried = true;
    const auto& ins = x.rp->instructions;
    if (ins.size() != before + 1 || ins.back().stream != Stream::Compute) return;
    const Instruction& in = ins.back();
    const bool waits = in.deps_count == 1 && x.rp->deps[in.deps_begin] == recv;
    if (!waits && !(in.deps_count == 0 && recv == kNone)) return;
    t.ok = true;
    t.in = in;
    t.waits = waits;
  }

  int peer_of(const RankCoord& c, int vs) const { return grid_.rank_of(c.dp, vs % p_, c.tp); }
  int tag_of(int sender_vs, int mb, int dir) const { return (mb * (p_ * v_) + sender_vs) * 2 + dir; }

  // Stage 3: issue the gathers of segments up to `k` plus the prefetch window.
  void issue_gathers(RankCtx& x, const std::vector<SegRef>& segs, size_t k) {
    const StagePlan& plan = *x.plan;
    const auto seg_layers = [&](size_t i) {
      const SegRef& r = segs[i];
      const Chunk& ch = plan.chunks[r.chunk];
      const Segment& s = ch.fwd[r.seg];  // (the backward runs the forward's segments)
      return std::make_pair(s.layer_begin, s.layer_count);
    };
    const auto seg_elems = [&](size_t i) {
      int64_t n = 0;
      auto [lb, lc] = seg_layers(i);
      for (int l = lb; l < lb + lc; ++l) {
        auto it = plan.s3_dense.find(l);
        if (it != plan.s3_dense.end()) n += plan.dense.stage3_groups[it->second].numel;
        auto jt = plan.s3_expert.find(l);
        if (jt != plan.s3_expert.end()) n += plan.expert.stage3_groups[jt->second].numel;
      }
      return n;
    };
    int64_t window = 0;
    for (size_t j = k + 1; j < x.ag_emitted && j < segs.size(); ++j) window += seg_elems(j);
    while (x.ag_emitted < segs.size()) {
      const size_t j = x.ag_emitted;
      if (j > k) {
        // How far ahead the engine prefetches (core/zero3_placement.hpp).
        if (!zero3_prefetch(sc_.zero, int(j - k), window, seg_elems(j))) break;
        window += seg_elems(j);
      }
      auto [lb, lc] = seg_layers(j);
      const SegRef& r = segs[j];
      for (int pass = 0; pass < 2; ++pass) {
        const bool expert = pass == 1;
        const auto& idx = expert ? plan.s3_expert : plan.s3_dense;
        const ZeroPartition& z = expert ? plan.expert : plan.dense;
        const int grp = expert ? x.edp_g : x.dp_g;
        uint32_t last = kNone;
        for (int l = lb; l < lb + lc; ++l) {
          auto it = idx.find(l);
          if (it == idx.end()) continue;
          const Stage3Group& sg = z.stage3_groups[it->second];
          uint32_t fetch = kNone;
          if (sc_.zero.offload_param) {
            Instruction h = make(Op::CopyH2D, Stream::Offload, Purpose::OffloadParam, -1, r.chunk);
            h.layer_begin = l;
            h.layer_count = 1;
            h.bytes = double(sg.shard_numel) * g_;
            // ZeRO-Infinity: the shard is read from NVMe into a host buffer first.
            if (sc_.zero.on_nvme_param(sc_.cluster.nvme_bandwidth)) h.memory_bytes = h.bytes;
            fetch = add(x, h, {});
            last = fetch;
          }
          if (grp >= 0) {
            Instruction in = make(Op::AllGather, Stream::DpComm, Purpose::ParamGather, -1, r.chunk);
            in.layer_begin = l;
            in.layer_count = 1;
            in.group = grp;
            in.bucket = it->second;
            // The engine's fetches of this layer: `repeat` all-gathers that together move the
            // group (the torch backend gathers the group in one call of the same bytes).
            in.repeat = (expert ? plan.s3_expert_calls : plan.s3_dense_calls)[it->second];
            in.bytes = s3_gather_bytes(sg.shard_numel, z.dp) / in.repeat;
            // hpZ: backward (and its recompute) gathers the secondary partition, kept after the
            // forward gather, within the node (DeepSpeed's ds_secondary_tensor); dense only.
            if (!r.forward && !expert && x.hpz_g >= 0) {
              in.group = x.hpz_g;
              in.bytes = s3_gather_bytes((sg.numel + hpz_ - 1) / hpz_, hpz_) / in.repeat;
            }
            last = add(x, in, {fetch});
          }
        }
        (expert ? x.ag[j].second : x.ag[j].first) = last;
      }
      ++x.ag_emitted;
    }
  }

  // Scatter/gather: the Recv brought this rank's 1/tp slice; the TP group all-gathers the rest
  // over NVLink before the chunk can run (Megatron's gather_split_1d_tensor).
  void gather_received_slice(RankCtx& x, uint32_t recv, Purpose purpose, int mb, int chunk) {
    const bool partitioned = purpose == Purpose::PipelineActivation ? engine_.partition_activations
                                                                    : engine_.partition_gradients;
    if (!partitioned || recv == kNone || x.tp_g < 0) return;
    Instruction in = make(Op::AllGather, Stream::Compute, purpose, mb, chunk);
    in.group = x.tp_g;
    in.bytes = act_bytes_;
    add_link(x, in, {recv});
  }

  void emit_tp(RankCtx& x, const Segment& s, int mb, int chunk) {
    const int layers = s.dense_layers + s.moe_layers;
    if (x.tp_g < 0 || layers == 0) return;
    // Megatron's f/g: 2 all-reduces per layer; with sequence parallelism each becomes an
    // all-gather + reduce-scatter pair. A MoE layer's experts are not TP-split: only its attention
    // has an f/g pair (its token drop / gather is emit_moe's).
    static constexpr Op kPlain[] = {Op::AllReduce};
    static constexpr Op kSequenceParallel[] = {Op::AllGather, Op::ReduceScatter};
    const bool sp = sc_.parallel.sequence_parallel;
    for (Op op : sp ? std::span<const Op>(kSequenceParallel) : std::span<const Op>(kPlain)) {
      Instruction in = make(op, Stream::Compute, Purpose::TensorParallel, mb, chunk);
      in.group = x.tp_g;
      in.layer_begin = s.layer_begin;
      in.layer_count = s.layer_count;
      in.repeat = sp ? 2 * layers : 2 * s.dense_layers + s.moe_layers;
      in.bytes = act_bytes_;
      add_link(x, in, {});
    }
  }

  // DeepSpeed's activation checkpointing options (core/scenario.hpp CheckpointingSpec) on the
  // layers of a segment, one instruction repeated per layer, on the compute stream: checkpointing.py
  // copies a partition to and from the host with a blocking .to(device), and all-gathers the
  // partitions over the model-parallel group before the recompute (get_full_inputs).
  // One TP rank's share of a layer input: partitioned over the group, or (sequence parallelism) a
  // sequence shard already.
  double checkpoint_partition_bytes() const { return act_bytes_ / t_; }
  void emit_checkpoint_copy(RankCtx& x, const Segment& s, int mb, int chunk, Op op) {
    const int layers = s.dense_layers + s.moe_layers;
    if (!sc_.checkpointing.offloads(sc_.recompute) || layers == 0) return;
    Instruction in = make(op, Stream::Compute, Purpose::OffloadActivation, mb, chunk);
    in.layer_begin = s.layer_begin;
    in.layer_count = s.layer_count;
    in.repeat = layers;
    in.bytes = checkpoint_partition_bytes();
    add_link(x, in, {});
  }
  void emit_checkpoint_gather(RankCtx& x, const Segment& s, int mb, int chunk) {
    const int layers = s.dense_layers + s.moe_layers;
    // With sequence parallelism the checkpoint is a sequence shard already: nothing to gather.
    if (!sc_.checkpointing.partitions(sc_.recompute) || x.tp_g < 0 || layers == 0 ||
        sc_.parallel.sequence_parallel)
      return;
    emit_tp_one(x, s, mb, chunk, Op::AllGather, act_bytes_, layers);
  }

  // One TP collective of the segment's layer range on the blocking compute stream.
  void emit_tp_one(RankCtx& x, const Segment& s, int mb, int chunk, Op op, double bytes, int repeat = 1) {
    Instruction in = make(op, Stream::Compute, Purpose::TensorParallel, mb, chunk);
    in.group = x.tp_g;
    in.layer_begin = s.layer_begin;
    in.layer_count = s.layer_count;
    in.repeat = repeat;
    in.bytes = bytes;
    add_link(x, in, {});
  }

  // Vocabulary-parallel embedding: each TP rank looks up its vocabulary slice and the partial
  // outputs are summed (all-reduce), or with sequence parallelism reduce-scattered into sequence
  // shards, whose backward is an all-gather. Not repeated by the full recompute (blocks only).
  void emit_tp_embedding(RankCtx& x, const Segment& s, int mb, int chunk, bool backward) {
    if (x.tp_g < 0 || !s.embedding) return;
    const bool sp = sc_.parallel.sequence_parallel;
    if (!backward) emit_tp_one(x, s, mb, chunk, sp ? Op::ReduceScatter : Op::AllReduce, act_bytes_);
    else if (sp) emit_tp_one(x, s, mb, chunk, Op::AllGather, act_bytes_);
  }

  // LM head (column-parallel over the vocabulary) and Megatron's vocab_parallel_cross_entropy.
  // Forward: with SP the final norm's sequence shards are all-gathered first; the loss all-reduces
  // three fp32 [b, s] tensors (max logit, predicted logit, sum of exponentials). Backward: the
  // input gradient of the head is summed over the TP group (the copy-to-TP-region's backward), or
  // reduce-scattered back into sequence shards with SP.
  void emit_tp_head(RankCtx& x, const Segment& s, int mb, int chunk, bool backward) {
    if (x.tp_g < 0 || !s.head) return;
    const bool sp = sc_.parallel.sequence_parallel;
    if (!backward) {
      if (sp) emit_tp_one(x, s, mb, chunk, Op::AllGather, act_bytes_);
      emit_tp_one(x, s, mb, chunk, Op::AllReduce, double(b_) * m_.seq_len * 4, 3);
    } else {
      emit_tp_one(x, s, mb, chunk, sp ? Op::ReduceScatter : Op::AllReduce, act_bytes_);
    }
  }

  // A MoE layer's all-to-alls over the EP group and, with tp > 1, DeepSpeed's token drop / gather
  // over the TP group (deepspeed/moe/sharded_moe.py MOELayer.forward, deepspeed/moe/mappings.py):
  // the tokens are the same on every TP rank, so each keeps 1/t of the capacity slots before the
  // dispatch (drop_tokens, no communication; its backward all-gathers the gradient) and the
  // combined slots are all-gathered after the combine (gather_tokens; its backward is a drop).
  // One all-gather of the whole [experts, capacity, h] buffer per layer and pass, after the two
  // all-to-alls in both (backward: combine, dispatch, then the drop's all-gather).
  void emit_moe(RankCtx& x, const Segment& s, int mb, int chunk, bool backward) {
    if (s.moe_layers == 0) return;
    if (x.ep_g >= 0) emit_moe_all_to_alls(x, s, mb, chunk, backward);
    if (x.tp_g >= 0 && !sc_.parallel.sequence_parallel)
      emit_tp_one(x, s, mb, chunk, Op::AllGather, moe_buffer_bytes_, s.moe_layers);
  }

  void emit_moe_all_to_alls(RankCtx& x, const Segment& s, int mb, int chunk, bool backward) {
    for (int k = 0; k < 2; ++k) {
      const bool dispatch = backward ? k == 1 : k == 0;
      Instruction in = make(Op::AllToAll, Stream::Compute,
                            dispatch ? Purpose::MoEDispatch : Purpose::MoECombine, mb, chunk);
      in.group = x.ep_g;
      in.layer_begin = s.layer_begin;
      in.layer_count = s.layer_count;
      in.repeat = s.moe_layers;
      in.bytes = a2a_bytes_;
      add_link(x, in, {});
    }
  }

  static void set_cost(Instruction& in, const OpsCost& c) {
    in.flops = c.flops;
    in.gemm_flops = c.gemm_flops;
    in.memory_bytes = c.memory_bytes;
  }

  // Forward / recompute / backward of one segment's layers for one micro-batch.
  static Instruction segment_compute(Op op, const Segment& s, const OpsCost& cost, const Action& a) {
    Instruction in = make(op, Stream::Compute, Purpose::None, a.mb, a.chunk);
    in.layer_begin = s.layer_begin;
    in.layer_count = s.layer_count;
    in.ops = s.ops;
    set_cost(in, cost);
    return in;
  }

  void emit_forward(Program&, RankCtx& x, const std::vector<SegRef>& segs, const Action& a) {
    const Chunk& ch = x.plan->chunks[a.chunk];
    const int slot = a.chunk * M_ + a.mb;
    for (size_t k = 0; k < ch.fwd.size(); ++k) {
      const Segment& s = ch.fwd[k];
      uint32_t ag_d = kNone, ag_e = kNone;
      if (zero_ == 3) {
        issue_gathers(x, segs, x.seg_cursor);
        std::tie(ag_d, ag_e) = x.ag[x.seg_cursor];
        ++x.seg_cursor;
      }
      if (k == 0) gather_received_slice(x, x.recv_act[slot], Purpose::PipelineActivation, a.mb, a.chunk);
      add_link(x, segment_compute(Op::Forward, s, s.fwd, a), {k == 0 ? x.recv_act[slot] : kNone, ag_d, ag_e});
      emit_checkpoint_copy(x, s, a.mb, a.chunk, Op::CopyD2H);
      emit_tp_embedding(x, s, a.mb, a.chunk, false);
      emit_tp(x, s, a.mb, a.chunk);
      emit_tp_head(x, s, a.mb, a.chunk, false);
      emit_moe(x, s, a.mb, a.chunk, false);
    }
    x.fwd_out[slot] = compute_tail(x);
  }

  void emit_backward(Program&, RankCtx& x, const std::vector<SegRef>& segs, const Action& a) {
    const StagePlan& plan = *x.plan;
    const Chunk& ch = plan.chunks[a.chunk];
    const int slot = a.chunk * M_ + a.mb;
    const bool overlap = sc_.zero.overlap_comm;
    // Which micro-batches reduce gradients: every one for stage 2 (and 3), the last for 0 / 1.
    const bool reduce_now = zero_ >= 2 || a.mb == M_ - 1;
    // DeepSpeed's PipelineEngine reduces only in ReduceGrads, after the whole schedule, blocking
    // (core/pipeline_engine.hpp): every bucket is postponed to the batch end, on the compute stream.
    const bool after = engine_.reduce_after_schedule;
    const bool split = zero_ < 3 && overlap && reduce_now && !after;
    const std::vector<Segment>& bsegs = split ? ch.bwd_split : ch.fwd;
    const Stream red_stream = overlap && !after ? Stream::DpComm : Stream::Compute;
    for (int k = int(bsegs.size()) - 1; k >= 0; --k) {
      const Segment& s = bsegs[k];
      const bool first = k == int(bsegs.size()) - 1;
      uint32_t ag_d = kNone, ag_e = kNone;
      if (zero_ == 3) {
        issue_gathers(x, segs, x.seg_cursor);
        std::tie(ag_d, ag_e) = x.ag[x.seg_cursor];
        ++x.seg_cursor;
      }
      const uint32_t grad_in = first ? x.recv_grad[slot] : kNone;
      if (first) gather_received_slice(x, grad_in, Purpose::PipelineGradient, a.mb, a.chunk);
      if (sc_.recompute != Recompute::none) {
        emit_checkpoint_copy(x, s, a.mb, a.chunk, Op::CopyH2D);
        emit_checkpoint_gather(x, s, a.mb, a.chunk);
        add_link(x, segment_compute(Op::Recompute, s, s.rec, a), {grad_in, ag_d, ag_e});
        if (sc_.recompute == Recompute::full) {  // the recomputed forward repeats its TP / MoE comm
          emit_tp(x, s, a.mb, a.chunk);
          emit_moe(x, s, a.mb, a.chunk, false);
        }
      }
      add_link(x, segment_compute(Op::Backward, s, s.bwd, a), {grad_in, ag_d, ag_e});
      emit_tp_embedding(x, s, a.mb, a.chunk, true);
      emit_tp(x, s, a.mb, a.chunk);
      emit_tp_head(x, s, a.mb, a.chunk, true);
      emit_moe(x, s, a.mb, a.chunk, true);
      // What a reduction of this segment's gradients waits for (closes the chain: only when one follows).
      const uint32_t produced = zero_ == 3 || reduce_now ? compute_tail(x) : x.last_compute;

      if (zero_ == 3) {
        for (int pass = 0; pass < 2; ++pass) {
          const bool expert = pass == 1;
          const auto& idx = expert ? plan.s3_expert : plan.s3_dense;
          const ZeroPartition& z = expert ? plan.expert : plan.dense;
          for (int l = s.layer_begin + s.layer_count - 1; l >= s.layer_begin; --l) {
            auto it = idx.find(l);
            if (it == idx.end()) continue;
            const Stage3Group& sg = z.stage3_groups[it->second];
            const BucketFlags& f = expert ? plan.expert_flags : plan.dense_flags;
            const uint32_t sp_sum = emit_sp_grad_sum(x, f.s3_sp_elems[it->second], it->second, a.mb, a.chunk,
                                                     l, produced, red_stream);
            if (sg.trainable_numel == 0) continue;  // every tensor of the group frozen: no gradient
            emit_reduction(x, Op::ReduceScatter, expert, it->second, double(sg.trainable_padded_numel()),
                           double(sg.trainable_shard_numel), a.mb, a.chunk, l, produced, red_stream, sp_sum,
                           (expert ? plan.s3_expert_reduces : plan.s3_dense_reduces)[it->second]);
          }
        }
      } else if (reduce_now) {
        // Buckets whose lowest layer is in this segment (whole segments: the chunk's last one).
        for (const BucketRef& r : plan.buckets) {
          if (r.chunk != a.chunk || r.layer < s.layer_begin || r.layer >= s.layer_begin + s.layer_count)
            continue;
          const BucketFlags& f = r.expert ? plan.expert_flags : plan.dense_flags;
          const uint32_t sp_sum = emit_sp_grad_sum(x, f.sp_elems[r.bucket], r.bucket, a.mb, a.chunk, r.layer,
                                                   produced, red_stream);
          if (onebit_) continue;  // replaced by the compressed all-reduce at the batch end
          const ZeroPartition& z = r.expert ? plan.expert : plan.dense;
          const GradBucket& bk = z.grad_buckets[r.bucket];
          const int me = r.expert ? x.c.edp : x.c.dp;
          const double mine = zero_ == 0 ? double(bk.range.count)
                                         : double(bk.sub_shards[std::min(me, int(bk.sub_shards.size()) - 1)].count);
          const Op op = zero_ == 0 ? Op::AllReduce : Op::ReduceScatter;
          if (after || (postpones_tied(x) && f.tied[r.bucket])) {  // after the EmbeddingSync (emit_batch_end)
            x.postponed.push_back({op, r.expert, r.bucket, double(bk.range.count), mine, a.mb, a.chunk, r.layer,
                                   sp_sum, red_stream});
            continue;
          }
          emit_reduction(x, op, r.expert, r.bucket, double(bk.range.count), mine, a.mb, a.chunk, r.layer,
                         produced, red_stream, sp_sum);
        }
      }
    }
    x.bwd_out[slot] = compute_tail(x);
  }

  // DeepSpeed ReduceTiedGrads before ReduceGrads: on the first and last stage of a pipeline with
  // tied embeddings, the buckets holding the word embedding (or its copy) are reduced after the
  // EmbeddingSync at the batch end. Stages 0/1 only (DeepSpeed refuses pp > 1 with ZeRO-2/3,
  // core/validate too; those builds keep reducing such buckets in the backward).
  bool postpones_tied(const RankCtx& x) const { return x.emb_g >= 0 && zero_ <= 1 && !onebit_; }

  // Sequence parallelism: the TP group sums the partial gradients of the SP-replicated parameters
  // (layer norms, row-parallel biases, position embedding) inside a bucket before its reduction
  // (Megatron's all-reduce of sequence-parallel grads in finalize_model_grads). Emitted also
  // without a DP group. Returns the instruction, kNone when there is none.
  uint32_t emit_sp_grad_sum(RankCtx& x, int64_t sp_elems, int bucket, int mb, int chunk, int layer,
                            uint32_t produced, Stream st) {
    if (!sc_.parallel.sequence_parallel || x.tp_g < 0 || sp_elems <= 0) return kNone;
    Instruction in = make(Op::AllReduce, st, Purpose::TensorParallel, mb, chunk);
    in.group = x.tp_g;
    in.bucket = bucket;
    in.layer_begin = layer;
    in.layer_count = 1;
    in.bytes = double(sp_elems) * g_;
    return add(x, in, {produced});
  }

  // `repeat`: the engine's calls for these elements (ZeRO-3: core/zero3_placement.hpp), each
  // moving an equal share.
  void emit_reduction(RankCtx& x, Op op, bool expert, int bucket, double elems, double mine_elems,
                      int mb, int chunk, int layer, uint32_t produced, Stream st, uint32_t sp_sum = kNone,
                      int repeat = 1) {
    const int grp = expert ? x.edp_g : x.dp_g;
    uint32_t id = kNone;
    if (grp >= 0 && op == Op::ReduceScatter && qgz_ && !expert) {
      // qgZ (DeepSpeed all_to_all_quant_reduce): int4 (0.5 byte per element) all-to-all of the
      // bucket within the node, a local reduction to 1/L of it, int4 all-to-all across the nodes
      // (the DP ranks at the same place in every node). One level over the DP group when it
      // lies within a node or its node-local part is not a divisor. Scales are left out (one fp32
      // per quantization group: under 0.1% of the int4 bytes).
      const bool two = x.qgz_intra_g >= 0 && x.qgz_inter_g >= 0;
      const std::pair<int, double> levels[] = {{two ? x.qgz_intra_g : grp, elems * 0.5},
                                               {two ? x.qgz_inter_g : -1, elems * 0.5 / qgz_local_}};
      uint32_t prev = kNone;
      for (const auto& [g, bytes] : levels) {
        if (g < 0) continue;
        Instruction in = make(Op::AllToAll, st, Purpose::GradientReduce, mb, chunk);
        in.group = g;
        in.bucket = bucket;
        in.layer_begin = layer;
        in.layer_count = 1;
        in.repeat = repeat;
        in.bytes = bytes / repeat;
        prev = id = prev == kNone ? add(x, in, {produced, sp_sum}) : add(x, in, {prev});
      }
      x.last_reduce = id;
    } else if (grp >= 0) {
      Instruction in = make(op, st, Purpose::GradientReduce, mb, chunk);
      in.group = grp;
      in.bucket = bucket;
      in.layer_begin = layer;
      in.layer_count = 1;
      in.repeat = repeat;
      in.bytes = elems * cg_ / repeat;  // communication_data_type (default: the compute dtype)
      id = add(x, in, {produced, sp_sum});
      x.last_reduce = id;
    }
    if (sc_.zero.offload_optimizer) {
      Instruction d = make(Op::CopyD2H, Stream::Offload, Purpose::OffloadGradient, mb, chunk);
      d.bucket = bucket;
      d.layer_begin = layer;
      d.layer_count = 1;
      d.bytes = mine_elems * g_;
      // The host adds them into its fp32 gradient buffer: read g + 4, write 4 bytes per element.
      d.memory_bytes = mine_elems * (g_ + 8.0);
      x.last_d2h = add(x, d, {id != kNone ? id : produced, id != kNone ? kNone : sp_sum});
    }
  }

  void emit_batch_end(RankCtx& x) {
    const StagePlan& plan = *x.plan;
    uint32_t emb = kNone;
    if (x.emb_g >= 0) {  // DeepSpeed ReduceTiedGrads / Megatron's embedding group all-reduce
      Instruction in = make(Op::AllReduce, engine_.batch_end_stream, Purpose::EmbeddingSync);
      in.group = x.emb_g;
      // BF16_Optimizer: the tied weight's fp32 gradient (weight._hp_grad).
      in.bytes = double(m_.vocab) * m_.hidden / t_ * (engine_.bf16_optimizer ? 4 : g_);
      emb = add(x, in, {compute_tail(x)});
    }
    // The reductions of the buckets holding the tied embedding, as the backward would have emitted
    // them, after the sync; the optimizer step waits for them through last_reduce / last_d2h.
    for (const RankCtx::Postponed& r : x.postponed)
      emit_reduction(x, r.op, r.expert, r.bucket, r.elems, r.mine_elems, r.mb, r.chunk, r.layer, emb, r.st,
                     r.sp_sum);
    x.postponed.clear();
    if (onebit_) {
      // deepspeed/runtime/comm/nccl.py NcclBackend.compressed_allreduce on the flat momentum,
      // padded as deepspeed/runtime/fp16/onebit/adam.py pads it (corrected_tensor_size: a multiple
      // of N * divider, divider = lcm(N, 8) = N * 8 / gcd(N, 8)): all-to-all of packed worker signs,
      // all-gather of worker scales, all-gather of packed server signs, all-gather of server scales.
      for (int pass = 0; pass < 2; ++pass) {
        const bool expert = pass == 1;
        if (expert && !plan.has_expert) continue;
        const int grp = expert ? x.edp_g : x.dp_g;
        const int n_ranks = expert ? x.edp_n : x.dp_n;
        if (grp < 0) continue;
        const double numel = double(expert ? plan.expert.numel : plan.dense.numel);
        const double unit = double(n_ranks) * (8.0 * n_ranks / std::gcd(n_ranks, 8));
        const double n = std::ceil(numel / unit) * unit;
        // Each phase with the local work before it (the decompression rides on the last one).
        const std::tuple<Op, Purpose, double, double> phases[] = {
            {Op::AllToAll, Purpose::OneBitSigns, n / 8, kOnebitWorkerBytesPerElement * n},
            {Op::AllGather, Purpose::OneBitScales, 4.0 * n_ranks, 0.0},
            {Op::AllGather, Purpose::OneBitServer, n / 8, kOnebitServerBytesPerElement * n},
            {Op::AllGather, Purpose::OneBitScales, 4.0 * n_ranks, kOnebitDecompressBytesPerElement * n},
        };
        for (const auto& [op, pu, bytes, local] : phases) {
          Instruction in = make(op, Stream::DpComm, pu);
          in.group = grp;
          in.bytes = bytes;
          in.memory_bytes = local;
          x.last_reduce = add(x, in, {compute_tail(x)});
        }
      }
    }
    const double shard = zero_ == 0 ? double(plan.dense.numel + (plan.has_expert ? plan.expert.numel : 0))
                       : zero_ == 3 ? double(s3_shard(plan.dense) + (plan.has_expert ? s3_shard(plan.expert) : 0))
                                    : double(plan.dense.shard_numel + (plan.has_expert ? plan.expert.shard_numel : 0));
    uint32_t updated = kNone;
    if (sc_.zero.offload_optimizer) {
      Instruction h = make(Op::HostOptimizerStep, Stream::Host, Purpose::None);  // fp32 gradients on the host
      h.flops = shard * kAdamFlopsPerParam;
      h.memory_bytes = shard * host_step_bytes_per_param(g_, step_takes_norm());
      // ZeRO-Infinity: the fp32 master, momentum and variance swapped in from NVMe and back out
      // (12 bytes each way, Lion 8), and with parameters on NVMe the updated 16-bit shard written.
      const double states = sc_.optimizer.kind == OptimizerKind::lion ? 8.0 : 12.0;
      if (sc_.zero.on_nvme_optimizer(sc_.cluster.nvme_bandwidth)) h.bytes += shard * 2 * states;
      if (sc_.zero.on_nvme_param(sc_.cluster.nvme_bandwidth)) h.bytes += shard * g_;
      const uint32_t step = add(x, h, {x.last_d2h, x.last_reduce, emb, compute_tail(x)});
      Instruction up = make(Op::CopyH2D, Stream::Offload, Purpose::OffloadParam);
      up.bytes = shard * g_;
      updated = add(x, up, {step});
    } else if (engine_.bf16_optimizer) {
      // DeepSpeed's BF16_Optimizer (core/pipeline_engine.hpp): norm (and clip) over the whole fp32
      // buffer, Adam on this rank's 1/dp partition, its copy to bf16, the buffer cleared; then the
      // bf16 partitions all-gathered over DP, blocking, in allgather_bucket_size pieces.
      double partition = 0;
      struct Gathers { int group, n; std::vector<int64_t> pieces; };  // elements per rank per call
      std::vector<Gathers> gathers;
      for (int pass = 0; pass < 2; ++pass) {
        const bool expert = pass == 1;
        if (expert && !plan.has_expert) continue;
        const int64_t numel = (expert ? plan.expert : plan.dense).numel;
        const int n = expert ? x.edp_n : x.dp_n;
        partition += double(bf16_partition_numel(numel, n));
        const int grp = expert ? x.edp_g : x.dp_g;
        if (grp >= 0) gathers.push_back({grp, n, bf16_allgather_pieces(numel, n, sc_.zero.allgather_bucket_size)});
      }
      Instruction o = make(Op::OptimizerStep, Stream::Compute, Purpose::None);
      o.flops = partition * kAdamFlopsPerParam + shard;  // the norm: one multiply-add per element
      o.memory_bytes = bf16_optimizer_step_bytes(shard, partition, sc_.training.gradient_clipping > 0);
      updated = add(x, o, {x.last_reduce, emb});
      for (const Gathers& ga : gathers)
        for (size_t k = 0; k < ga.pieces.size(); ++k) {
          Instruction in = make(Op::AllGather, engine_.batch_end_stream, Purpose::ParamGather);
          in.group = ga.group;
          in.bucket = int(k);
          in.bytes = double(ga.pieces[k]) * ga.n * g_;
          add(x, in, {updated});
        }
    } else {
      Instruction o = make(Op::OptimizerStep, Stream::Compute, Purpose::None);
      o.flops = shard * kAdamFlopsPerParam;
      // Stages 0-2 and DeepSpeed's stage 3 read the g-byte gradients in place unless an fp32
      // accumulator is kept (stage 3 with zero.grad_accum_dtype fp32, FSDP: folded in backward,
      // op_list; stages 0/1 with 1-bit Adam or MoE: folded at the step).
      DeviceStep step;
      step.g = g_, step.zero_stage = zero_, step.fused = sc_.optimizer.fused_step, step.onebit = onebit_;
      step.in_place = step.fused && (zero_ == 2 || sc_.zero.model_dtype_grad_partition() ||
                                     steps_gradient_buckets_in_place(sc_));
      step.norm = step_takes_norm();
      o.memory_bytes = shard * device_step_bytes_per_param(step);
      updated = add(x, o, {x.last_reduce, emb});
    }
    if (zero_ == 1 || zero_ == 2) {  // all-gather the updated 16-bit shards
      for (int pass = 0; pass < 2; ++pass) {
        const bool expert = pass == 1;
        if (expert && !plan.has_expert) continue;
        const int grp = expert ? x.edp_g : x.dp_g;
        if (grp < 0) continue;
        const ZeroPartition& z = expert ? plan.expert : plan.dense;
        for (size_t k = 0; k < z.allgather_buckets.size(); ++k) {
          Instruction in = make(Op::AllGather, Stream::DpComm, Purpose::ParamGather);
          in.group = grp;
          in.bucket = int(k);
          in.bytes = double(z.allgather_buckets[k].count_per_rank) * z.dp * g_;
          add(x, in, {updated});
        }
      }
    }
  }

  // A stage-3 all-gather's output bytes for `shard` elements from each of `n` ranks: 16-bit, or
  // with qwZ int8 plus one fp32 scale per block of at most kQwzBlock elements of each rank's shard
  // (DeepSpeed's CUDAQuantizer: target_group_size 8000, symmetric 8-bit).
  double s3_gather_bytes(int64_t shard, int n) const {
    if (!qwz_) return double(shard) * n * g_;
    return (double(shard) + 4.0 * double((shard + kQwzBlock - 1) / kQwzBlock)) * n;
  }

  static int64_t s3_shard(const ZeroPartition& z) {  // what the optimizer steps: trainable elements
    int64_t n = 0;
    for (const auto& g : z.stage3_groups) n += g.trainable_shard_numel;
    return n;
  }

  const Scenario& sc_;
  BuildOptions opts_;
  ProcessGrid grid_;
  const ModelSpec& m_;
  int p_ = 1, v_ = 1, t_ = 1, M_ = 1, b_ = 1, g_ = 2, zero_ = 0;
  int cg_ = 2;                       // bytes per element of the DP gradient reduction (communication_data_type)
  int hpz_ = 1, qgz_local_ = 1;      // ZeRO++: secondary partition size; DP ranks per node for qgZ
  bool qwz_ = false, qgz_ = false;
  static constexpr int64_t kQwzBlock = 8000;
  std::map<std::pair<int, std::vector<int>>, int> sub_groups_;
  bool onebit_ = false;
  double act_bytes_ = 0, p2p_act_bytes_ = 0, p2p_grad_bytes_ = 0, a2a_bytes_ = 0, moe_buffer_bytes_ = 0;
  PipelineEngineModel engine_;
  std::shared_ptr<const std::vector<StagePlan>> plans_;  // [stage] (plan_stages)
  std::vector<const std::vector<Action>*> stage_actions_;  // [stage] into schedule()
  std::vector<std::vector<int>> group_ids_;
  std::shared_ptr<const std::vector<std::vector<Action>>> schedule_;
  std::vector<int8_t> single_member_;  // [group] one materialized member: 1, not: 0, not known: -1
  ChainIndex chain_index_;  // collapse_chains: chains by cost hash
};

}  // namespace

Program build_program(const Scenario& sc, const BuildOptions& opts) {
  if (sc.parallel.world() < 1) throw std::invalid_argument("build_program: empty world");
  Builder b(sc, opts);
  return b.build();
}

}  // namespace dssim

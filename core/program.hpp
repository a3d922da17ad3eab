// The Program: for every rank, an ordered stream of instructions. The core emits it once; the
// simulator and the torch backend both interpret it (DESIGN.md, "One idea").
//
// Execution semantics, shared by every interpreter:
//  - each instruction runs on one of the rank's streams; a stream runs its instructions in order;
//  - an instruction may also wait for instructions on other streams of the same rank (`deps`);
//  - a collective starts when every member of its group has reached it (NCCL semantics);
//    a Recv completes when the matching Send (same tag, peer pair) has been transferred;
//  - `repeat` > 1 means the instruction is executed that many times back to back on its stream
//    (e.g. the 2 all-reduces per layer of Megatron TP, over the layers of a chunk): a compact
//    encoding of runs that no other stream can interleave with.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>
#include "core/model.hpp"

namespace dssim {

enum class Op : uint8_t {
  // compute
  Forward, Backward, Recompute, OptimizerStep, HostOptimizerStep,
  // collectives over a group
  AllReduce, ReduceScatter, AllGather, AllToAll,
  // point to point
  Send, Recv,
  // host <-> device over PCIe
  CopyH2D, CopyD2H,
};
const char* to_string(Op);
// 1-bit Adam's local work around its collectives, HBM bytes per element of the padded momentum
// (backends/torch/onebit_adam.cpp as it runs; the device profile's onebit_worker / onebit_server
// / onebit_decompress rows are bytes/s over these): the worker's compensate, scale, sign, error
// and packing before its all-to-all; the server's unpacking of every rank's signs, weighted sum
// and its own compression before its all-gather; the decompression after the last all-gather.
constexpr double kOnebitWorkerBytesPerElement = 84, kOnebitServerBytesPerElement = 40,
                 kOnebitDecompressBytesPerElement = 40;
inline bool is_compute(Op op) { return op <= Op::HostOptimizerStep; }
inline bool is_collective(Op op) { return op >= Op::AllReduce && op <= Op::AllToAll; }

// Streams as real engines have them: Megatron TP and MoE all-to-all are blocking on the compute
// stream; ZeRO gradient reduction / parameter gathering runs on its own stream (overlap_comm);
// pipeline send/recv on another; offload copies on the copy engine; the CPU optimizer on the host.
enum class Stream : uint8_t { Compute = 0, DpComm = 1, PpComm = 2, Offload = 3, Host = 4 };
constexpr int kStreams = 5;
const char* to_string(Stream);

// Why the instruction exists: what the report attributes its time to.
enum class Purpose : uint8_t {
  None,
  TensorParallel,        // Megatron f/g all-reduce (or SP all-gather / reduce-scatter)
  PipelineActivation,    // send/recv of activations (forward)
  PipelineGradient,      // send/recv of activation gradients (backward)
  GradientReduce,        // DP gradient all-reduce / ZeRO reduce-scatter
  ParamGather,           // ZeRO all-gather of (updated or stage-3 sharded) parameters
  EmbeddingSync,         // tied embedding gradient all-reduce between first and last stage
  MoEDispatch, MoECombine,
  OneBitSigns,           // 1-bit Adam: all-to-all of packed worker signs
  OneBitScales,          // 1-bit Adam: all-gather of scales
  OneBitServer,          // 1-bit Adam: all-gather of server signs
  OffloadGradient,       // D2H of gradients to the host optimizer
  OffloadParam,          // H2D of parameters (updated, or stage-3 offload_param fetch)
  OffloadActivation,     // cpu_checkpointing: checkpointed layer inputs to the host and back
};
const char* to_string(Purpose);

// DPIntra / DPInter: ZeRO++ sub-groups of a DP group (core/program_builder.cpp): the DP ranks of one
// node (hpZ's secondary partition, qgZ's intra-node all-to-all) and the ranks at the same place
// in every node (qgZ's inter-node all-to-all). Only the builder makes them (not ProcessGrid).
enum class GroupKind : uint8_t { TP, PP, DP, EP, ExpertDP, Embedding, World, DPIntra, DPInter };
const char* to_string(GroupKind);

struct Group {
  GroupKind kind;
  std::vector<int> ranks;  // global ranks, in ring order
};

struct Instruction {
  Op op;
  Stream stream = Stream::Compute;
  Purpose purpose = Purpose::None;
  // (The padding made a member: zero, so that equal instructions are equal byte for byte, which
  // evaluate_program_reusing compares.)
  uint8_t reserved = 0;
  int32_t micro_batch = -1;  // -1: not tied to a micro-batch (optimizer, final reduction)
  int32_t chunk = -1;        // model chunk (virtual pipeline stage) on this rank
  int32_t layer_begin = -1;  // global index of the first layer the instruction covers
  int32_t layer_count = 0;
  int32_t group = -1;        // index into Program::groups for collectives
  int32_t peer = -1;         // global rank for Send/Recv
  int32_t tag = -1;          // matches a Send with its Recv
  int32_t bucket = -1;       // ZeRO bucket index
  int32_t repeat = 1;
  // Cost, per repetition. `bytes` is the collective's buffer size as nccl-tests counts "size":
  // all-reduce: the buffer; reduce-scatter: the input (N shards); all-gather: the output;
  // all-to-all: the whole send buffer; send/recv/copy: the message.
  double flops = 0;
  double bytes = 0;
  double memory_bytes = 0;   // HBM traffic of a compute instruction (roofline); of a collective:
                             // the local work it does before sending (1-bit Adam's compression)
  double gemm_flops = 0;     // part of `flops` done in GEMMs (the rest: attention, elementwise)
  int32_t ops = -1;          // compute: index into Program::op_lists, the kernels this instruction runs
  uint32_t deps_begin = 0;   // into RankProgram::deps
  uint32_t deps_count = 0;
  // A collapsed chain (BuildOptions::collapse_chains): index into Program::chains; this
  // instruction stands for the chain's members, run back to back, and its own cost fields are
  // the first member's. Chains that cost the same share one entry (its members' micro-batch is
  // the first such chain's). -1: an ordinary instruction.
  int32_t chain = -1;
};

// Consecutive members of one collapsed chain in Program::chain_members.
struct Chain {
  uint32_t begin = 0, count = 0;
};

// Program::op_lists: a vector of kernel lists, shared between the Programs that a builder's
// StagePlanCache serves (copy on write: a Program that adds a list to shared ones copies them first).
class OpLists {
 public:
  using List = std::vector<LayerOp>;
  OpLists() = default;
  OpLists(std::initializer_list<List> lists) : p_(std::make_shared<std::vector<List>>(lists)) {}
  OpLists& operator=(std::initializer_list<List> lists) {
    p_ = std::make_shared<std::vector<List>>(lists);
    return *this;
  }
  size_t size() const { return p_ ? p_->size() : 0; }
  bool empty() const { return size() == 0; }
  const List& operator[](size_t i) const { return (*p_)[i]; }
  const List& at(size_t i) const {
    if (!p_) throw std::out_of_range("Program::op_lists: empty");
    return p_->at(i);
  }
  std::vector<List>::const_iterator begin() const { return p_ ? p_->cbegin() : std::vector<List>::const_iterator{}; }
  std::vector<List>::const_iterator end() const { return p_ ? p_->cend() : std::vector<List>::const_iterator{}; }
  void push_back(List list) { own().push_back(std::move(list)); }
  // The lists themselves, to share with another Program (share).
  std::shared_ptr<std::vector<List>> shared() const { return p_; }
  void share(std::shared_ptr<std::vector<List>> lists) { p_ = std::move(lists); }

 private:
  std::vector<List>& own() {
    if (!p_) p_ = std::make_shared<std::vector<List>>();
    else if (p_.use_count() > 1) p_ = std::make_shared<std::vector<List>>(*p_);
    return *p_;
  }
  std::shared_ptr<std::vector<List>> p_;
};

struct RankProgram {
  int rank = 0;
  std::vector<Instruction> instructions;
  std::vector<uint32_t> deps;  // indices into `instructions`, sliced by Instruction::deps_*

  // Appends and returns the new instruction's index; `waits_for` are cross-stream dependencies.
  // (By reference: the instruction is copied once, into `instructions`. Inline: a planner's
  // builder appends tens of millions of instructions a search.)
  uint32_t add(const Instruction& inst, std::initializer_list<uint32_t> waits_for = {}) {
    return add(inst, waits_for.begin(), waits_for.size());
  }
  uint32_t add(const Instruction& inst, const std::vector<uint32_t>& waits_for) {
    return add(inst, waits_for.data(), waits_for.size());
  }
  uint32_t add(const Instruction& inst, const uint32_t* waits_for, size_t n) {
    instructions.push_back(inst);
    Instruction& in = instructions.back();
    in.deps_begin = static_cast<uint32_t>(deps.size());
    in.deps_count = static_cast<uint32_t>(n);
    for (size_t k = 0; k < n; ++k) deps.push_back(waits_for[k]);
    return static_cast<uint32_t>(instructions.size() - 1);
  }
};

struct Program {
  int world = 0;
  std::vector<Group> groups;
  std::vector<RankProgram> ranks;  // ranks[i].rank == i when the full world is built
  // Kernel lists of compute instructions (shared: every forward of a dense stage chunk points at
  // the same list), so device models can apply per-shape efficiency.
  OpLists op_lists;
  // True when only one representative rank per pipeline stage was materialized (BuildOptions):
  // the other ranks behave identically when nothing contends, so closed-form interpreters need
  // only these.
  bool representative_only = false;
  // BuildOptions::collapse_chains: the members of every collapsed chain, in run order.
  std::vector<Chain> chains;
  std::vector<Instruction> chain_members;
};

// Bytes one rank puts on the wire for a collective of `size_bytes` over `n` ranks, as NCCL's ring
// algorithms move them (nccl-tests' bus-bandwidth factors).
double wire_bytes_per_rank(Op op, double size_bytes, int n);

}  // namespace dssim

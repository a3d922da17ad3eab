// Megatron-LM tensor parallelism (Shoeybi et al. 2019; sequence parallelism: Korthikanti et al.
// 2022) as autograd functions over the TP group's communicator:
//
//   f  copy_to_tp       identity forward, all-reduce of the gradient in backward (before a
//                       column-parallel linear);
//   g  reduce_from_tp   all-reduce forward, identity backward (after a row-parallel linear);
//   with sequence parallelism, f becomes gather_from_sp (all-gather along the sequence; backward
//   reduce-scatter) and g becomes scatter_to_sp (reduce-scatter along the sequence; backward
//   all-gather);
//   DeepSpeed-MoE's token drop / gather (deepspeed/moe/mappings.py _DropTokens, _GatherTokens; used
//   by deepspeed/moe/sharded_moe.py MOELayer.forward with dim=1 of the [experts, capacity, h]
//   buffers): drop_tokens keeps this rank's 1/t of dimension 1, no communication, all-gather of the
//   gradient in backward; gather_tokens all-gathers dimension 1, backward keeps this rank's part of
//   the gradient. Dimension 1 is split as the sequence is (rank r: [r n/t, (r+1) n/t)), so these
//   are the sequence split / all-gather of a [b, n, h] tensor;
//   the vocabulary-parallel embedding (each rank looks up its vocabulary slice, the partial sums
//   are reduced) and the vocabulary-parallel cross-entropy (max, predicted logit and sum of
//   exponentials all-reduced over the group; no communication in backward).
//
// Activations are [batch, sequence, hidden]; sequence shards are contiguous runs of positions,
// rank r holding [r s/t, (r+1) s/t). Every collective is counted by the communicator and recorded
// in the context's ledger as (op, bytes), which the engine matches against the TP instructions of
// the Program (same op, same bytes, `repeat` counted).
#pragma once
#include <functional>
#include <map>
#include <utility>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/comm.hpp"

namespace dssim::tb {

struct TensorParallel {
  Communicator* comm = nullptr;  // the TP group (nullptr when size == 1)
  int size = 1, rank = 0;
  bool sequence_parallel = false;
  // Communication dtype of activations (the run's 16-bit or fp32 dtype). On CPUs fp16 is computed
  // in fp32: activations are cast to it for the wire so that the bytes are the Program's.
  at::ScalarType wire_dtype = at::kFloat;
  // What was issued since the engine last looked, and what the Program lists for the same span:
  // (op, size bytes). The engine expect()s the TP instructions that follow a compute instruction and
  // check()s at the next one that the two are the same multiset (a mismatch throws, naming `where`).
  std::vector<std::pair<Op, double>> ledger, expected;
  // MoE without token dropping: the capacity, hence the bytes of its all-gathers, is known at run
  // time only; the all-gathers are then matched by count.
  bool all_gather_bytes_dynamic = false;
  void expect(Op op, double bytes, int repeat);
  void check(const std::string& where);
  // Seconds spent in TP collectives (issue + completion), by op, while `timing`; `sync` waits for
  // the device before and after each, so that the time is the collective's.
  bool timing = false;
  std::function<void()> sync;
  std::map<Op, double> seconds;

  bool active() const { return size > 1; }
  // The collectives, with ledger, timing and dtype handling; used by the autograd functions.
  at::Tensor all_reduce(const at::Tensor& x);      // an activation, in wire_dtype
  at::Tensor all_reduce_fp32(const at::Tensor& x, bool max = false);  // the cross-entropy's sums / max
  at::Tensor all_gather_seq(const at::Tensor& x);   // [b, s/t, h] -> [b, s, h]
  at::Tensor reduce_scatter_seq(const at::Tensor& x);  // [b, s, h] -> [b, s/t, h]
  at::Tensor split_seq(const at::Tensor& x);        // [b, s, h] -> this rank's [b, s/t, h], no communication
};

at::Tensor copy_to_tp(TensorParallel& tp, const at::Tensor& x);
at::Tensor reduce_from_tp(TensorParallel& tp, const at::Tensor& x);
at::Tensor gather_from_sp(TensorParallel& tp, const at::Tensor& x);
at::Tensor scatter_to_sp(TensorParallel& tp, const at::Tensor& x);

at::Tensor drop_tokens(TensorParallel& tp, const at::Tensor& x);    // [b, n, h] -> [b, n/t, h]
at::Tensor gather_tokens(TensorParallel& tp, const at::Tensor& x);  // [b, n/t, h] -> [b, n, h]

// Before a column-parallel linear: f, or the sequence all-gather; after a row-parallel one: g, or
// the sequence reduce-scatter.
at::Tensor enter_tp_region(TensorParallel& tp, const at::Tensor& x);
at::Tensor leave_tp_region(TensorParallel& tp, const at::Tensor& x);

// Partial embedding of `tokens` by this rank's rows [vocab_begin, vocab_begin + rows) of the word
// embedding: zero for tokens outside the slice.
at::Tensor vocab_parallel_lookup(const at::Tensor& wte_local, const at::Tensor& tokens, int64_t vocab_begin);
// Mean over tokens of the cross-entropy of fp32 logits split over the vocabulary, [N, V/t] on
// this rank (columns vocab_begin ..), targets [N] global ids.
at::Tensor vocab_parallel_cross_entropy(TensorParallel& tp, const at::Tensor& logits_local,
                                        const at::Tensor& targets, int64_t vocab_begin);

}  // namespace dssim::tb

#include "backends/torch/tensor_parallel.hpp"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dssim::tb {

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

double size_bytes(const at::Tensor& t) { return double(t.numel()) * double(t.element_size()); }

// The context travels through autograd as an integer (saved_data holds IValues).
TensorParallel& context(AutogradContext* ctx) {
  return *reinterpret_cast<TensorParallel*>(intptr_t(ctx->saved_data["tp"].toInt()));
}

template <class F>
at::Tensor timed(TensorParallel& tp, Op op, F&& f) {
  if (!tp.timing) return f();
  if (tp.sync) tp.sync();
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor out = f();
  if (tp.sync) tp.sync();
  tp.seconds[op] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

// [b, s, h] <-> the sequence-major contiguous layout the collectives split: [s, b, h].
at::Tensor seq_major(const at::Tensor& x) { return x.transpose(0, 1).contiguous(); }
at::Tensor batch_major(const at::Tensor& x) { return x.transpose(0, 1).contiguous(); }
}  // namespace

void TensorParallel::expect(Op op, double bytes, int repeat) {
  if (!active()) throw std::runtime_error("Program error: a tensor-parallel collective with tp = 1");
  for (int r = 0; r < std::max(1, repeat); ++r) expected.push_back({op, bytes});
}

void TensorParallel::check(const std::string& where) {
  if (expected.empty() && ledger.empty()) return;
  std::map<std::pair<int, long long>, int> diff;
  const auto key = [&](Op op, double b) {
    return std::make_pair(int(op), all_gather_bytes_dynamic && op == Op::AllGather ? 0 : std::llround(b));
  };
  for (const auto& [op, b] : ledger) diff[key(op, b)] += 1;
  for (const auto& [op, b] : expected) diff[key(op, b)] -= 1;
  for (const auto& [k, n] : diff)
    if (n != 0)
      throw std::runtime_error("Program/engine mismatch: the engine issued " + std::to_string(std::abs(n)) + " " +
                               (n > 0 ? "more" : "fewer") + " tensor-parallel " + to_string(Op(k.first)) + " of " +
                               std::to_string(k.second) + " bytes than the Program lists (" + where + ")");
  ledger.clear();
  expected.clear();
}

at::Tensor TensorParallel::all_reduce(const at::Tensor& x) {
  return timed(*this, Op::AllReduce, [&] {
    at::Tensor buf = x.to(wire_dtype).contiguous();
    if (buf.data_ptr() == x.data_ptr()) buf = buf.clone();
    ledger.push_back({Op::AllReduce, size_bytes(buf)});
    comm->allreduce(buf, Purpose::TensorParallel)->wait();
    return buf.to(x.scalar_type());
  });
}

at::Tensor TensorParallel::all_reduce_fp32(const at::Tensor& x, bool max) {
  return timed(*this, Op::AllReduce, [&] {
    at::Tensor buf = x.to(at::kFloat).contiguous().clone();
    ledger.push_back({Op::AllReduce, size_bytes(buf)});
    (max ? comm->allreduce_max(buf, Purpose::TensorParallel) : comm->allreduce(buf, Purpose::TensorParallel))->wait();
    return buf;
  });
}

at::Tensor TensorParallel::all_gather_seq(const at::Tensor& x) {
  return timed(*this, Op::AllGather, [&] {
    at::Tensor in = seq_major(x.to(wire_dtype));
    auto sizes = in.sizes().vec();
    sizes[0] *= size;
    at::Tensor out = at::empty(sizes, in.options());
    ledger.push_back({Op::AllGather, size_bytes(out)});
    comm->all_gather(out, in, Purpose::TensorParallel)->wait();
    return batch_major(out).to(x.scalar_type());
  });
}

at::Tensor TensorParallel::reduce_scatter_seq(const at::Tensor& x) {
  TORCH_CHECK(x.size(1) % size == 0, "sequence parallelism: seq_len must be divisible by tp");
  return timed(*this, Op::ReduceScatter, [&] {
    at::Tensor in = seq_major(x.to(wire_dtype));
    auto sizes = in.sizes().vec();
    sizes[0] /= size;
    at::Tensor out = at::empty(sizes, in.options());
    ledger.push_back({Op::ReduceScatter, size_bytes(in)});
    comm->reduce_scatter(out, in, Purpose::TensorParallel)->wait();
    return batch_major(out).to(x.scalar_type());
  });
}

at::Tensor TensorParallel::split_seq(const at::Tensor& x) {
  TORCH_CHECK(x.size(1) % size == 0, "tensor parallelism: dimension 1 (", x.size(1), ") is not divisible by tp (", size,
              ")");
  const int64_t n = x.size(1) / size;
  return x.narrow(1, n * rank, n).contiguous();
}

namespace {
// One autograd function per (forward, backward) pair of the TP region's collectives; nullptr is
// the identity (f: identity / all-reduce, g: all-reduce / identity, and the sequence-parallel pair).
using Collective = at::Tensor (TensorParallel::*)(const at::Tensor&);
template <Collective Forward, Collective Backward>
struct TpRegion : torch::autograd::Function<TpRegion<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    if constexpr (Forward != nullptr) return (context(ctx).*Forward)(x);
    else return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if constexpr (Backward != nullptr) return {(context(ctx).*Backward)(g[0]), at::Tensor()};
    else return {g[0], at::Tensor()};
  }
};
using CopyToTp = TpRegion<nullptr, &TensorParallel::all_reduce>;
using ReduceFromTp = TpRegion<&TensorParallel::all_reduce, nullptr>;
using GatherFromSp = TpRegion<&TensorParallel::all_gather_seq, &TensorParallel::reduce_scatter_seq>;
using ScatterToSp = TpRegion<&TensorParallel::reduce_scatter_seq, &TensorParallel::all_gather_seq>;
using DropTokens = TpRegion<&TensorParallel::split_seq, &TensorParallel::all_gather_seq>;
using GatherTokens = TpRegion<&TensorParallel::all_gather_seq, &TensorParallel::split_seq>;
int64_t handle(TensorParallel& tp) { return int64_t(reinterpret_cast<intptr_t>(&tp)); }
}  // namespace

at::Tensor copy_to_tp(TensorParallel& tp, const at::Tensor& x) {
  return tp.active() ? CopyToTp::apply(x, handle(tp)) : x;
}
at::Tensor reduce_from_tp(TensorParallel& tp, const at::Tensor& x) {
  return tp.active() ? ReduceFromTp::apply(x, handle(tp)) : x;
}
at::Tensor gather_from_sp(TensorParallel& tp, const at::Tensor& x) {
  return tp.active() ? GatherFromSp::apply(x, handle(tp)) : x;
}
at::Tensor scatter_to_sp(TensorParallel& tp, const at::Tensor& x) {
  return tp.active() ? ScatterToSp::apply(x, handle(tp)) : x;
}
at::Tensor drop_tokens(TensorParallel& tp, const at::Tensor& x) {
  return tp.active() ? DropTokens::apply(x, handle(tp)) : x;
}
at::Tensor gather_tokens(TensorParallel& tp, const at::Tensor& x) {
  return tp.active() ? GatherTokens::apply(x, handle(tp)) : x;
}
at::Tensor enter_tp_region(TensorParallel& tp, const at::Tensor& x) {
  return tp.sequence_parallel ? gather_from_sp(tp, x) : copy_to_tp(tp, x);
}
at::Tensor leave_tp_region(TensorParallel& tp, const at::Tensor& x) {
  return tp.sequence_parallel ? scatter_to_sp(tp, x) : reduce_from_tp(tp, x);
}

at::Tensor vocab_parallel_lookup(const at::Tensor& wte_local, const at::Tensor& tokens, int64_t vocab_begin) {
  const int64_t rows = wte_local.size(0);
  auto in_range = (tokens >= vocab_begin).logical_and(tokens < vocab_begin + rows);
  auto local = (tokens - vocab_begin).masked_fill(in_range.logical_not(), 0);
  return at::embedding(wte_local, local) * in_range.unsqueeze(-1).to(wte_local.scalar_type());
}

namespace {
// Megatron's _VocabParallelCrossEntropy: per-token losses; backward softmax - one-hot, locally.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_begin, int64_t tp_handle) {
    ctx->saved_data["tp"] = tp_handle;
    TensorParallel& tp = context(ctx);
    const int64_t cols = logits.size(1);
    auto max = tp.all_reduce_fp32(std::get<0>(logits.max(1)), true);
    auto z = logits - max.unsqueeze(1);
    auto in_range = (targets >= vocab_begin).logical_and(targets < vocab_begin + cols);
    auto local = (targets - vocab_begin).masked_fill(in_range.logical_not(), 0);
    auto predicted = z.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(in_range.logical_not(), 0.0);
    predicted = tp.all_reduce_fp32(predicted);
    auto exp = z.exp();
    auto sum_exp = tp.all_reduce_fp32(exp.sum(1));
    auto softmax = exp.div_(sum_exp.unsqueeze(1));
    ctx->save_for_backward({softmax, local, in_range});
    return sum_exp.log() - predicted;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    auto onehot = at::zeros_like(grad).scatter_(1, saved[1].unsqueeze(1), saved[2].unsqueeze(1).to(grad.scalar_type()));
    grad.sub_(onehot).mul_(g[0].unsqueeze(1));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor vocab_parallel_cross_entropy(TensorParallel& tp, const at::Tensor& logits_local,
                                        const at::Tensor& targets, int64_t vocab_begin) {
  return VocabParallelCrossEntropy::apply(logits_local, targets, vocab_begin, handle(tp)).mean();
}

}  // namespace dssim::tb

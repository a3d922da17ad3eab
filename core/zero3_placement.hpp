// ZeRO-3 as the engines run it: how many parameter all-gathers a layer costs, and how far ahead
// they are issued. Both engines gather the same bytes; they differ in granularity, which at many
// ranks decides the time (every all-gather pays NCCL's ring latency, proportional to the rank
// count: core/collective_model.hpp).
//
// DeepSpeed (deepspeed/runtime/zero/partitioned_param_coordinator.py, fetch_sub_module): the
// forward / backward pre-hook of every submodule fetches that submodule's own parameters
// (parameters(recurse=False)): a transformer layer is several fetches (QKV, attention output,
// MLP up (+ gate), MLP down). Parameters of at most stage3_param_persistence_threshold elements
// (norms, biases) are never partitioned and never gathered. Each fetch issues one coalesced
// all-gather for the parameters not yet in flight and prefetches the next submodules' in trace
// order while fewer than stage3_prefetch_bucket_size elements are in flight (at least one
// parameter): so, in steady state, one all-gather per step of at least prefetch_bucket_size
// elements or one submodule, whichever is larger. Backward re-gathers (the forward released
// them), and so does an activation-checkpointing recompute, which runs inside backward with the
// same parameters live.
//
// Gradients (deepspeed/runtime/zero/stage3.py, reduce_independent_p_g_buckets_and_remove_grads,
// the same rule from v0.6 to today): each parameter's gradient joins the reduction bucket as its
// hook fires, in backward order; a bucket holding anything is reduce-scattered first when the new
// gradient would take it past reduce_bucket_size elements (reduce_scatter_coalesced: one NCCL
// call per bucket). Every parameter is reduced, persistent ones included. So a matrix larger than
// the bucket is a call of its own, and so is the run of small tensors between two matrices: a
// 175B layer is 8 calls with the Azure recipe's 9e7 bucket, where one per layer would pay the
// ring latency once.
//
// FSDP (torch.distributed.fsdp, FULL_SHARD, one FSDP unit per transformer block as llm-foundry
// and torchtitan wrap it): one all-gather per block (its flat parameter), the next block's
// gather prefetched one block ahead (forward_prefetch / BACKWARD_PRE; FSDP2 does the same
// implicitly), and one reduce-scatter per block after its backward.
#pragma once
#include <cstdint>
#include <vector>
#include "core/scenario.hpp"

namespace dssim {

// All-gather calls one layer's parameters cost with `engine`: `tensors` are the layer's
// parameter sizes (elements, model order; a weight matrix starts a submodule, the small tensors
// after it are its bias / the next norm). At least 1 when anything is gathered.
int zero3_fetch_calls(const std::vector<int64_t>& tensors, const ZeroSpec& z);

// Gradient reduce-scatter calls per layer group. `groups` holds each group's parameter sizes in
// model order, groups in model order; gradients arrive from the last group's last tensor. A call
// counts to the group whose gradient triggers the flush (the final flush at the end of the
// backward to the first group); every group counts at least 1, so that its instruction carries its
// bytes (a group whose tensors all ride in a later group's call costs one call too many). FSDP: one
// reduce-scatter per wrapped block.
std::vector<int> zero3_reduce_calls(const std::vector<std::vector<int64_t>>& groups, const ZeroSpec& z);

// Host time of DeepSpeed's gradient reduce path (deepspeed/runtime/comm/coalesced_collectives.py
// reduce_scatter_coalesced, the same algorithm from v0.6 to today): for every tensor of a bucket
// one Python slice per data-parallel rank, the slices interleaved rank-major into a list (padding
// where a tensor does not divide N) and concatenated into one flat buffer before the single
// reduce-scatter. It runs inside the backward hooks, on the thread that launches the backward
// kernels, and stage3.py keeps at most two reduce events in flight (a blocking synchronize on the
// oldest), so the host cannot run ahead of the GPU by more than about two buckets: dssim prices it
// in series with the backward of the layers whose gradients are reduced. Measured:
// bench/zero3_host_overhead.py on the H200 machine's host (Intel Xeon, torch 2.11, CUDA tensors),
// 4.4 - 6.1 us per (tensor x rank) over N = 128 - 2048 and buckets of 1, 2 and 6 tensors: 5 us.
// That is a current stack; older PyTorch versions dispatch a slice more slowly (not measured here).
// FSDP reduce-scatters each block's flat gradient with no per-rank Python work: 0.
constexpr double kDeepSpeedReduceHostSecondsPerSlice = 5.0e-6;
double zero3_reduce_host_seconds(int64_t tensors, int ranks, const ZeroSpec& z);

// Prefetch: whether the gather of a segment of `next_elems` elements is issued while `in_flight`
// elements of later segments are already in flight, `ahead` segments ahead of the running one.
bool zero3_prefetch(const ZeroSpec& z, int ahead, int64_t in_flight, int64_t next_elems);

}  // namespace dssim

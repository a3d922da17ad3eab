// The pipeline engine as a choice (parallel.pipeline_engine; docs/simulator.md, "Pipeline engines").
//
// Both engines run the same forward/backward order for interleave = 1 (core/schedule.hpp: DeepSpeed's
// TrainSchedule, whose compute order is Megatron's non-interleaved 1F1B). What differs is how the
// Program places the rest, and this header is the one place that says so:
//
//  - megatron (Megatron-LM, megatron/core/pipeline_parallel/schedules.py + p2p_communication.py):
//    send/recv on their own stream (batched isend/irecv), overlapped with compute; scatter/gather
//    of pipeline messages over the TP group (parallel.scatter_gather); interleaving
//    (parallel.interleave); data-parallel gradient reduction overlapped with the last micro-batch's
//    backward (DDP buckets / ZeRO overlap_comm).
//  - deepspeed (DeepSpeed PipelineEngine, deepspeed/runtime/pipe/{engine,schedule,p2p}.py): the
//    TrainSchedule's instructions run one after another on the compute stream. SendActivation /
//    RecvActivation / SendGrad / RecvGrad are p2p.send / p2p.recv with async_op=False
//    (torch.distributed.send / recv since torch 1.8; before that a broadcast on a 2-rank group),
//    so the next instruction waits for the transfer: Stream::Compute. With tp > 1 the engine
//    partitions the message over the TP ("slice parallel") group by default
//    (pipeline.pipe_partitioned / grad_partitioned = true in runtime/config.py
//    get_pipeline_config; engine.py PartitionedTensor): 1/tp of the activation on the wire and an
//    all-gather after the receive. The engine turns DeepSpeedEngine's backward all-reduce off
//    (enable_backward_allreduce = False) and answers is_gradient_accumulation_boundary() only
//    inside ReduceGrads, so no data-parallel reduction overlaps the backward (ZeRO-1 included):
//    after the last step come ReduceTiedGrads (all-reduce of tied weights' gradients over their
//    group), ReduceGrads (the data-parallel all-reduce / ZeRO-1 reduce) and OptimizerStep, all
//    blocking. No interleaving, no ZeRO-2/3 (engine.py asserts stage < 2).
//  With pp = 1 there is no pipeline: both engines place everything as DeepSpeedEngine does.
//  Per-instruction host overheads (Python dispatch of each PipeInstruction) are not modelled: no
//  published measurement of them was found to take a constant from.
#pragma once
#include <functional>
#include <string>
#include <vector>
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct PipelineEngineModel {
  PipelineEngine engine = PipelineEngine::megatron;
  Stream p2p_stream = Stream::PpComm;  // where Send / Recv of pipeline messages run
  // TP partitioning of the pipeline messages (send 1/tp, all-gather after the receive), per direction.
  bool partition_activations = false;
  bool partition_gradients = false;
  // Data-parallel gradient reduction (and the tied-embedding sync) only after the whole schedule,
  // on `batch_end_stream`; false: overlapped with the last micro-batch's backward (overlap_comm).
  bool reduce_after_schedule = false;
  Stream batch_end_stream = Stream::DpComm;  // stream of the EmbeddingSync at the batch end
  // DeepSpeed's BF16_Optimizer runs the step (uses_bf16_optimizer below).
  bool bf16_optimizer = false;
};

// DeepSpeed's BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py, pipe/engine.py; read at v0.6.5,
// BLOOM's version line, and unchanged in these respects since) as the PipelineEngine runs it with
// bf16 at ZeRO stage 0 (engine.py _configure_optimizer: bf16 without ZeRO wraps the optimizer in
// it). Per parameter group it keeps the bf16 parameters flat (padded to a multiple of 2 dp
// elements), an fp32 gradient buffer of the whole flat group, and the fp32 master and the Adam
// moments of this rank's 1/dp partition only (ZeRO-1-like, at stage 0):
//  - after every micro-batch's backward, update_hp_grads folds each bf16 gradient into the fp32
//    buffer: hp_grad.add_(lp.grad.to(fp32)). The bf16 gradients were set to None before the
//    backward (clear_lp_grads), so PyTorch's AccumulateGrad keeps the fresh gradient without a copy;
//  - ReduceTiedGrads all-reduces the tied weights' fp32 gradients (weight._hp_grad) over their group,
//    ReduceGrads all-reduces the fp32 buffer over DP (_bf16_reduce_grads; its dtype is
//    precision.communication_dtype, as buffered_allreduce_fallback converts);
//  - step: the global norm over the fp32 gradients (always), clip_tensors_by_global_norm (rescales
//    them when clipping is on), the wrapped Adam on the fp32 partition, update_lp_params copies the
//    partition to its bf16 slice, all_gather_dp_groups all-gathers the bf16 partitions over DP in
//    pieces of allgather_bucket_size output elements, clear_hp_grads zeroes the fp32 buffer.
// Not at ZeRO 1: v0.6.5's PipelineEngine raises NotImplementedError for bf16 + ZeRO-1; later
// versions pick BF16_Optimizer there only with data_types.grad_accum_dtype fp32, which dssim does
// not read (ZeRO-1 keeps DeepSpeed's ZeRO optimizer model). One parameter group is modelled
// (Megatron-DeepSpeed has two: its no-weight-decay group, biases and norms, adds one small
// all-gather). The step's bytes are AdamW's: other optimizers keep dssim's default step model.
// With pp = 1 DeepSpeedEngine also uses it; dssim keeps its own engine's model there
// (docs/ARCHITECTURE.md, the measured runs).
bool uses_bf16_optimizer(const Scenario& sc);
// update_hp_grads per parameter and micro-batch: read the bf16 gradient (2), write and read its
// fp32 copy (4 + 4), read and write the fp32 buffer (4 + 4).
constexpr double kBf16FoldBytesPerParam = 18;
// HBM bytes of the step for `numel` parameters of which this rank steps `partition`: the norm reads
// the fp32 gradients (4) and, with clipping, the rescale reads and writes them (8); clear_hp_grads
// writes them (4); Adam reads parameter, gradient and moments and writes them back on the partition
// (28); update_lp_params reads the fp32 partition and writes its bf16 slice (6).
double bf16_optimizer_step_bytes(double numel, double partition, bool clipping);
// Elements of one rank's partition that all_gather_dp_groups gathers per call, in call order:
// max(1, partition dp / bucket) calls of the partition's share aligned down to 2, the last one
// taking the rest. `numel`: the flat group, padded here to 2 dp elements.
std::vector<int64_t> bf16_allgather_pieces(int64_t numel, int dp, int64_t allgather_bucket_size);
int64_t bf16_partition_numel(int64_t numel, int dp);

// The engine's placement rules for a scenario (tp, sequence parallelism and the engine's options).
PipelineEngineModel pipeline_engine_model(const Scenario& sc);

// "" when the scenario's parallel settings are ones the engine runs; otherwise the error, naming
// the key and the fix. `at` locates a key for the message (" at line 7"), may return "".
std::string pipeline_engine_error(const Scenario& sc,
                                  const std::function<std::string(const std::string&)>& at = {});


}  // namespace dssim

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
};

// The engine's placement rules for a scenario (tp, sequence parallelism and the engine's options).
PipelineEngineModel pipeline_engine_model(const Scenario& sc);

// "" when the scenario's parallel settings are ones the engine runs; otherwise the error, naming
// the key and the fix. `at` locates a key for the message (" at line 7"), may return "".
std::string pipeline_engine_error(const Scenario& sc,
                                  const std::function<std::string(const std::string&)>& at = {});


}  // namespace dssim

#include "core/pipeline_engine.hpp"

#include <algorithm>
#include <sstream>

namespace dssim {

const char* to_string(PipelineEngine e) {
  switch (e) {
    case PipelineEngine::megatron: return "megatron";
    case PipelineEngine::deepspeed: return "deepspeed";
  }
  return "?";
}

PipelineEngineModel pipeline_engine_model(const Scenario& sc) {
  PipelineEngineModel m;
  m.engine = sc.parallel.pipeline_engine;
  const bool tp = sc.parallel.tp > 1, sp = sc.parallel.sequence_parallel;
  // Without pipeline parallelism there is no pipeline engine to model (DeepSpeedEngine's own
  // backward reduction, the same as megatron's placement here).
  if (m.engine == PipelineEngine::megatron || sc.parallel.pp == 1) {
    m.p2p_stream = Stream::PpComm;
    m.partition_activations = m.partition_gradients = tp && sc.parallel.scatter_gather && !sp;
    m.reduce_after_schedule = false;
    m.batch_end_stream = Stream::DpComm;
  } else {
    m.p2p_stream = Stream::Compute;
    // With sequence parallelism the message is already the rank's 1/tp sequence shard.
    m.partition_activations = tp && sc.parallel.pipe_partitioned && !sp;
    m.partition_gradients = tp && sc.parallel.grad_partitioned && !sp;
    m.reduce_after_schedule = true;
    m.batch_end_stream = Stream::Compute;
  }
  m.bf16_optimizer = uses_bf16_optimizer(sc);
  return m;
}

bool uses_bf16_optimizer(const Scenario& sc) {
  return sc.parallel.pipeline_engine == PipelineEngine::deepspeed && sc.parallel.pp > 1 &&
         sc.precision.dtype == Dtype::bf16 && sc.zero.stage == 0 && !sc.zero.offload_optimizer &&
         sc.optimizer.kind == OptimizerKind::adamw;
}

double bf16_optimizer_step_bytes(double numel, double partition, bool clipping) {
  return numel * (4 + (clipping ? 8 : 0) + 4) + partition * (28 + 6);
}

int64_t bf16_partition_numel(int64_t numel, int dp) {
  const int64_t unit = 2 * int64_t(std::max(1, dp));
  return (numel + unit - 1) / unit * unit / std::max(1, dp);
}

std::vector<int64_t> bf16_allgather_pieces(int64_t numel, int dp, int64_t allgather_bucket_size) {
  dp = std::max(1, dp);
  const int64_t part = bf16_partition_numel(numel, dp);
  const int64_t shards = allgather_bucket_size > 0 ? std::max<int64_t>(1, part * dp / allgather_bucket_size) : 1;
  int64_t size = part / shards;
  size -= size % 2;
  std::vector<int64_t> out(shards, size);
  out.back() = part - (shards - 1) * size;
  return out;
}

std::string pipeline_engine_error(const Scenario& sc, const std::function<std::string(const std::string&)>& at) {
  const auto where = [&](const std::string& k) { return at ? at(k) : std::string(); };
  const ParallelSpec& p = sc.parallel;
  if (p.pipeline_engine != PipelineEngine::deepspeed) return {};
  std::ostringstream o;
  const std::string engine = "parallel.pipeline_engine is deepspeed" + where("parallel.pipeline_engine");
  if (p.interleave > 1) {
    o << "parallel.interleave (" << p.interleave << ")" << where("parallel.interleave") << " is Megatron-LM's interleaved "
      << "schedule, but " << engine << ": DeepSpeed's PipelineEngine runs one model chunk per stage (TrainSchedule). "
      << "Set parallel.interleave: 1, or parallel.pipeline_engine: megatron for a Megatron-LM run";
  } else if (p.scatter_gather) {
    o << "parallel.scatter_gather" << where("parallel.scatter_gather") << " is Megatron-LM's option, but " << engine
      << ": DeepSpeed's PipelineEngine partitions pipeline messages over the TP group through its own "
      << "pipeline.pipe_partitioned / grad_partitioned (parallel.pipe_partitioned / parallel.grad_partitioned, "
      << "default true). Remove parallel.scatter_gather, or set parallel.pipeline_engine: megatron";
  } else if (sc.zero.stage >= 2 && p.pp > 1) {
    o << "zero.stage " << sc.zero.stage << where("zero.stage") << " with " << engine
      << ": DeepSpeed's PipelineEngine asserts ZeRO stage < 2 (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
      << "parallelism\"). Use zero.stage 0 or 1, or parallel.pipeline_engine: megatron";
  }
  return o.str();
}

}  // namespace dssim

#include "core/program.hpp"

namespace dssim {

const char* to_string(Op op) {
  switch (op) {
    case Op::Forward: return "forward";
    case Op::Backward: return "backward";
    case Op::Recompute: return "recompute";
    case Op::OptimizerStep: return "optimizer_step";
    case Op::HostOptimizerStep: return "host_optimizer_step";
    case Op::AllReduce: return "all_reduce";
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::AllGather: return "all_gather";
    case Op::AllToAll: return "all_to_all";
    case Op::Send: return "send";
    case Op::Recv: return "recv";
    case Op::CopyH2D: return "copy_h2d";
    case Op::CopyD2H: return "copy_d2h";
  }
  return "?";
}


const char* to_string(Stream s) {
  switch (s) {
    case Stream::Compute: return "compute";
    case Stream::DpComm: return "dp_comm";
    case Stream::PpComm: return "pp_comm";
    case Stream::Offload: return "offload";
    case Stream::Host: return "host";
  }
  return "?";
}

const char* to_string(Purpose p) {
  switch (p) {
    case Purpose::None: return "none";
    case Purpose::TensorParallel: return "tensor_parallel";
    case Purpose::PipelineActivation: return "pipeline_activation";
    case Purpose::PipelineGradient: return "pipeline_gradient";
    case Purpose::GradientReduce: return "gradient_reduce";
    case Purpose::ParamGather: return "param_gather";
    case Purpose::EmbeddingSync: return "embedding_sync";
    case Purpose::MoEDispatch: return "moe_dispatch";
    case Purpose::MoECombine: return "moe_combine";
    case Purpose::OneBitSigns: return "onebit_signs";
    case Purpose::OneBitScales: return "onebit_scales";
    case Purpose::OneBitServer: return "onebit_server";
    case Purpose::OffloadGradient: return "offload_gradient";
    case Purpose::OffloadActivation: return "offload_activation";
    case Purpose::OffloadParam: return "offload_param";
  }
  return "?";
}

const char* to_string(GroupKind k) {
  switch (k) {
    case GroupKind::TP: return "tp";
    case GroupKind::PP: return "pp";
    case GroupKind::DP: return "dp";
    case GroupKind::EP: return "ep";
    case GroupKind::ExpertDP: return "expert_dp";
    case GroupKind::Embedding: return "embedding";
    case GroupKind::World: return "world";
    case GroupKind::DPIntra: return "dp_intra";
    case GroupKind::DPInter: return "dp_inter";
  }
  return "?";
}

double wire_bytes_per_rank(Op op, double size_bytes, int n) {
  if (n <= 1) return 0;
  const double frac = double(n - 1) / n;
  switch (op) {
    case Op::AllReduce: return 2 * frac * size_bytes;
    case Op::ReduceScatter:
    case Op::AllGather:
    case Op::AllToAll: return frac * size_bytes;
    default: return size_bytes;
  }
}

}  // namespace dssim

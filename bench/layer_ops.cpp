// Where one micro-batch's compute goes, kernel by kernel, as the device model prices it: the
// embedding, one transformer layer and the head of a scenario, forward and backward, in ms. The
// counterpart of bench/profile_layer.py (the same on a GPU, measured by torch.profiler).
//
//   bench_layer_ops SCENARIO.yaml [--set key=value ...]
#include <cstdio>
#include <string>
#include <vector>
#include "core/device_model.hpp"
#include "core/model.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;

namespace {

double backward_seconds(const DeviceModel& dm, const LayerOp& op, bool flash) {
  if (op.gemm && op.attention_core && flash) return dm.flash_backward_seconds(op);
  if (op.gemm) return dm.backward_gemm_seconds(op);
  return dm.memory_bound_backward_seconds(op);
}

void table(const char* title, const DeviceModel& dm, const std::vector<LayerOp>& ops, bool flash) {
  std::printf("\n%s (ms)\n  %-26s %10s %10s\n", title, "op", "forward", "backward");
  double f = 0, b = 0;
  for (const auto& op : ops) {
    const double fo = op.backward_only ? 0 : dm.kernel_seconds(op) * 1e3;
    const double bo = backward_seconds(dm, op, flash) * 1e3;
    f += fo;
    b += bo;
    std::printf("  %-26s %10.3f %10.3f\n", op.name.c_str(), fo, bo);
  }
  std::printf("  %-26s %10.3f %10.3f   backward / forward %.2f\n", "total", f, b, f > 0 ? b / f : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_layer_ops SCENARIO.yaml [--set key=value ...]\n");
    return 2;
  }
  std::vector<std::string> sets;
  for (int i = 2; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--set") sets.push_back(argv[i + 1]);
  try {
    LoadOptions lo;
    lo.overrides = sets;
    const Scenario sc = load_scenario(argv[1], lo);
    const DeviceModel dm(sc);
    LayerShape shape;
    shape.micro_batch = sc.training.micro_batch;
    shape.tp = sc.parallel.tp;
    shape.sequence_parallel = sc.parallel.sequence_parallel;
    shape.dtype = sc.precision.dtype;
    shape.ep = sc.parallel.ep;
    std::printf("%s: micro-batch %d, profile %s\n", sc.name.c_str(), shape.micro_batch,
                sc.cluster.device_profile.empty() ? "(preset curves)" : sc.cluster.device_profile.c_str());
    const bool flash = sc.model.flash_attention;
    table("embedding", dm, embedding_forward_ops(sc.model, shape), flash);
    table("transformer layer", dm, layer_forward_ops(sc.model, shape), flash);
    table("head", dm, head_forward_ops(sc.model, shape), flash);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_layer_ops: %s\n", e.what());
    return 2;
  }
  return 0;
}

// dssim_check_profile FILE [--expect-backend B]: loads a device profile with core's loader,
// checks what `dssim calibrate` must always write, prints the summary. Exit 0 ok, 1 otherwise.
#include <cmath>
#include <cstdio>
#include <string>
#include "core/device_profile.hpp"
#include "core/scenario_loader.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: dssim_check_profile FILE [--expect-backend B]\n");
    return 2;
  }
  try {
    const dssim::DeviceProfile p = dssim::load_device_profile(argv[1]);
    auto require = [](bool ok, const char* what) {
      if (!ok) throw std::runtime_error(std::string("check failed: ") + what);
    };
    require(!p.metadata.gpu.empty(), "metadata.gpu");
    require(!p.metadata.date.empty(), "metadata.date");
    require(p.metadata.tool.find("dssim calibrate") == 0, "metadata.tool names dssim calibrate");
    require(!p.metadata.torch_version.empty(), "metadata.torch_version");
    require(!p.gemm.empty(), "gemm rows");
    require(!p.attention.empty(), "attention rows");
    require(!p.elementwise.empty(), "elementwise rows");
    size_t passes[3] = {0, 0, 0};
    for (const auto& g : p.gemm) {
      const auto r = p.gemm_flops_per_second(g.dtype, g.m, g.n, g.k, 1, g.pass);
      require(r && *r == g.flops_per_second, "gemm lookup exact on its table points (per pass)");
      ++passes[static_cast<int>(g.pass)];
    }
    // Every forward shape also in its backward layouts (dgrad, wgrad), at the forward's (m, n, k).
    require(passes[0] > 0, "forward gemm rows");
    require(passes[1] == passes[0], "a dgrad row per forward gemm row");
    require(passes[2] == passes[0], "a wgrad row per forward gemm row");
    for (const auto& g : p.gemm) {
      if (g.pass != dssim::GemmPass::forward) continue;
      dssim::LayerOp op;
      op.name = g.op;
      op.gemm = true;
      op.m = g.m, op.n = g.n, op.k = g.k;
      op.flops = 2 * g.m * g.n * g.k;
      const auto t = p.backward_gemm_seconds(op, g.dtype);
      require(t && *t > 0, "backward time of every measured forward shape");
    }
    // The optimizer step (50 bytes / parameter) and the host AdamW (30 bytes / parameter).
    size_t step_rows = 0, host_rows = 0;
    for (const auto& e : p.elementwise) {
      if (e.op != "optimizer_step" && e.op != "host_adamw") continue;
      const double per_param = e.op == "optimizer_step" ? 50 : 30;
      const double n = e.bytes / per_param;
      require(n == std::floor(n) && n >= 1024, "optimizer rows: bytes are a whole number of parameters x 50 (30 on the host)");
      const auto r = p.elementwise_bytes_per_second(e.op, e.dtype, e.bytes);
      require(r && *r == e.bytes_per_second, "optimizer rows: lookup exact on its table points");
      ++(e.op == "optimizer_step" ? step_rows : host_rows);
    }
    require(step_rows >= 2, "optimizer_step rows");
    require(host_rows >= 2, "host_adamw rows");
    bool host_note = false;
    for (const auto& n : p.metadata.notes) host_note |= n.rfind("host_adamw:", 0) == 0 && n.find(" on ") != std::string::npos;
    require(host_note, "a note says which host CPU host_adamw ran on");
    if (argc > 3 && std::string(argv[2]) == "--expect-backend") require(p.metadata.backend == argv[3], "metadata.backend");
    std::fputs(dssim::device_profile_summary(p).c_str(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}

// dssim_check_profile FILE [--expect-backend B]: loads a device profile with core's loader,
// checks what `dssim calibrate` must always write, prints the summary. Exit 0 ok, 1 otherwise.
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
    for (const auto& g : p.gemm) {
      const auto r = p.gemm_flops_per_second(g.dtype, g.m, g.n, g.k);
      require(r && *r == g.flops_per_second, "gemm lookup exact on its table points");
    }
    if (argc > 3 && std::string(argv[2]) == "--expect-backend") require(p.metadata.backend == argv[3], "metadata.backend");
    std::fputs(dssim::device_profile_summary(p).c_str(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}

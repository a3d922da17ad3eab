#include "backends/torch/calibrate.hpp"
#include "backends/torch/calibrate_families.hpp"
#include "backends/torch/fused_cross_entropy.hpp"
#include "backends/torch/gemm_epilogues.hpp"
#include "backends/torch/moe.hpp"
#include "backends/torch/onebit_adam.hpp"

#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include "backends/torch/optimizer_kernels.hpp"
#include "backends/torch/stopwatch.hpp"
#include "backends/torch/torch_compat.hpp"

#if defined(DSSIM_TORCH_CUDA)
#include <cuda_runtime_api.h>
#endif
#if defined(DSSIM_HAVE_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace dssim::tb {
namespace calibration {

at::ScalarType scalar_type(Dtype d) {
  return d == Dtype::fp32 ? at::kFloat : d == Dtype::fp16 ? at::kHalf : at::kBFloat16;
}

AutogradSeconds autograd_seconds(Timer& timer, const std::function<void()>& forward,
                                 const std::function<void()>& forward_backward, double budget) {
  AutogradSeconds t;
  t.forward = timer.measure(forward, budget);
  const double both = timer.measure(forward_backward, budget);
  t.backward = both - t.forward;
  if (!(t.backward > kMinBackwardShare * both)) {
    t.backward = kMinBackwardShare * both;
    t.clamped = true;
  }
  return t;
}

std::string first_line(const char* what) {
  std::string s = what;
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

std::vector<GemmShape> transformer_gemms(const Grid& g) {
  std::set<GemmShape> shapes;  // distinct (m, n, k); the first op that asks for one names it
  for_each_layer_shape(g, [&](int64_t h, int64_t t, int64_t tokens) {
    shapes.insert({"qkv", tokens, 3 * h / t, h});
    shapes.insert({"attention_proj", tokens, h, h / t});
    shapes.insert({"mlp_up", tokens, 4 * h / t, h});
    shapes.insert({"mlp_down", tokens, h, 4 * h / t});
  });
  return {shapes.begin(), shapes.end()};
}

void say(const CalibrateOptions& o, const std::string& line) {
  if (o.progress) o.progress(line);
}

// Appends an `elementwise` row (bytes moved in `seconds`) and returns its bytes/s.
double add_bandwidth_row(DeviceProfile& p, const char* op, Dtype dtype, double bytes, double seconds) {
  BandwidthPoint r;
  r.op = op;
  r.dtype = dtype;
  r.bytes = bytes;
  r.bytes_per_second = bytes / seconds;
  p.elementwise.push_back(r);
  return r.bytes_per_second;
}

std::string fmt(double v, const char* unit) {
  std::ostringstream s;
  s.precision(4);
  s << v << " " << unit;
  return s.str();
}

}  // namespace calibration

namespace {
using namespace calibration;

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

Grid grid(bool cuda, bool quick) {
  Grid g;
  if (quick) {
    g.hidden = {64, 256};
    g.tokens = {32, 256};
    g.tp = {1, 2};
    g.seq = {32, 128};
    g.head_dim = {16, 64};
    g.batch_heads = {4, 16};
    g.elements = {1 << 10, 1 << 14, 1 << 18};
    g.optimizer = {1 << 12, 1 << 16};
    g.host_adamw = {1 << 12, 1 << 16};
    g.copy_bytes = {1 << 16, 1 << 20};
    g.collective_bytes = {1 << 20, 1 << 24};
    g.bwd_hidden = {64, 256};
    g.bwd_tokens = {32, 256};
    g.ce_tokens = {32, 256};
    g.ce_vocab = {512, 2048};
    g.emb_vocab = {1024};
    g.emb_hidden = {64, 256};
    g.emb_tokens = {32, 256};
    g.moe_tokens = {64, 256};
    g.moe_hidden = {64};
    g.moe_experts = {4};
  } else if (cuda) {
    // Issue 4's ranges: hidden 1024-16384, tokens 512-16384, TP 1-8 (about 550 distinct GEMMs).
    g.hidden = {1024, 2048, 4096, 6144, 8192, 12288, 16384};
    g.tokens = {512, 1024, 2048, 4096, 8192, 16384};
    g.tp = {1, 2, 4, 8};
    g.seq = {512, 1024, 2048, 4096, 8192, 16384};
    g.head_dim = {64, 128};
    g.batch_heads = {8, 32, 128};
    for (int e = 16; e <= 28; e += 2) g.elements.push_back(int64_t(1) << e);
    // Shards of 4M .. 512M parameters (0.2 .. 27 GB of step traffic); the host: 4M .. 128M.
    for (int e = 22; e <= 28; e += 2) g.optimizer.push_back(int64_t(1) << e);
    g.optimizer.push_back(int64_t(1) << 29);
    // The host step up to 1G parameters (18 GB of host tensors): an offloaded 7B shard's arrays
    // are 27 GB each, far from any cache (and the rate of the largest size applies above it).
    for (int e = 22; e <= 30; ++e) g.host_adamw.push_back(int64_t(1) << e);
    for (int e = 16; e <= 30; e += 2) g.copy_bytes.push_back(int64_t(1) << e);
    for (int e = 16; e <= 30; e += 2) g.collective_bytes.push_back(int64_t(1) << e);
    // The transformer's widths at 4K-32K tokens: up to 32768 x 32768 (gelu_backward, 6.4 GB) and
    // 32768 x 51200 logits (cross-entropy: fp32 [T x V] tensors of 6.7 GB, ~30 GB at its peak).
    g.bwd_hidden = {1024, 2048, 4096, 8192};
    g.bwd_tokens = {4096, 16384, 32768};
    g.ce_tokens = {4096, 16384, 32768};
    g.ce_vocab = {32000, 51200};
    g.emb_vocab = {51200};
    g.emb_hidden = {1024, 2048, 4096};
    g.emb_tokens = {4096, 16384};
    g.moe_tokens = {4096, 16384, 32768};
    g.moe_hidden = {1024, 4096};
    g.moe_experts = {8, 64};
  } else {  // a full CPU calibration: small transformer sizes
    g.hidden = {256, 512, 1024, 2048};
    g.tokens = {128, 512, 2048};
    g.tp = {1, 2, 4};
    g.seq = {128, 512, 1024};
    g.head_dim = {64};
    g.batch_heads = {4, 16};
    for (int e = 12; e <= 24; e += 3) g.elements.push_back(int64_t(1) << e);
    for (int e = 16; e <= 22; e += 2) g.optimizer.push_back(int64_t(1) << e);
    for (int e = 16; e <= 24; e += 2) g.host_adamw.push_back(int64_t(1) << e);
    g.bwd_hidden = {256, 1024};
    g.bwd_tokens = {512, 2048};
    g.ce_tokens = {512, 2048};
    g.ce_vocab = {8192};
    g.emb_vocab = {8192};
    g.emb_hidden = {256, 1024};
    g.emb_tokens = {512, 2048};
    g.moe_tokens = {512, 2048};
    g.moe_hidden = {256};
    g.moe_experts = {8};
  }
  return g;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "CPU";
}

}  // namespace

DeviceProfile calibrate(const CalibrateOptions& in) {
  CalibrateOptions o = in;
  const bool cuda = o.backend == "cuda";
  if (!cuda && o.backend != "cpu") throw CalibrateUsageError("--backend must be cuda or cpu, got '" + o.backend + "'");
  if (o.dtypes.empty()) o.dtypes = {cuda ? Dtype::bf16 : Dtype::fp32};
  if (o.quick) o.seconds_per_point = std::min(o.seconds_per_point, 0.005);

  DeviceProfile p;
  auto& md = p.metadata;
  md.backend = o.backend;
  md.date = utc_now();
  md.tool = o.command_line.empty() ? "dssim calibrate --backend " + o.backend : o.command_line;
  md.torch_version = TORCH_VERSION;
  md.timing = cuda ? "CUDA events on the current stream around back-to-back calls; 2 warm-up calls, median of 3-15 samples"
                   : "std::chrono around back-to-back calls; 2 warm-up calls, median of 3-15 samples";
  int ngpus = 0;
  if (cuda) {
    if (!torch_has_cuda())
      throw CalibrateUsageError("--backend cuda: this dssim was built against a libtorch without CUDA (" + std::string(TORCH_VERSION) +
                                "); build with pip torch's libtorch: -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')");
    ngpus = static_cast<int>(torch::cuda::device_count());
    if (ngpus == 0) throw CalibrateUsageError("--backend cuda: no CUDA GPU is visible (torch::cuda::device_count() is 0)");
    if (o.device < 0 || o.device >= ngpus)
      throw CalibrateUsageError("--device " + std::to_string(o.device) + ": only " + std::to_string(ngpus) + " GPU(s) visible");
    set_cuda_device(o.device);
    md.gpus = ngpus;
#if defined(DSSIM_TORCH_CUDA)
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, o.device) == cudaSuccess) md.gpu = prop.name;
    int v = 0;
    if (cudaRuntimeGetVersion(&v) == cudaSuccess) md.cuda_version = std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
    if (cudaDriverGetVersion(&v) == cudaSuccess) md.driver_version = "CUDA " + std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
#endif
    // fp32 rows mean what precision fp32 means to dssim: TF32 off.
    at::globalContext().setFloat32MatmulPrecision("highest");
  } else {
    md.gpu = cpu_name();
    md.gpus = 0;
    md.notes.push_back("cpu backend, " + std::to_string(at::get_num_threads()) + " threads");
  }
  if (o.quick) md.notes.push_back("--quick: a few tiny shapes, for tests; not a calibration");

  const at::Device dev = cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(o.device)) : at::Device(at::kCPU);
  torch::NoGradGuard no_grad;
  Timer timer(dev);
  const Grid g = grid(cuda, o.quick);
  const auto t0 = Clock::now();
  const auto want = [&](const char* family) {
    return o.only.empty() || std::find(o.only.begin(), o.only.end(), family) != o.only.end();
  };
  if (want("gemm")) measure_gemms(o, g, dev, timer, p);
  if (want("epilogues")) measure_epilogue_gemms(o, g, dev, timer, p);
  if (want("attention")) {
    measure_attention(o, g, dev, timer, p);
    measure_attention_backward(o, g, dev, timer, p);
  }
  if (want("elementwise")) measure_elementwise(o, g, dev, timer, p);
  if (want("backward")) measure_backward_kernels(o, g, dev, timer, p);
  if (want("moe")) measure_moe(o, g, dev, timer, p);
  if (want("optimizer")) measure_optimizer_step(o, g, dev, timer, p);
  if (want("host")) measure_host_adamw(o, g, dev, p, cpu_name());
  if (want("copies")) measure_copies(o, g, dev, timer, p);
  if (!want("collectives")) {
    // not asked for
  } else if (!cuda || ngpus < 2 || !o.collectives) {
    const std::string why = !cuda ? "cpu backend" : ngpus < 2 ? "one GPU visible" : "--no-collectives";
    md.notes.push_back("collectives: not measured (" + why + ")");
    say(o, "collectives: skipped (" + why + ")");
  } else {
#if defined(DSSIM_HAVE_NCCL)
    measure_collectives(o, g, ngpus, p);
#else
    md.notes.push_back("collectives: not measured (built without NCCL; configure with -DDSSIM_WITH_CUDA=ON)");
    say(o, "collectives: skipped (built without NCCL)");
#endif
  }
  say(o, "calibrated in " + fmt(std::chrono::duration<double>(Clock::now() - t0).count(), "s"));
  return p;
}

}  // namespace dssim::tb

// dssim_check_profile FILE [--expect-backend B]: loads a device profile with core's loader,
// checks what `dssim calibrate` must always write, prints the summary. Exit 0 ok, 1 otherwise.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>
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
    // The optimizer step (the one-pass fused step, 30 bytes / parameter) and the host AdamW (34 bytes / parameter: AdamW 28, the gradients cleared 4, the bf16 copy 2).
    size_t step_rows = 0, host_rows = 0;
    for (const auto& e : p.elementwise) {
      if (e.op != "optimizer_step" && e.op != "host_adamw") continue;
      const double per_param = e.op == "optimizer_step" ? 30 : 34;
      const double n = e.bytes / per_param;
      require(n == std::floor(n) && n >= 1024, "optimizer rows: bytes are a whole number of parameters x 30 (34 on the host)");
      const auto r = p.elementwise_bytes_per_second(e.op, e.dtype, e.bytes);
      require(r && *r == e.bytes_per_second, "optimizer rows: lookup exact on its table points");
      ++(e.op == "optimizer_step" ? step_rows : host_rows);
    }
    require(step_rows >= 2, "optimizer_step rows");
    require(host_rows >= 2, "host_adamw rows");
    // The backward-pass kernels: rows of each op, byte counts that follow the simulator's
    // conventions (e = the dtype's element size), lookups that answer on every row and never
    // through add's rows.
    const std::vector<std::string> backward_ops = {"layer_norm_backward", "gelu_backward", "bias_grad",
                                                   "cross_entropy", "cross_entropy_backward", "fused_cross_entropy",
                                                   "embedding_backward"};
    std::map<std::string, std::multiset<double>> units;  // op -> bytes / (per-element factor), per dtype
    for (const auto& e : p.elementwise) {
      if (std::find(backward_ops.begin(), backward_ops.end(), e.op) == backward_ops.end()) continue;
      require(std::isfinite(e.bytes_per_second) && e.bytes_per_second > 0, "backward kernel rows: a positive rate");
      const double b = dssim::bytes_of(e.dtype);
      const double per = e.op == "layer_norm_backward"      ? 5 * b
                         : e.op == "gelu_backward"          ? 3 * b
                         : e.op == "bias_grad"              ? b
                         : e.op == "cross_entropy"          ? b + 16
                         : e.op == "cross_entropy_backward" ? 24 + b
                         : e.op == "fused_cross_entropy"    ? 8 + 2 * b
                                                            : 2 * b;  // embedding_backward: 2 e (T + V) h
      const double n = e.bytes / per;
      require(n == std::floor(n) && n >= 256, "backward kernel rows: bytes follow the op's convention (whole elements)");
      std::string key = e.op + " " + dssim::to_string(e.dtype);
      units[key].insert(n);
      // One lookup per row: exact where the row is the only one of its bytes, else the geometric
      // mean of the rows of those bytes (between their min and max).
      double lo = e.bytes_per_second, hi = e.bytes_per_second;
      for (const auto& o : p.elementwise)
        if (o.op == e.op && o.dtype == e.dtype && o.bytes == e.bytes) lo = std::min(lo, o.bytes_per_second), hi = std::max(hi, o.bytes_per_second);
      const auto r = p.elementwise_bytes_per_second(e.op, e.dtype, e.bytes);
      require(r && *r >= lo * (1 - 1e-12) && *r <= hi * (1 + 1e-12), "backward kernel rows: lookup answers on its table points");
      if (lo == hi) require(*r == e.bytes_per_second, "backward kernel rows: lookup exact on a row of unique bytes");
    }
    for (dssim::Dtype d : {dssim::Dtype::fp32, dssim::Dtype::fp16, dssim::Dtype::bf16}) {
      const std::string dt = dssim::to_string(d);
      bool any = false;
      for (const auto& op : backward_ops) any |= units.count(op + " " + dt) > 0;
      if (!any) continue;
      for (const auto& op : backward_ops)
        require(units[op + " " + dt].size() >= 2, ("backward kernel rows: >= 2 rows of " + op + " " + dt).c_str());
      // The forward and the backward of the cross-entropy are timed on the same (T, V) shapes.
      require(units["cross_entropy " + dt] == units["cross_entropy_backward " + dt],
              "cross_entropy and cross_entropy_backward rows: the same T x V shapes ((e + 16) T V and (24 + e) T V bytes)");
    }
    require(!units.empty(), "backward kernel rows (layer_norm_backward ... embedding_backward)");
    // flash_backward: one row per flash row (same dtype and grid), none without flash rows.
    std::multiset<std::tuple<int, double, double, double>> flash, flash_bwd;
    for (const auto& a : p.attention) {
      const auto k = std::make_tuple(static_cast<int>(a.dtype), a.batch_heads, a.seq_len, a.head_dim);
      if (a.kernel == "flash") flash.insert(k);
      if (a.kernel == "flash_backward") {
        flash_bwd.insert(k);
        const auto r = p.attention_flops_per_second("flash_backward", a.dtype, a.batch_heads, a.seq_len, a.head_dim);
        require(r && *r == a.flops_per_second, "flash_backward lookup exact on its table points");
        require(a.seconds > 0 && std::abs(a.flops_per_second * a.seconds / (4 * a.batch_heads * a.seq_len * a.seq_len * a.head_dim) - 1) < 1e-5,
                "flash_backward rows: FLOP/s = 4 bh s^2 d / seconds (the flash rows' count)");
      }
    }
    require(flash == flash_bwd, "a flash_backward row per flash row (and none without flash rows)");
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

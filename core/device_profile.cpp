#include "core/device_profile.hpp"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>
#include "core/scenario_loader.hpp"

namespace dssim {

namespace fs = std::filesystem;

namespace {

// ---------------------------------------------------------------------------------------------
// Interpolation in log space over scattered samples.

struct Sample {
  std::vector<double> x;  // log2 coordinates
  double log_value;       // log2 of the measured rate
  double value;           // the measured rate itself: table points come back exactly
};

constexpr double kSame = 1e-9;  // log2 units: coordinates closer than this are the same size

double distance2(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (a[i] - b[i]) * (a[i] - b[i]);
  return d;
}

const Sample* exact(const std::vector<Sample>& s, const std::vector<double>& q) {
  for (const auto& p : s) {
    bool same = true;
    for (size_t i = 0; i < q.size() && same; ++i) same = std::abs(p.x[i] - q[i]) < kSame;
    if (same) return &p;
  }
  return nullptr;
}

// Inverse-distance (squared) estimate from the nearest measured points, for grid corners that
// were not measured themselves.
double nearest_estimate(const std::vector<Sample>& s, const std::vector<double>& q) {
  std::vector<std::pair<double, double>> d;  // distance^2, log value
  d.reserve(s.size());
  for (const auto& p : s) d.emplace_back(distance2(p.x, q), p.log_value);
  const size_t k = std::min<size_t>(4, d.size());
  std::partial_sort(d.begin(), d.begin() + k, d.end());
  double wsum = 0, vsum = 0;
  for (size_t i = 0; i < k; ++i) {
    const double w = 1.0 / std::max(d[i].first, 1e-18);
    wsum += w;
    vsum += w * d[i].second;
  }
  return vsum / wsum;
}

// Multilinear interpolation of log(value) in log(coordinates) between the bracketing measured
// coordinates on each axis. nullopt below the table on any axis; clamped above it.
std::optional<double> interpolate(const std::vector<Sample>& s, std::vector<double> q) {
  if (s.empty()) return std::nullopt;
  const size_t dims = q.size();
  std::vector<double> lo(dims), hi(dims), t(dims);
  for (size_t d = 0; d < dims; ++d) {
    std::vector<double> c;
    c.reserve(s.size());
    for (const auto& p : s) c.push_back(p.x[d]);
    std::sort(c.begin(), c.end());
    if (q[d] < c.front() - kSame) return std::nullopt;
    q[d] = std::min(q[d], c.back());
    auto above = std::lower_bound(c.begin(), c.end(), q[d] - kSame);
    if (std::abs(*above - q[d]) < kSame) {
      lo[d] = hi[d] = *above;
      t[d] = 0;
    } else {
      hi[d] = *above;
      lo[d] = *(above - 1);
      t[d] = (q[d] - lo[d]) / (hi[d] - lo[d]);
    }
  }
  if (const Sample* p = exact(s, q)) return p->value;
  double log_value = 0;
  std::vector<double> corner(dims);
  for (unsigned mask = 0; mask < (1u << dims); ++mask) {
    double w = 1;
    for (size_t d = 0; d < dims; ++d) {
      const bool upper = mask & (1u << d);
      corner[d] = upper ? hi[d] : lo[d];
      w *= upper ? t[d] : 1 - t[d];
    }
    if (w == 0) continue;
    const Sample* p = exact(s, corner);
    log_value += w * (p ? p->log_value : nearest_estimate(s, corner));
  }
  return std::exp2(log_value);
}

double lg(double v) { return std::log2(std::max(v, 1e-300)); }

// One sample per byte count: rows of equal bytes (shapes of one size, T x h = 4096 x 8192 and
// 32768 x 1024; or several dtypes standing in) count as one point at the geometric mean of their
// rates; a byte count measured once comes back exactly.
std::vector<Sample> bandwidth_samples(const std::vector<BandwidthPoint>& rows, const std::string& op,
                                      const Dtype* dtype) {
  std::map<double, std::vector<double>> by_bytes;
  for (const auto& r : rows)
    if (r.op == op && (!dtype || r.dtype == *dtype)) by_bytes[r.bytes].push_back(r.bytes_per_second);
  std::vector<Sample> s;
  for (const auto& [bytes, rates] : by_bytes) {
    if (rates.size() == 1) {
      s.push_back({{lg(bytes)}, lg(rates[0]), rates[0]});
      continue;
    }
    double log_sum = 0;
    for (double r : rates) log_sum += lg(r);
    const double log_mean = log_sum / double(rates.size());
    s.push_back({{lg(bytes)}, log_mean, std::exp2(log_mean)});
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Parsing with errors that name the file, the key and the line.

struct Ctx {
  std::string source;
  [[noreturn]] void fail(const std::string& key, const YAML::Node& n, const std::string& msg) const {
    std::string where = key;
    if (n.IsDefined() && n.Mark().line >= 0) where += " (line " + std::to_string(n.Mark().line + 1) + ")";
    throw ConfigError(source + ": " + where + ": " + msg);
  }
};

std::string describe(const YAML::Node& v) {
  if (!v.IsDefined() || v.IsNull()) return "nothing";
  if (v.IsSequence()) return "a list";
  if (v.IsMap()) return "a mapping";
  return "'" + v.Scalar() + "'";
}

std::string join(const std::vector<std::string>& v) {
  std::string r;
  for (const auto& s : v) r += (r.empty() ? "" : ", ") + s;
  return r;
}

void only_keys(const Ctx& c, const std::string& key, const YAML::Node& map, const std::vector<std::string>& allowed) {
  if (!map.IsMap()) c.fail(key, map, "expected a mapping, got " + describe(map));
  for (const auto& kv : map) {
    const std::string k = kv.first.Scalar();
    if (std::find(allowed.begin(), allowed.end(), k) == allowed.end())
      c.fail(key.empty() ? k : key + "." + k, kv.first, "unknown key; expected one of " + join(allowed));
  }
}

YAML::Node required(const Ctx& c, const std::string& key, const YAML::Node& map, const std::string& name) {
  YAML::Node v = map[name];
  if (!v.IsDefined() || v.IsNull()) c.fail(key + "." + name, map, "missing (required)");
  return v;
}

std::string get_string(const Ctx& c, const std::string& key, const YAML::Node& v) {
  if (!v.IsScalar()) c.fail(key, v, "expected a string, got " + describe(v));
  return v.Scalar();
}

double get_positive(const Ctx& c, const std::string& key, const YAML::Node& v) {
  if (!v.IsScalar()) c.fail(key, v, "expected a positive number, got " + describe(v));
  double x = 0;
  try {
    size_t used = 0;
    x = std::stod(v.Scalar(), &used);
    if (used != v.Scalar().size()) throw std::invalid_argument("trailing");
  } catch (const std::exception&) {
    c.fail(key, v, "expected a positive number, got '" + v.Scalar() + "'");
  }
  if (!(x > 0) || !std::isfinite(x)) c.fail(key, v, "must be a positive number, got " + v.Scalar());
  return x;
}

std::string get_enum(const Ctx& c, const std::string& key, const YAML::Node& v, const std::vector<std::string>& options) {
  const std::string s = get_string(c, key, v);
  if (std::find(options.begin(), options.end(), s) == options.end())
    c.fail(key, v, "expected one of " + join(options) + ", got '" + s + "'");
  return s;
}

Dtype get_dtype(const Ctx& c, const std::string& key, const YAML::Node& v) {
  const std::string s = get_enum(c, key, v, {"fp32", "fp16", "bf16"});
  return s == "fp32" ? Dtype::fp32 : s == "fp16" ? Dtype::fp16 : Dtype::bf16;
}

template <class Row, class Fn>
std::vector<Row> rows(const Ctx& c, const YAML::Node& root, const std::string& name,
                      const std::vector<std::string>& keys, Fn parse_row) {
  std::vector<Row> out;
  const YAML::Node list = root[name];
  if (!list.IsDefined() || list.IsNull()) return out;
  if (!list.IsSequence()) c.fail(name, list, "expected a list of rows, got " + describe(list));
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string key = name + "[" + std::to_string(i) + "]";
    only_keys(c, key, list[i], keys);
    out.push_back(parse_row(key, list[i]));
  }
  return out;
}

const std::vector<std::string> kGemmPasses = {"forward", "dgrad", "wgrad"};
// The epilogues a GEMM row of each pass may name (GemmPoint::epilogue).
const std::vector<std::string>& gemm_epilogues_of(GemmPass p) {
  static const std::vector<std::string> forward = {"gelu_aux_bias", "bias_residual"}, dgrad = {"dgelu"},
                                        wgrad = {"bgradb"};
  return p == GemmPass::dgrad ? dgrad : p == GemmPass::wgrad ? wgrad : forward;
}
const std::vector<std::string> kAttentionKernels = {"flash", "plain", "flash_backward"};
const std::vector<std::string> kElementwiseOps = {"add", "gelu", "layer_norm", "optimizer_step", "host_adamw",
                                                  "layer_norm_backward", "layer_norm_residual_backward", "gelu_backward", "bias_grad", "cross_entropy",
                                                  "cross_entropy_backward", "fused_cross_entropy", "embedding_backward", "attention_layout_copies",
                                                  "host_accumulate", "moe_routing", "moe_routing_backward", "moe_dispatch",
                                                  "moe_dispatch_backward", "moe_combine", "moe_combine_backward", "onebit_step",
                                                  "onebit_worker", "onebit_server", "onebit_decompress"};
// Elementwise families that stand in for one another (gelu / layer_norm -> add); the optimizer
// rows and the backward-pass kernels (layer_norm_backward ... embedding_backward) have their own
// byte conventions and no stand-in.
bool add_stands_in_for(const std::string& op) { return op == "gelu" || op == "layer_norm"; }

const std::vector<std::string> kCollectives = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv"};

}  // namespace

// ---------------------------------------------------------------------------------------------

double bus_bandwidth_factor(const std::string& collective, int ranks) {
  const double n = std::max(1, ranks);
  if (collective == "all_reduce") return 2 * (n - 1) / n;
  if (collective == "send_recv") return 1;
  return (n - 1) / n;  // reduce_scatter, all_gather, all_to_all
}

std::string elementwise_family(const std::string& op_name) {
  if (op_name.find("layernorm") != std::string::npos || op_name.find("layer_norm") != std::string::npos)
    return "layer_norm";
  if (op_name.find("gelu") != std::string::npos) return "gelu";
  return "add";
}

const char* to_string(GemmPass p) {
  switch (p) {
    case GemmPass::forward: return "forward";
    case GemmPass::dgrad: return "dgrad";
    case GemmPass::wgrad: return "wgrad";
  }
  return "forward";
}

namespace {
// fp16 and bf16 run at one tensor-core rate on every GPU dssim has a preset for (A100 312, H100 and
// H200 989 dense TFLOP/s each; cuBLAS and the flash kernels have a build of each): a profile
// calibrated in one 16-bit type prices the other where it has no rows of it. The asked type when
// `rows` has any row of it (of those `counts` keeps), else the other 16-bit type; fp32 (TF32 off)
// never borrows.
template <class Row, class Counts>
Dtype tensor_core_rows_dtype(Dtype dtype, const std::vector<Row>& rows, const Counts& counts) {
  if (dtype != Dtype::fp16 && dtype != Dtype::bf16) return dtype;
  const bool own = std::any_of(rows.begin(), rows.end(), [&](const Row& r) { return r.dtype == dtype && counts(r); });
  return own ? dtype : dtype == Dtype::fp16 ? Dtype::bf16 : Dtype::fp16;
}
}  // namespace

std::optional<double> DeviceProfile::gemm_flops_per_second(Dtype dtype, double m, double n, double k, double batch,
                                                           GemmPass pass, const std::string& epilogue) const {
  const Dtype d = tensor_core_rows_dtype(dtype, gemm, [](const GemmPoint&) { return true; });
  std::vector<Sample> s;
  for (const auto& r : gemm)
    if (r.dtype == d && r.pass == pass && r.epilogue == epilogue) s.push_back({{lg(r.m), lg(r.n), lg(r.k)}, lg(r.flops_per_second), r.flops_per_second});
  return interpolate(s, {lg(m * std::max(1.0, batch)), lg(n), lg(k)});
}

std::optional<double> DeviceProfile::attention_flops_per_second(const std::string& kernel, Dtype dtype, double batch_heads,
                                                                double seq_len, double head_dim) const {
  const Dtype d = tensor_core_rows_dtype(dtype, attention, [&](const AttentionPoint& r) { return r.kernel == kernel; });
  std::vector<Sample> s;
  for (const auto& r : attention)
    if (r.kernel == kernel && r.dtype == d)
      s.push_back({{lg(r.batch_heads), lg(r.seq_len), lg(r.head_dim)}, lg(r.flops_per_second), r.flops_per_second});
  return interpolate(s, {lg(batch_heads), lg(seq_len), lg(head_dim)});
}

std::optional<double> DeviceProfile::elementwise_bytes_per_second(const std::string& op, Dtype dtype, double bytes) const {
  // Bandwidth hardly depends on the dtype: rows of another dtype stand in when this one has none.
  std::vector<std::string> families = {op};
  if (add_stands_in_for(op)) families.push_back("add");
  for (const std::string& family : families) {
    auto s = bandwidth_samples(elementwise, family, &dtype);
    if (s.empty()) s = bandwidth_samples(elementwise, family, nullptr);
    if (!s.empty()) return interpolate(s, {lg(bytes)});
  }
  return std::nullopt;
}

std::optional<double> DeviceProfile::copy_bytes_per_second(const std::string& direction, double bytes) const {
  return interpolate(bandwidth_samples(copy, direction, nullptr), {lg(bytes)});
}

std::optional<double> DeviceProfile::bus_bandwidth(const std::string& collective, int ranks, double bytes) const {
  std::vector<Sample> s;
  for (const auto& r : collectives)
    if (r.collective == collective && r.ranks == ranks) s.push_back({{lg(r.bytes)}, lg(r.bus_bandwidth), r.bus_bandwidth});
  return interpolate(s, {lg(bytes)});
}

std::optional<double> DeviceProfile::kernel_seconds(const LayerOp& op, Dtype dtype, bool flash) const {
  if (op.gemm) {
    if (op.flops <= 0) return std::nullopt;
    std::optional<double> rate;
    if (op.attention_core && flash) {
      // attention_scores: [s x s] = [s x d][d x s]; attention_over_v: [s x d] = [s x s][s x d]
      const double head_dim = op.n == op.m ? op.k : op.n;
      rate = attention_flops_per_second("flash", dtype, op.batch, op.m, head_dim);
    } else {
      rate = gemm_flops_per_second(dtype, op.m, op.n, op.k, op.batch, GemmPass::forward, op.epilogue);
    }
    if (!rate) return std::nullopt;
    return op.flops / *rate;
  }
  if (op.attention_core && flash) return std::nullopt;  // fused into the flash kernel
  if (op.memory_bytes <= 0) return std::nullopt;
  const auto bw = elementwise_bytes_per_second(elementwise_family(op.name), dtype, op.memory_bytes);
  if (!bw) return std::nullopt;
  return op.memory_bytes / *bw;
}

std::optional<double> DeviceProfile::backward_gemm_seconds(const LayerOp& op, Dtype dtype) const {
  if (!op.gemm || op.attention_core || op.flops <= 0) return std::nullopt;
  const auto dgrad = gemm_flops_per_second(dtype, op.m, op.n, op.k, op.batch, GemmPass::dgrad);
  if (dgrad && op.frozen) return op.flops / *dgrad;  // a frozen weight: no weight gradient
  const auto wgrad = gemm_flops_per_second(dtype, op.m, op.n, op.k, op.batch, GemmPass::wgrad);
  if (!dgrad || !wgrad) return std::nullopt;
  return op.flops / *dgrad + op.flops / *wgrad;
}

std::optional<double> DeviceProfile::efficiency(const LayerOp& op, Dtype dtype, bool flash, double peak_flops) const {
  if (!op.gemm || peak_flops <= 0) return std::nullopt;
  const auto t = kernel_seconds(op, dtype, flash);
  if (!t || *t <= 0) return std::nullopt;
  return op.flops / (*t * peak_flops);
}

DeviceProfile parse_device_profile(const std::string& yaml, const std::string& source) {
  const Ctx c{source};
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    throw ConfigError(source + ": line " + std::to_string(e.mark.line + 1) + ": not valid YAML: " + e.msg);
  }
  if (!root.IsMap()) throw ConfigError(source + ": a device profile is a mapping (metadata, gemm, attention, ...), got " + describe(root));
  only_keys(c, "", root, {"version", "metadata", "gemm", "attention", "elementwise", "copy", "collectives"});
  if (root["version"].IsDefined() && get_string(c, "version", root["version"]) != "1")
    c.fail("version", root["version"], "this dssim reads device profile version 1, got " + root["version"].Scalar());

  DeviceProfile p;
  p.source = source;
  const YAML::Node md = required(c, "", root, "metadata");
  only_keys(c, "metadata", md, {"gpu", "backend", "date", "tool", "torch_version", "cuda_version", "driver_version", "gpus",
                                "timing", "notes"});
  auto& m = p.metadata;
  m.gpu = get_string(c, "metadata.gpu", required(c, "metadata", md, "gpu"));
  if (md["backend"]) m.backend = get_enum(c, "metadata.backend", md["backend"], {"cuda", "cpu"});
  m.date = get_string(c, "metadata.date", required(c, "metadata", md, "date"));
  m.tool = get_string(c, "metadata.tool", required(c, "metadata", md, "tool"));
  if (md["torch_version"]) m.torch_version = get_string(c, "metadata.torch_version", md["torch_version"]);
  if (md["cuda_version"]) m.cuda_version = get_string(c, "metadata.cuda_version", md["cuda_version"]);
  if (md["driver_version"]) m.driver_version = get_string(c, "metadata.driver_version", md["driver_version"]);
  if (md["gpus"]) {
    const std::string v = get_string(c, "metadata.gpus", md["gpus"]);
    if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos || v.size() > 6)
      c.fail("metadata.gpus", md["gpus"], "expected a GPU count (integer >= 0), got '" + v + "'");
    m.gpus = std::stoi(v);
  }
  if (md["timing"]) m.timing = get_string(c, "metadata.timing", md["timing"]);
  if (const YAML::Node notes = md["notes"]; notes.IsDefined() && !notes.IsNull()) {
    if (!notes.IsSequence()) c.fail("metadata.notes", notes, "expected a list of strings, got " + describe(notes));
    for (size_t i = 0; i < notes.size(); ++i)
      m.notes.push_back(get_string(c, "metadata.notes[" + std::to_string(i) + "]", notes[i]));
  }

  p.gemm = rows<GemmPoint>(c, root, "gemm", {"op", "dtype", "pass", "epilogue", "m", "n", "k", "flops_per_second", "seconds"},
                           [&](const std::string& key, const YAML::Node& r) {
    GemmPoint g;
    g.dtype = get_dtype(c, key + ".dtype", required(c, key, r, "dtype"));
    g.m = get_positive(c, key + ".m", required(c, key, r, "m"));
    g.n = get_positive(c, key + ".n", required(c, key, r, "n"));
    g.k = get_positive(c, key + ".k", required(c, key, r, "k"));
    if (r["pass"]) {
      const std::string pass = get_enum(c, key + ".pass", r["pass"], kGemmPasses);
      g.pass = pass == "dgrad" ? GemmPass::dgrad : pass == "wgrad" ? GemmPass::wgrad : GemmPass::forward;
    }
    if (r["epilogue"]) {
      const auto& allowed = gemm_epilogues_of(g.pass);
      g.epilogue = get_string(c, key + ".epilogue", r["epilogue"]);
      if (std::find(allowed.begin(), allowed.end(), g.epilogue) == allowed.end())
        c.fail(key + ".epilogue", r["epilogue"], std::string("a ") + to_string(g.pass) + " GEMM's epilogue is one of " +
                                                      join(allowed) + ", got '" + g.epilogue + "'");
    }
    g.flops_per_second = get_positive(c, key + ".flops_per_second", required(c, key, r, "flops_per_second"));
    if (r["seconds"]) g.seconds = get_positive(c, key + ".seconds", r["seconds"]);
    if (r["op"]) g.op = get_string(c, key + ".op", r["op"]);
    return g;
  });
  p.attention = rows<AttentionPoint>(c, root, "attention",
                                     {"kernel", "dtype", "batch_heads", "seq_len", "head_dim", "causal", "flops_per_second", "seconds"},
                                     [&](const std::string& key, const YAML::Node& r) {
    AttentionPoint a;
    a.kernel = get_enum(c, key + ".kernel", required(c, key, r, "kernel"), kAttentionKernels);
    a.dtype = get_dtype(c, key + ".dtype", required(c, key, r, "dtype"));
    a.batch_heads = get_positive(c, key + ".batch_heads", required(c, key, r, "batch_heads"));
    a.seq_len = get_positive(c, key + ".seq_len", required(c, key, r, "seq_len"));
    a.head_dim = get_positive(c, key + ".head_dim", required(c, key, r, "head_dim"));
    if (r["causal"]) {
      const std::string s = get_enum(c, key + ".causal", r["causal"], {"true", "false"});
      a.causal = s == "true";
    }
    a.flops_per_second = get_positive(c, key + ".flops_per_second", required(c, key, r, "flops_per_second"));
    if (r["seconds"]) a.seconds = get_positive(c, key + ".seconds", r["seconds"]);
    return a;
  });
  auto bandwidth_rows = [&](const std::string& name, const std::string& op_key, const std::vector<std::string>& ops,
                            bool with_dtype) {
    std::vector<std::string> keys = {op_key, "bytes", "bytes_per_second"};
    if (with_dtype) keys.push_back("dtype");
    return rows<BandwidthPoint>(c, root, name, keys, [&](const std::string& key, const YAML::Node& r) {
      BandwidthPoint b;
      b.op = get_enum(c, key + "." + op_key, required(c, key, r, op_key), ops);
      if (with_dtype) b.dtype = get_dtype(c, key + ".dtype", required(c, key, r, "dtype"));
      b.bytes = get_positive(c, key + ".bytes", required(c, key, r, "bytes"));
      b.bytes_per_second = get_positive(c, key + ".bytes_per_second", required(c, key, r, "bytes_per_second"));
      return b;
    });
  };
  p.elementwise = bandwidth_rows("elementwise", "op", kElementwiseOps, true);
  p.copy = bandwidth_rows("copy", "direction", {"h2d", "d2h"}, false);
  p.collectives = rows<CollectivePoint>(c, root, "collectives",
                                        {"collective", "ranks", "bytes", "seconds", "algorithm_bandwidth", "bus_bandwidth"},
                                        [&](const std::string& key, const YAML::Node& r) {
    CollectivePoint x;
    x.collective = get_enum(c, key + ".collective", required(c, key, r, "collective"), kCollectives);
    const double ranks = get_positive(c, key + ".ranks", required(c, key, r, "ranks"));
    if (ranks < 2 || ranks != std::floor(ranks)) c.fail(key + ".ranks", r["ranks"], "must be an integer >= 2");
    x.ranks = static_cast<int>(ranks);
    x.bytes = get_positive(c, key + ".bytes", required(c, key, r, "bytes"));
    x.bus_bandwidth = get_positive(c, key + ".bus_bandwidth", required(c, key, r, "bus_bandwidth"));
    if (r["seconds"]) x.seconds = get_positive(c, key + ".seconds", r["seconds"]);
    x.algorithm_bandwidth = r["algorithm_bandwidth"]
                                ? get_positive(c, key + ".algorithm_bandwidth", r["algorithm_bandwidth"])
                                : x.bus_bandwidth / bus_bandwidth_factor(x.collective, x.ranks);
    return x;
  });
  if (p.gemm.empty() && p.attention.empty() && p.elementwise.empty() && p.copy.empty() && p.collectives.empty())
    throw ConfigError(source + ": the device profile has no measurements (gemm, attention, elementwise, copy, collectives are all empty)");
  return p;
}

std::string resolve_device_profile_path(const std::string& path) {
  const fs::path p(path);
  if (p.is_absolute() || fs::exists(p)) return p.string();
  const fs::path under_root = fs::path(data_root()) / p;
  if (fs::exists(under_root)) return under_root.string();
  return p.string();
}

DeviceProfile load_device_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw ConfigError("cannot open device profile '" + path + "' (cluster.device_profile is resolved against the working "
                      "directory, then " + data_root() + "); `dssim calibrate --out FILE` writes one");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_device_profile(ss.str(), path);
}

std::shared_ptr<const DeviceProfile> shared_device_profile(const std::string& path) {
  static std::mutex mutex;
  static std::map<std::string, std::pair<fs::file_time_type, std::shared_ptr<const DeviceProfile>>> cache;
  std::error_code ec;
  const auto stamp = fs::last_write_time(path, ec);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(path);
  if (it != cache.end() && !ec && it->second.first == stamp) return it->second.second;
  auto profile = std::make_shared<const DeviceProfile>(load_device_profile(path));
  cache[path] = {stamp, profile};
  return profile;
}

std::string to_yaml(const DeviceProfile& p) {
  YAML::Emitter y;
  y.SetDoublePrecision(7);
  y << YAML::Comment("dssim device profile (docs/device-profile.md): measured rates the device model uses in place of the preset curves");
  y << YAML::BeginMap;
  y << YAML::Key << "version" << YAML::Value << "1";
  const auto& m = p.metadata;
  y << YAML::Key << "metadata" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "gpu" << YAML::Value << m.gpu;
  y << YAML::Key << "backend" << YAML::Value << m.backend;
  y << YAML::Key << "date" << YAML::Value << m.date;
  y << YAML::Key << "tool" << YAML::Value << m.tool;
  y << YAML::Key << "torch_version" << YAML::Value << m.torch_version;
  if (!m.cuda_version.empty()) y << YAML::Key << "cuda_version" << YAML::Value << m.cuda_version;
  if (!m.driver_version.empty()) y << YAML::Key << "driver_version" << YAML::Value << m.driver_version;
  y << YAML::Key << "gpus" << YAML::Value << m.gpus;
  if (!m.timing.empty()) y << YAML::Key << "timing" << YAML::Value << m.timing;
  if (!m.notes.empty()) {
    y << YAML::Key << "notes" << YAML::Value << YAML::BeginSeq;
    for (const auto& n : m.notes) y << n;
    y << YAML::EndSeq;
  }
  y << YAML::EndMap;
  if (!p.gemm.empty()) {
    y << YAML::Key << "gemm" << YAML::Value << YAML::BeginSeq;
    for (const auto& g : p.gemm) {
      y << YAML::Flow << YAML::BeginMap;
      if (!g.op.empty()) y << YAML::Key << "op" << YAML::Value << g.op;
      y << YAML::Key << "dtype" << YAML::Value << to_string(g.dtype);
      if (g.pass != GemmPass::forward) y << YAML::Key << "pass" << YAML::Value << to_string(g.pass);
      if (!g.epilogue.empty()) y << YAML::Key << "epilogue" << YAML::Value << g.epilogue;
      y << YAML::Key << "m" << YAML::Value << g.m << YAML::Key << "n" << YAML::Value << g.n << YAML::Key << "k" << YAML::Value << g.k;
      y << YAML::Key << "flops_per_second" << YAML::Value << g.flops_per_second;
      if (g.seconds > 0) y << YAML::Key << "seconds" << YAML::Value << g.seconds;
      y << YAML::EndMap;
    }
    y << YAML::EndSeq;
  }
  if (!p.attention.empty()) {
    y << YAML::Key << "attention" << YAML::Value << YAML::BeginSeq;
    for (const auto& a : p.attention) {
      y << YAML::Flow << YAML::BeginMap;
      y << YAML::Key << "kernel" << YAML::Value << a.kernel << YAML::Key << "dtype" << YAML::Value << to_string(a.dtype);
      y << YAML::Key << "batch_heads" << YAML::Value << a.batch_heads << YAML::Key << "seq_len" << YAML::Value << a.seq_len;
      y << YAML::Key << "head_dim" << YAML::Value << a.head_dim << YAML::Key << "causal" << YAML::Value << (a.causal ? "true" : "false");
      y << YAML::Key << "flops_per_second" << YAML::Value << a.flops_per_second;
      if (a.seconds > 0) y << YAML::Key << "seconds" << YAML::Value << a.seconds;
      y << YAML::EndMap;
    }
    y << YAML::EndSeq;
  }
  auto bandwidth = [&](const char* name, const char* op_key, const std::vector<BandwidthPoint>& rows, bool with_dtype) {
    if (rows.empty()) return;
    y << YAML::Key << name << YAML::Value << YAML::BeginSeq;
    for (const auto& b : rows) {
      y << YAML::Flow << YAML::BeginMap << YAML::Key << op_key << YAML::Value << b.op;
      if (with_dtype) y << YAML::Key << "dtype" << YAML::Value << to_string(b.dtype);
      // Byte counts exactly (a whole number, up to ~1e11: the row's convention stays checkable).
      y << YAML::Key << "bytes" << YAML::Value << YAML::DoublePrecision(15) << b.bytes;
      y << YAML::Key << "bytes_per_second" << YAML::Value << b.bytes_per_second;
      y << YAML::EndMap;
    }
    y << YAML::EndSeq;
  };
  bandwidth("elementwise", "op", p.elementwise, true);
  bandwidth("copy", "direction", p.copy, false);
  if (!p.collectives.empty()) {
    y << YAML::Key << "collectives" << YAML::Value << YAML::BeginSeq;
    for (const auto& x : p.collectives) {
      y << YAML::Flow << YAML::BeginMap;
      y << YAML::Key << "collective" << YAML::Value << x.collective << YAML::Key << "ranks" << YAML::Value << x.ranks;
      y << YAML::Key << "bytes" << YAML::Value << x.bytes;
      if (x.seconds > 0) y << YAML::Key << "seconds" << YAML::Value << x.seconds;
      y << YAML::Key << "algorithm_bandwidth" << YAML::Value << x.algorithm_bandwidth;
      y << YAML::Key << "bus_bandwidth" << YAML::Value << x.bus_bandwidth;
      y << YAML::EndMap;
    }
    y << YAML::EndSeq;
  }
  y << YAML::EndMap;
  return std::string(y.c_str()) + "\n";
}

std::string device_profile_summary(const DeviceProfile& p) {
  struct Group {
    std::vector<double> v;
    std::string unit;
    double scale;
  };
  std::map<std::string, Group> groups;  // "gemm bf16", "attention flash bf16", ...
  std::vector<std::string> order;
  auto add = [&](const std::string& name, double v, const char* unit, double scale) {
    if (!groups.count(name)) order.push_back(name);
    auto& g = groups[name];
    g.v.push_back(v);
    g.unit = unit;
    g.scale = scale;
  };
  for (const auto& g : p.gemm)
    add(std::string("gemm ") + (g.pass == GemmPass::forward ? "" : std::string(to_string(g.pass)) + " ") +
            (g.epilogue.empty() ? "" : g.epilogue + " ") + to_string(g.dtype),
        g.flops_per_second, "TFLOP/s", 1e12);
  for (const auto& a : p.attention) add("attention " + a.kernel + " " + to_string(a.dtype), a.flops_per_second, "TFLOP/s", 1e12);
  for (const auto& e : p.elementwise) add(e.op + " " + to_string(e.dtype), e.bytes_per_second, "GB/s", 1e9);
  for (const auto& c : p.copy) add("copy " + c.op + " (pinned)", c.bytes_per_second, "GB/s", 1e9);
  for (const auto& c : p.collectives)
    add(c.collective + " x" + std::to_string(c.ranks) + " busbw", c.bus_bandwidth, "GB/s", 1e9);
  const auto& m = p.metadata;
  std::ostringstream o;
  o << "device profile: " << m.gpu << " (" << m.backend << ", torch " << m.torch_version;
  if (!m.cuda_version.empty()) o << ", CUDA " << m.cuda_version;
  o << ", " << m.gpus << " GPU" << (m.gpus == 1 ? "" : "s") << "), " << m.date << "\n";
  char line[160];
  std::snprintf(line, sizeof line, "%-30s %5s %10s %10s %10s  %s\n", "table", "rows", "min", "median", "max", "unit");
  o << line;
  for (const auto& name : order) {
    auto v = groups[name].v;
    std::sort(v.begin(), v.end());
    const double s = groups[name].scale;
    std::snprintf(line, sizeof line, "%-30s %5zu %10.4g %10.4g %10.4g  %s\n", name.c_str(), v.size(), v.front() / s,
                  v[v.size() / 2] / s, v.back() / s, groups[name].unit.c_str());
    o << line;
  }
  for (const auto& n : m.notes) o << "note: " << n << "\n";
  return o.str();
}

DeviceProfile merge_device_profile(DeviceProfile base, const DeviceProfile& fresh) {
  if (base.metadata.backend != fresh.metadata.backend || base.metadata.gpu != fresh.metadata.gpu)
    throw std::invalid_argument("the profile was measured on " + base.metadata.gpu + " (" + base.metadata.backend +
                                "), this run on " + fresh.metadata.gpu + " (" + fresh.metadata.backend +
                                "): merge only runs of the same device");
  // Rows of `table` whose key a fresh row shares are dropped, then the fresh rows appended.
  const auto replace = [](auto& table, const auto& rows, auto key) {
    std::set<decltype(key(rows.front()))> keys;
    for (const auto& r : rows) keys.insert(key(r));
    table.erase(std::remove_if(table.begin(), table.end(), [&](const auto& r) { return keys.count(key(r)) > 0; }),
                table.end());
    table.insert(table.end(), rows.begin(), rows.end());
    return keys.size();
  };
  std::set<std::string> merged;
  if (!fresh.elementwise.empty()) {
    replace(base.elementwise, fresh.elementwise, [](const BandwidthPoint& r) { return r.op; });
    for (const auto& r : fresh.elementwise) merged.insert(r.op);
  }
  if (!fresh.copy.empty()) {
    replace(base.copy, fresh.copy, [](const BandwidthPoint& r) { return r.op; });
    merged.insert("copies");
  }
  if (!fresh.gemm.empty()) {
    replace(base.gemm, fresh.gemm, [](const GemmPoint& r) { return std::make_tuple(int(r.dtype), int(r.pass), r.epilogue); });
    merged.insert("gemm");
  }
  if (!fresh.attention.empty()) {
    replace(base.attention, fresh.attention, [](const AttentionPoint& r) { return std::make_pair(r.kernel, int(r.dtype)); });
    merged.insert("attention");
  }
  if (!fresh.collectives.empty()) {
    replace(base.collectives, fresh.collectives, [](const CollectivePoint& r) { return r.collective; });
    merged.insert("collectives");
  }
  std::string what;
  for (const auto& m : merged) what += (what.empty() ? "" : ", ") + m;
  base.metadata.notes.push_back("merged " + fresh.metadata.date + " (" + fresh.metadata.tool + "): rows of " +
                                (what.empty() ? std::string("nothing") : what));
  for (const auto& n : fresh.metadata.notes) base.metadata.notes.push_back("merged run: " + n);
  return base;
}

}  // namespace dssim

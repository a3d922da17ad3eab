#include "core/pipeline_partition.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <regex>
#include <sstream>
#include "core/model.hpp"
#include "core/scenario_loader.hpp"

namespace dssim {

std::vector<int> partition_uniform(int num_items, int num_parts) {
  std::vector<int> parts(num_parts + 1, 0);
  if (num_items <= num_parts) {
    for (int p = 0; p <= num_parts; ++p) parts[p] = std::min(p, num_items);
    return parts;
  }
  // numpy.arange(0, (m + 1) chunk, chunk), then parts[i + 1:] += 1 for each i < residual.
  const int chunk = num_items / num_parts, residual = num_items % num_parts;
  for (int p = 0; p <= num_parts; ++p) parts[p] = p * chunk + std::min(p, residual);
  return parts;
}

std::vector<int> partition_balanced(const std::vector<double>& weights, int num_parts) {
  const int n = static_cast<int>(weights.size()), m = num_parts;
  if (n <= m) return partition_uniform(n, m);
  const double inf = std::numeric_limits<double>::infinity();
  const auto at = [m](int i, int j) { return static_cast<size_t>(i) * (m + 1) + j; };
  const size_t cells = static_cast<size_t>(n + 1) * (m + 1);
  std::vector<double> dp_max(cells, inf), dp_min(cells, inf), dp_cost(cells, inf), prefix(n + 1, 0.0);
  std::vector<int> position(cells, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weights[i];
  dp_max[at(0, 0)] = 0;
  dp_cost[at(0, 0)] = 0;  // dp_min[0, 0] stays inf, as in the Python
  for (int i = 1; i <= n; ++i)
    for (int j = 1; j <= std::min(i, m); ++j)
      for (int k = 0; k < i; ++k) {
        const double part = prefix[i] - prefix[k];
        const double max_sum = std::max(dp_max[at(k, j - 1)], part);
        const double min_sum = std::min(dp_min[at(k, j - 1)], part);
        const double cost = max_sum - min_sum;  // inf for an unreachable (k, j - 1)
        if (dp_cost[at(i, j)] >= cost) {
          dp_cost[at(i, j)] = cost;
          dp_max[at(i, j)] = max_sum;
          dp_min[at(i, j)] = min_sum;
          position[at(i, j)] = k;
        }
      }
  std::vector<int> parts{n};
  for (int j = m; j >= 1; --j) parts.push_back(position[at(parts.back(), j)]);
  std::reverse(parts.begin(), parts.end());
  return parts;
}

std::vector<PipelineModuleLayer> pipeline_module_layers(const Scenario& sc) {
  const ModelSpec& m = sc.model;
  const double experts = m.is_moe() ? std::ceil(double(m.experts) / std::max(1, sc.parallel.ep)) : 0;
  std::vector<PipelineModuleLayer> out;
  out.push_back({"EmbeddingPipe", embedding_params(m), false});
  for (int i = 0; i < m.layers; ++i) {
    double p = dense_layer_params(m);
    if (is_moe_layer(m, i)) p += double(m.hidden) * m.experts + (experts - 1) * expert_mlp_params(m);  // gate, experts
    out.push_back({"ParallelTransformerLayerPipe", p, true});
  }
  out.push_back({m.rmsnorm ? "RMSNorm" : "LayerNorm", norm_params(m), false});
  if (m.tied_embeddings)
    out.push_back({"EmbeddingPipe", embedding_params(m), false});  // TiedLayerSpec: built (and counted) again
  else
    out.push_back({"LMHeadPipe", double(m.vocab) * m.hidden, false});
  return out;
}

// Megatron-LM, megatron/core/transformer/transformer_block.py get_num_layers_to_build (d98e8a6):
// without a custom layout every stage builds num_layers / pp, asserted divisible. A count pp does
// not divide needs --decoder-first-pipeline-num-layers and / or --decoder-last-pipeline-num-layers
// (num_layers_in_first / last_pipeline_stage): those stages build what they say and the layers
// left must divide evenly over the middle stages (asserted: "With uneven pipelineing the left over
// layers must be divisible by left over stages"); with pp = 2 there are no middle stages. Megatron
// does not choose the two numbers; dssim chooses them as a user would: the middle stages
// ceil(L / pp) layers, the first and last stage the rest, so the ends (embedding, LM head and
// loss, and on stage 0 the most in-flight activations) are the lighter ones, the first the lighter
// of the two. When that would leave an end under one layer, the middle stages take fewer.
std::vector<int> megatron_partition(int layers, int pp) {
  if (pp <= 1) return {layers};
  if (layers < pp) throw std::invalid_argument("megatron_partition: fewer layers than stages");
  if (pp == 2) return {layers / 2, layers - layers / 2};
  int middle = (layers + pp - 1) / pp;
  while (middle > 1 && layers - (pp - 2) * middle < 2) --middle;
  const int rest = layers - (pp - 2) * middle;
  std::vector<int> out(pp, middle);
  out.front() = rest / 2;
  out.back() = rest - rest / 2;
  return out;
}

std::string default_partition_method(const Scenario& sc) {
  if (!sc.parallel.partition_method.empty()) return sc.parallel.partition_method;
  if (sc.parallel.interleave > 1) return "megatron";
  return sc.model.layers % std::max(1, sc.parallel.pp) == 0 ? "uniform" : "parameters";
}

namespace {

constexpr const char* kKey = "parallel.partition_method";

[[noreturn]] void fail(const Scenario& sc, const KeyLocator& where, const std::string& msg) {
  const std::string loc = where ? where(kKey) : std::string();
  const std::string text = std::string(kKey) + loc + msg;
  throw ConfigError(sc.source.empty() ? text : sc.source + ": " + text);
}

std::string show(const std::vector<int>& v) {
  std::ostringstream o;
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "[") << v[i];
  o << "]";
  return o.str();
}

// Transformer layers in each part of DeepSpeed's boundaries over pipeline_module_layers().
std::vector<int> transformer_layers_per_part(const std::vector<PipelineModuleLayer>& specs, const std::vector<int>& parts) {
  std::vector<int> out(parts.size() - 1, 0);
  for (size_t s = 0; s + 1 < parts.size(); ++s)
    for (int i = parts[s]; i < parts[s + 1]; ++i) out[s] += specs[i].transformer ? 1 : 0;
  return out;
}

}  // namespace

std::vector<int> partition_layers(const Scenario& sc, const std::string& written, const KeyLocator& where) {
  const int pp = std::max(1, sc.parallel.pp), v = std::max(1, sc.parallel.interleave), L = sc.model.layers;
  if (L < pp)
    fail(sc, where, ": parallel.pp (" + std::to_string(pp) + ") is larger than model.layers (" + std::to_string(L) +
                        "): every pipeline stage needs at least one transformer layer; use pp <= " + std::to_string(L));
  std::string method = written;
  std::transform(method.begin(), method.end(), method.begin(), [](unsigned char c) { return std::tolower(c); });
  const bool deepspeed_method = method == "parameters" || method.rfind("type:", 0) == 0;
  if (deepspeed_method && v > 1)
    fail(sc, where, " '" + written + "' is a method of DeepSpeed's PipelineModule, whose pipeline engine does not "
                    "interleave; with parallel.interleave " + std::to_string(v) +
                    " use partition_method: megatron (or uniform), or set parallel.interleave: 1");

  std::vector<int> counts;
  if (method == "uniform") {
    const auto parts = partition_uniform(L, pp);
    for (int s = 0; s < pp; ++s) counts.push_back(parts[s + 1] - parts[s]);
  } else if (method == "megatron") {
    // With interleaving Megatron splits each stage's count evenly over its v model chunks
    // (asserts num_layers_per_pipeline_rank % vp_size == 0): split whole groups of v layers.
    if (L % v != 0)
      fail(sc, where, " megatron with parallel.interleave " + std::to_string(v) + ": model.layers (" + std::to_string(L) +
                          ") must be divisible by the interleave, as every stage's layers split evenly into its " +
                          std::to_string(v) + " model chunks in Megatron; change the interleave or give parallel.partition");
    if (L / v < pp)
      fail(sc, where, " megatron: model.layers / parallel.interleave (" + std::to_string(L / v) +
                          ") is smaller than parallel.pp (" + std::to_string(pp) + "); use a smaller interleave");
    counts = megatron_partition(L / v, pp);
    for (int& c : counts) c *= v;
  } else if (deepspeed_method) {
    const auto specs = pipeline_module_layers(sc);
    std::vector<double> weights;
    if (method == "parameters") {
      for (const auto& l : specs) weights.push_back(l.parameters);
    } else {
      const std::string pattern = written.substr(5);
      std::regex re;
      try {
        re = std::regex(pattern, std::regex::ECMAScript | std::regex::icase);
      } catch (const std::regex_error& ex) {
        fail(sc, where, ": '" + written + "' is not a valid regular expression (" + ex.what() + ")");
      }
      bool any = false;
      for (const auto& l : specs) {
        const bool hit = std::regex_search(l.name, re);
        weights.push_back(hit ? 1.0 : 0.0);
        any = any || hit;
      }
      if (!any)
        fail(sc, where, " '" + written + "' matches no layer (DeepSpeed: \"Partitioning '" + pattern +
                            "' found no valid layers to partition\"); the layers are named EmbeddingPipe, "
                            "ParallelTransformerLayerPipe, LayerNorm / RMSNorm and LMHeadPipe: use type:transformer");
    }
    counts = transformer_layers_per_part(specs, partition_balanced(weights, pp));
    for (int s = 0; s < pp; ++s)
      if (counts[s] < 1)
        fail(sc, where, " '" + written + "' leaves pipeline stage " + std::to_string(s) +
                            " without a transformer layer (DeepSpeed's balancing gives it only the embedding / head: " +
                            show(counts) + " layers per stage); dssim needs at least one per stage: use uniform or "
                            "megatron, a smaller parallel.pp, or give parallel.partition");
  } else {
    fail(sc, where, ": unknown method '" + written + "'; use one of uniform, parameters (DeepSpeed's default), "
                    "type:REGEX (e.g. type:transformer), megatron");
  }
  if (v > 1)
    for (int s = 0; s < pp; ++s)
      if (counts[s] % v != 0)
        fail(sc, where, " '" + written + "' gives stage " + std::to_string(s) + " " + std::to_string(counts[s]) +
                            " layers, which do not split into parallel.interleave (" + std::to_string(v) +
                            ") equal model chunks " + show(counts) + "; use partition_method: megatron or a layer "
                            "count divisible by pp * interleave");
  return counts;
}

void resolve_pipeline_partition(Scenario& sc, const KeyLocator& where) {
  auto& p = sc.parallel;
  if (!p.partition.empty() || p.pp <= 1) return;
  // DeepSpeed's engine does not interleave: validate() refuses the combination, naming both keys.
  if (p.pipeline_engine == PipelineEngine::deepspeed && p.interleave > 1) return;
  const std::string method = default_partition_method(sc);
  const std::vector<int> counts = partition_layers(sc, method, where);
  if (std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<int>()) == counts.end()) return;
  p.partition = counts;
  p.partition_method = method;  // the default that made it, for the report
}

std::vector<int> layers_per_stage(const Scenario& sc) {
  const int pp = std::max(1, sc.parallel.pp);
  if (static_cast<int>(sc.parallel.partition.size()) == pp) return sc.parallel.partition;
  const auto parts = partition_uniform(sc.model.layers, pp);
  std::vector<int> out;
  for (int s = 0; s < pp; ++s) out.push_back(parts[s + 1] - parts[s]);
  return out;
}

bool uniform_partition(const Scenario& sc) {
  const auto v = layers_per_stage(sc);
  return std::adjacent_find(v.begin(), v.end(), std::not_equal_to<int>()) == v.end();
}

}  // namespace dssim

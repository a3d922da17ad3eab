#include "backends/torch/lora.hpp"
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include "backends/torch/gpt.hpp"
#include "backends/torch/torch_compat.hpp"
#include "core/finetune.hpp"

namespace dssim::tb {

FinetuneConfig FinetuneConfig::from(const ModelSpec& m, const FinetuneSpec& f) {
  FinetuneConfig c;
  c.active = f.freezes_anything();
  if (!c.active) return c;
  c.lora = f.lora();
  c.train_embedding = base_trains(m, f, BasePart::embedding);
  c.train_norm = base_trains(m, f, BasePart::norm);
  c.train_attention = base_trains(m, f, BasePart::attention);
  c.train_mlp = base_trains(m, f, BasePart::mlp);
  if (!c.lora) return c;
  c.rank = f.rank;
  c.scale = f.alpha / double(f.rank);
  c.dropout = f.dropout;
  for (LoraTarget t : lora_targets(m, f)) {
    if (t == LoraTarget::q || t == LoraTarget::k || t == LoraTarget::v || t == LoraTarget::mlp_gate)
      throw std::invalid_argument(std::string("torch backend: finetune.targets ") + to_string(t) +
                                  ": dssim's GPT has a fused QKV and a GELU MLP; its targets are qkv (c_attn), o, "
                                  "mlp_up, mlp_down and lm_head");
    if (t == LoraTarget::lm_head) c.head = true;
  }
  for (const LoraAdapter& a : layer_adapters(m, f)) c.layer.push_back({a.target, int64_t(a.in), int64_t(a.out)});
  return c;
}

int FinetuneConfig::adapter_index(LoraTarget t) const {
  for (size_t i = 0; i < layer.size(); ++i)
    if (layer[i].target == t) return int(i);
  return -1;
}

namespace {
bool is_block(const GptConfig& c, int unit) { return unit >= 1 && unit <= c.layers; }
}  // namespace

std::vector<ParamSpec> lora_params(const GptConfig& c, int unit) {
  std::vector<ParamSpec> out;
  const FinetuneConfig& f = c.ft;
  if (!f.lora) return out;
  const int64_t r = f.rank;
  if (is_block(c, unit)) {
    for (const auto& a : f.layer) {
      const std::string n = std::string("lora.") + to_string(a.target);
      out.push_back({n + ".A", {r, a.in}, ParamSpec::LoraA});
      out.push_back({n + ".B", {a.out, r}, ParamSpec::Zeros});
    }
  } else if (unit == c.final_unit() && f.head) {
    out.push_back({"lora.lm_head.A", {r, int64_t(c.hidden)}, ParamSpec::LoraA});
    out.push_back({"lora.lm_head.B", {int64_t(c.vocab), r}, ParamSpec::Zeros});
  }
  return out;
}

int base_param_count(const GptConfig& c, int unit) {
  return int(unit_params(c, unit).size() - lora_params(c, unit).size());
}

bool param_trainable(const GptConfig& c, int unit, int index) {
  const FinetuneConfig& f = c.ft;
  if (!f.active) return true;
  if (index >= base_param_count(c, unit)) return true;  // an adapter
  if (unit == 0 || unit == c.head_copy_unit()) return f.train_embedding;
  if (unit == c.final_unit()) return f.train_norm;
  // ln1 w,b (0, 1), qkv w,b (2, 3), proj w,b (4, 5), ln2 w,b (6, 7), fc w,b (8, 9), fc2 w,b (10, 11)
  if (index <= 1 || index == 6 || index == 7) return f.train_norm;
  if (index <= 5) return f.train_attention;
  return f.train_mlp;
}

void init_lora(const GptConfig& c, int unit, const std::vector<at::Tensor>& views, uint64_t seed) {
  const auto specs = lora_params(c, unit);
  if (specs.empty()) return;
  at::NoGradGuard ng;
  auto gen = seeded_generator(views.at(0).device(), seed * 1000003ull + uint64_t(unit) * 7919ull + 0x10AAull);
  const size_t first = views.size() - specs.size();
  for (size_t i = 0; i < specs.size(); ++i) {
    at::Tensor v = views.at(first + i);
    if (specs[i].init == ParamSpec::LoraA) {
      // kaiming_uniform_(a = sqrt(5)) on [r, in]: gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / in).
      const double bound = std::sqrt(2.0 / 6.0) * std::sqrt(3.0 / double(specs[i].shape[1]));
      v.uniform_(-bound, bound, gen);
    } else {
      v.zero_();
    }
  }
}

at::Tensor lora_add(const GptConfig& c, const std::vector<at::Tensor>& params, int first_adapter, LoraTarget t,
                    const at::Tensor& x, const at::Tensor& base_out) {
  int k = -1;
  if (t == LoraTarget::lm_head) k = c.ft.head ? 0 : -1;
  else k = c.ft.adapter_index(t);
  if (!c.ft.lora || k < 0) return base_out;
  const at::Tensor& A = params.at(first_adapter + 2 * k);
  const at::Tensor& B = params.at(first_adapter + 2 * k + 1);
  const at::Tensor xd = c.ft.dropout > 0 ? at::dropout(x, c.ft.dropout, /*train=*/true) : x;
  return base_out + at::linear(at::linear(xd, A), B) * c.ft.scale;
}

}  // namespace dssim::tb

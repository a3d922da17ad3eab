#include "backends/torch/gpt.hpp"
#include <fstream>
#include <iterator>
#include <stdexcept>
#include "backends/torch/torch_compat.hpp"

namespace dssim::tb {

GptConfig GptConfig::from(const ModelSpec& m) {
  GptConfig c;
  c.layers = m.layers;
  c.hidden = m.hidden;
  c.heads = m.heads;
  c.ffn = m.ffn_hidden > 0 ? m.ffn_hidden : 4 * m.hidden;
  c.vocab = m.vocab;
  c.seq_len = m.seq_len;
  if (c.layers < 1 || c.hidden < 1 || c.heads < 1 || c.vocab < 1 || c.seq_len < 1)
    throw std::invalid_argument("model: layers, hidden, heads, vocab and seq_len must be positive");
  if (c.hidden % c.heads != 0)
    throw std::invalid_argument("model: hidden (" + std::to_string(c.hidden) +
                                ") must be divisible by heads (" + std::to_string(c.heads) + ")");
  if (m.is_moe()) throw std::invalid_argument("torch backend: MoE models are not supported");
  if (m.has_dropout())
    throw std::invalid_argument("torch backend: model.dropout = " + std::to_string(m.dropout) +
                                " is not implemented (dssim's GPT trains without dropout); set model.dropout: 0");
  if (!m.tied_embeddings) throw std::invalid_argument("torch backend: only tied embeddings are supported");
  return c;
}

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::vector<ParamSpec> unit_params(const GptConfig& c, int unit) {
  const int64_t h = c.hidden, f = c.ffn;
  if (unit == 0)
    return {{"wte", {c.vocab, h}, ParamSpec::Normal}, {"wpe", {c.seq_len, h}, ParamSpec::Normal}};
  if (unit == c.final_unit())
    return {{"lnf.w", {h}, ParamSpec::Ones}, {"lnf.b", {h}, ParamSpec::Zeros}};
  return {{"ln1.w", {h}, ParamSpec::Ones},        {"ln1.b", {h}, ParamSpec::Zeros},
          {"qkv.w", {3 * h, h}, ParamSpec::Normal}, {"qkv.b", {3 * h}, ParamSpec::Zeros},
          {"proj.w", {h, h}, ParamSpec::ScaledNormal}, {"proj.b", {h}, ParamSpec::Zeros},
          {"ln2.w", {h}, ParamSpec::Ones},        {"ln2.b", {h}, ParamSpec::Zeros},
          {"fc.w", {f, h}, ParamSpec::Normal},    {"fc.b", {f}, ParamSpec::Zeros},
          {"fc2.w", {h, f}, ParamSpec::ScaledNormal}, {"fc2.b", {h}, ParamSpec::Zeros}};
}

int64_t unit_numel(const GptConfig& c, int unit) {
  int64_t n = 0;
  for (const auto& p : unit_params(c, unit)) n += p.numel();
  return n;
}

std::vector<at::Tensor> unit_views(const GptConfig& c, int unit, const at::Tensor& flat) {
  std::vector<at::Tensor> out;
  int64_t off = 0;
  for (const auto& p : unit_params(c, unit)) {
    out.push_back(flat.narrow(0, off, p.numel()).view(p.shape));
    off += p.numel();
  }
  return out;
}

void init_unit(const GptConfig& c, int unit, at::Tensor flat, uint64_t seed) {
  at::NoGradGuard ng;
  auto gen = seeded_generator(flat.device(), seed * 1000003ull + uint64_t(unit) * 7919ull + 17);
  const double std = 0.02, scaled = 0.02 / std::sqrt(2.0 * c.layers);
  auto views = unit_views(c, unit, flat);
  auto specs = unit_params(c, unit);
  for (size_t i = 0; i < specs.size(); ++i) {
    switch (specs[i].init) {
      case ParamSpec::Normal: views[i].normal_(0.0, std, gen); break;
      case ParamSpec::ScaledNormal: views[i].normal_(0.0, scaled, gen); break;
      case ParamSpec::Zeros: views[i].zero_(); break;
      case ParamSpec::Ones: views[i].fill_(1.0); break;
    }
  }
}

namespace {
// CPU kernels of libtorch 1.13 lack fp16 LayerNorm: normalise in fp32 there (GPUs use their own).
at::Tensor layer_norm(const at::Tensor& x, int64_t h, const at::Tensor& w, const at::Tensor& b) {
  if (x.scalar_type() == at::kHalf && x.device().is_cpu())
    return at::layer_norm(x.to(at::kFloat), {h}, w.to(at::kFloat), b.to(at::kFloat), 1e-5).to(at::kHalf);
  return at::layer_norm(x, {h}, w, b, 1e-5);
}
// ...and fp16 GEMMs: on CPUs fp16 parameters are used in fp32 (storage, gradients and
// communication stay fp16, so loss scaling behaves as on GPUs).
std::vector<at::Tensor> compute_view(const std::vector<at::Tensor>& ps) {
  if (ps.empty() || !(ps[0].scalar_type() == at::kHalf && ps[0].device().is_cpu())) return ps;
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.to(at::kFloat));
  return out;
}
}  // namespace

at::Tensor embed_forward(const GptConfig& c, const std::vector<at::Tensor>& embed, const at::Tensor& tokens) {
  auto v = compute_view(embed);
  const int64_t s = tokens.size(1);
  auto pos = at::arange(s, tokens.options());
  return at::embedding(v[0], tokens) + at::embedding(v[1], pos).unsqueeze(0);
}

namespace {
// Selective activation checkpointing (Korthikanti et al. 2022): the attention core keeps only its
// inputs and is recomputed in backward.
struct RecomputedAttention : torch::autograd::Function<RecomputedAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v) {
    ctx->save_for_backward({q, k, v});
    at::NoGradGuard ng;
    return causal_attention(q, k, v);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> in;
    for (auto& t : saved) in.push_back(t.detach().requires_grad_(true));
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      out = causal_attention(in[0], in[1], in[2]);
    }
    return torch::autograd::grad({out}, {in[0], in[1], in[2]}, {grad_out[0]});
  }
};
}  // namespace

at::Tensor block_forward(const GptConfig& c, const std::vector<at::Tensor>& block, const at::Tensor& x_in,
                         bool recompute_attention) {
  const at::Tensor x = block[0].scalar_type() == at::kHalf && block[0].device().is_cpu() ? x_in.to(at::kFloat) : x_in;
  auto v = compute_view(block);
  const int64_t B = x.size(0), S = x.size(1), h = c.hidden, a = c.heads, d = h / a;
  auto y = layer_norm(x, h, v[0], v[1]);
  // unbind, not qkv[i]: select's backward would zero-fill a whole qkv-sized gradient per part and
  // add the three (about 5 % of the block's backward on an H200); unbind's stacks them once.
  auto qkv = at::linear(y, v[2], v[3]).view({B, S, 3, a, d}).permute({2, 0, 3, 1, 4}).unbind(0);
  auto core = recompute_attention ? RecomputedAttention::apply(qkv[0], qkv[1], qkv[2])
                                  : causal_attention(qkv[0], qkv[1], qkv[2]);
  auto att = core.transpose(1, 2).reshape({B, S, h});
  auto x1 = x + at::linear(att, v[4], v[5]);
  auto y2 = layer_norm(x1, h, v[6], v[7]);
  auto m = at::gelu(at::linear(y2, v[8], v[9]), "tanh");
  return x1 + at::linear(m, v[10], v[11]);
}

at::Tensor head_loss(const GptConfig& c, const std::vector<at::Tensor>& final_norm, const std::vector<at::Tensor>& embed,
                     const at::Tensor& x, const at::Tensor& targets) {
  auto f = compute_view(final_norm);
  auto e = compute_view(embed);
  auto y = layer_norm(x, c.hidden, f[0], f[1]);
  auto logits = at::matmul(y, e[0].t());
  return at::cross_entropy_loss(logits.view({-1, c.vocab}).to(at::kFloat), targets.reshape({-1}));
}

namespace {
uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
uint64_t mix(uint64_t a, uint64_t b) { return splitmix(a ^ splitmix(b)); }
}  // namespace

DataSource::DataSource(std::string path, int vocab, int seq_len, uint64_t seed)
    : vocab_(vocab), seq_len_(seq_len), seed_(seed) {
  if (path.empty()) return;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("--data: cannot read " + path);
  bytes_.assign(std::istreambuf_iterator<char>(in), {});
  if (vocab < 256)
    throw std::invalid_argument("--data trains byte-level: model.vocab must be >= 256 (it is " +
                                std::to_string(vocab) + ")");
  if (int64_t(bytes_.size()) < seq_len + 2)
    throw std::invalid_argument("--data: " + path + " is shorter than seq_len + 2 bytes");
}

at::Tensor DataSource::batch(int64_t step, int mb, int dp_rank, int micro_batch) const {
  auto out = at::empty({micro_batch, seq_len_ + 1}, at::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (int b = 0; b < micro_batch; ++b) {
    // Keyed by the sample's index in this rank's batch, so 4 micro-batches of 2 see the same
    // sequences as 1 of 8.
    const uint64_t sample = uint64_t(mb) * uint64_t(micro_batch) + uint64_t(b);
    uint64_t h = mix(mix(mix(seed_, uint64_t(step)), uint64_t(dp_rank)), sample);
    int64_t* row = p + int64_t(b) * (seq_len_ + 1);
    if (!bytes_.empty()) {
      const uint64_t start = h % uint64_t(bytes_.size() - seq_len_ - 1);
      for (int t = 0; t <= seq_len_; ++t) row[t] = bytes_[start + t];
    } else {
      // t_{i+1} = (a t_i + c) mod V with a, c from a small family, 1 token in 16 random: a model
      // can learn it, so the loss falls.
      const uint64_t a = 1 + 2 * (h % 4), c = 1 + (h >> 8) % 7;
      uint64_t tok = (h >> 16) % uint64_t(vocab_);
      for (int t = 0; t <= seq_len_; ++t) {
        row[t] = int64_t(tok);
        uint64_t r = mix(h, uint64_t(t));
        tok = (r % 16 == 0) ? (r >> 8) % uint64_t(vocab_) : (a * tok + c) % uint64_t(vocab_);
      }
    }
  }
  return out;
}

}  // namespace dssim::tb

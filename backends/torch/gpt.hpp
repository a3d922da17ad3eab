// A GPT in libtorch, written functionally over flat parameter buffers so the ZeRO engine owns all
// memory: the model is a list of units (embedding, one per transformer block, final LayerNorm), and
// every unit's parameters are views into one contiguous tensor of that unit, in this order:
//   embedding: wte [V, h], wpe [s, h]
//   block:     ln1 w,b [h]; qkv w [3h, h], b [3h]; proj w [h, h], b [h]; ln2 w,b [h];
//              fc w [f, h], b [f]; fc2 w [h, f], b [h]         (12h^2 + 13h when f = 4h)
//   final:     lnf w,b [h]; the LM head is wte (tied)
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include <torch/torch.h>
#include "core/scenario.hpp"

namespace dssim::tb {

struct GptConfig {
  int layers = 2, hidden = 64, heads = 4, ffn = 256, vocab = 256, seq_len = 32;
  static GptConfig from(const ModelSpec& m);
  int units() const { return layers + 2; }  // embedding, blocks, final norm
  int block_unit(int layer) const { return layer + 1; }
  int final_unit() const { return layers + 1; }
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  enum Init { Normal, ScaledNormal, Zeros, Ones } init;
  int64_t numel() const;
};

std::vector<ParamSpec> unit_params(const GptConfig& c, int unit);
int64_t unit_numel(const GptConfig& c, int unit);
// Views of a unit's flat tensor, in unit_params order.
std::vector<at::Tensor> unit_views(const GptConfig& c, int unit, const at::Tensor& flat);
// Deterministic initialisation of a unit (fp32 flat tensor) from the seed: N(0, 0.02) weights,
// N(0, 0.02/sqrt(2L)) for the residual projections (GPT-2), zero biases, unit norms.
void init_unit(const GptConfig& c, int unit, at::Tensor flat, uint64_t seed);

// The forward functions take a unit's parameter tensors in unit_params order (unit_views of its
// flat tensor, or the engine's per-parameter leaves).
at::Tensor embed_forward(const GptConfig& c, const std::vector<at::Tensor>& embed, const at::Tensor& tokens);
// recompute_attention: selective checkpointing, the attention core is recomputed in backward.
at::Tensor block_forward(const GptConfig& c, const std::vector<at::Tensor>& block, const at::Tensor& x,
                         bool recompute_attention = false);
// Final LayerNorm, tied LM head, mean cross-entropy in fp32.
at::Tensor head_loss(const GptConfig& c, const std::vector<at::Tensor>& final_norm,
                     const std::vector<at::Tensor>& embed, const at::Tensor& x, const at::Tensor& targets);

// Deterministic training data: batch(step, micro_batch, dp_rank) is a pure function of its
// arguments and the seed, so every run (and every resume) sees the same tokens.
class DataSource {
 public:
  // path empty: a synthetic stream with learnable structure (noisy affine recurrences over the
  // vocabulary); otherwise byte-level tokens of the file (vocab must be >= 256).
  DataSource(std::string path, int vocab, int seq_len, uint64_t seed);
  // int64 [micro_batch, seq_len + 1] on CPU: inputs are [:, :-1], targets [:, 1:].
  at::Tensor batch(int64_t step, int micro_batch_index, int dp_rank, int micro_batch) const;
  bool synthetic() const { return bytes_.empty(); }

 private:
  std::vector<uint8_t> bytes_;
  int vocab_, seq_len_;
  uint64_t seed_;
};

}  // namespace dssim::tb

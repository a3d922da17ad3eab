// A GPT in libtorch, written functionally over flat parameter buffers so the ZeRO engine owns all
// memory: the model is a list of units (embedding, one per transformer block, final LayerNorm, and
// on the last pipeline stage of a pipelined run the tied copy of the word embedding), and every
// unit's parameters are views into one contiguous tensor of that unit, in this order:
//   embedding: wte [V, h], wpe [s, h]
//   block:     ln1 w,b [h]; qkv w [3h, h], b [3h]; proj w [h, h], b [h]; ln2 w,b [h];
//              fc w [f, h], b [f]; fc2 w [h, f], b [h]         (12h^2 + 13h when f = 4h)
//   MoE block: ln1, qkv, proj, ln2 as above; gate w [experts, h] (no bias); the experts' MLPs
//              live outside the units (backends/torch/moe.hpp ExpertStore)
//   final:     lnf w,b [h]; the LM head is wte (tied)
//   LoRA:      a block's adapters follow its tensors, the lm_head's the final norm's (lora.hpp)
//   head copy: wte [V, h] (pp > 1: the last stage's copy, kept equal by the EmbeddingSync)
// With tensor parallelism (tp = t > 1, Megatron's layout) a rank holds its slice: wte [V/t, h]
// (vocabulary rows), qkv [3h/t, h] (its heads' q, k and v rows), proj [h, h/t] (its heads'
// columns), fc [f/t, h], fc2 [h, f/t]; LayerNorms, wpe and the row-parallel biases (proj.b, fc2.b,
// added after the reduction) are replicated. The model does not know about pipeline schedules:
// the engine calls the units its stage owns.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/lora.hpp"
#include "backends/torch/moe.hpp"
#include "backends/torch/tensor_parallel.hpp"
#include "core/scenario.hpp"

namespace dssim::tb {

struct GptConfig {
  int layers = 2, hidden = 64, heads = 4, ffn = 256, vocab = 256, seq_len = 32;
  int tp = 1, tp_rank = 0;         // tensor-parallel size and this rank's index in its group
  bool sequence_parallel = false;  // activations outside the TP regions are sequence shards
  int experts = 0, moe_every = 1;  // MoE: every moe_every-th layer (core/model.cpp is_moe_layer)
  bool fused_cross_entropy = false;  // model.cross_entropy: fused_linear (fused_cross_entropy.hpp)
  FinetuneConfig ft;               // what trains; LoRA adapters (backends/torch/lora.hpp)
  // Throws std::invalid_argument naming the key when the model cannot be split tp ways.
  static GptConfig from(const ModelSpec& m, int tp = 1, int tp_rank = 0, bool sequence_parallel = false,
                        const FinetuneSpec* finetune = nullptr);
  int units() const { return layers + 3; }  // embedding, blocks, final norm, head copy
  int block_unit(int layer) const { return layer + 1; }
  int final_unit() const { return layers + 1; }
  int head_copy_unit() const { return layers + 2; }
  int64_t vocab_local() const { return vocab / tp; }
  int64_t vocab_begin() const { return vocab_local() * tp_rank; }
  int64_t seq_local() const { return sequence_parallel ? seq_len / tp : seq_len; }
  bool moe_layer(int layer) const { return experts > 0 && layer % moe_every == moe_every - 1; }
  GptConfig whole() const;  // the same model unsplit (tp = 1)
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  enum Init { Normal, ScaledNormal, Zeros, Ones, LoraA } init;
  int64_t numel() const;
};

std::vector<ParamSpec> unit_params(const GptConfig& c, int unit);
int64_t unit_numel(const GptConfig& c, int unit);
// Whether parameter `index` of `unit` is the same whole tensor on every TP rank (LayerNorms, wpe,
// the row-parallel biases): counted once in the gradient norm, summed over the group under
// sequence parallelism.
bool replicated_over_tp(const GptConfig& c, int unit, int index);
// The whole (tp = 1) parameter from its TP slices, by TP rank (the inverse of the slicing init_unit
// applies).
at::Tensor tp_unslice(const GptConfig& c, int unit, int index, const std::vector<at::Tensor>& pieces);
// Views of a unit's flat tensor, in unit_params order.
std::vector<at::Tensor> unit_views(const GptConfig& c, int unit, const at::Tensor& flat);
// Deterministic initialisation of a unit (fp32 flat tensor) from the seed: N(0, 0.02) weights,
// N(0, 0.02/sqrt(2L)) for the residual projections (GPT-2), zero biases, unit norms. With tp > 1
// the whole unit is initialised and this rank's slice taken (Megatron's master-weight
// initialisation), so tp = N starts from the same weights as tp = 1; the head copy starts equal to
// the word embedding.
void init_unit(const GptConfig& c, int unit, at::Tensor flat, uint64_t seed);

// The forward functions take a unit's parameter tensors in unit_params order (unit_views of its
// flat tensor, or the engine's per-parameter leaves), and the TP context (size 1: no TP).
// Activations between units are [b, s, h] ([b, s/t, h] with sequence parallelism).
at::Tensor embed_forward(const GptConfig& c, TensorParallel& tp, const std::vector<at::Tensor>& embed,
                         const at::Tensor& tokens);
// Causal attention of `heads` heads over the QKV projection's output [B, S, 3 x heads x d], as
// [B, heads, S, d]; its backward writes the QKV gradient in one pass (gpt.cpp's QkvAttention).
// `recompute`: only qkv is kept, the core is recomputed in backward.
at::Tensor qkv_attention(const at::Tensor& qkv, int64_t heads, bool recompute = false);
// qkv_attention(y W^T + b): on GPUs where the block's GEMMs run fused (gemm_epilogues.hpp), as q, k
// and v from three GEMMs whose gradients need no copy into one QKV gradient; otherwise exactly that.
at::Tensor qkv_projection_attention(const at::Tensor& y, const at::Tensor& w, const at::Tensor& b, int64_t heads,
                                    bool recompute);
// recompute_attention: selective checkpointing, the attention core is recomputed in backward.
// `moe`: a MoE layer's experts and routing context (its l_aux is left in moe->l_aux).
at::Tensor block_forward(const GptConfig& c, TensorParallel& tp, const std::vector<at::Tensor>& block,
                         const at::Tensor& x, bool recompute_attention = false, MoeLayer* moe = nullptr);
// Final LayerNorm, tied LM head (`wte`: the word embedding or its copy), mean cross-entropy in
// fp32 (vocabulary-parallel with tp > 1).
at::Tensor head_loss(const GptConfig& c, TensorParallel& tp, const std::vector<at::Tensor>& final_norm,
                     const at::Tensor& wte, const at::Tensor& x, const at::Tensor& targets);

// Deterministic training data: a sample is a pure function of the seed, the step and its index in
// the step's global batch (dp_rank * samples_per_rank + its index in the rank's batch), so every
// run (and every resume) sees the same tokens, and 2 data-parallel ranks of 4 micro-batches see
// the same samples as 1 rank of 8.
class DataSource {
 public:
  // path empty: a synthetic stream with learnable structure (noisy affine recurrences over the
  // vocabulary); otherwise byte-level tokens of the file (vocab must be >= 256).
  DataSource(std::string path, int vocab, int seq_len, uint64_t seed);
  // int64 [micro_batch, seq_len + 1] on CPU: inputs are [:, :-1], targets [:, 1:].
  at::Tensor batch(int64_t step, int micro_batch_index, int dp_rank, int micro_batch, int64_t samples_per_rank) const;
  bool synthetic() const { return bytes_.empty(); }

 private:
  std::vector<uint8_t> bytes_;
  int vocab_, seq_len_;
  uint64_t seed_;
};

}  // namespace dssim::tb

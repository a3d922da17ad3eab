// A GPT of the Megatron papers' shape (V = 51200, s = 2048, dropout 0.1 as Megatron's and
// Korthikanti's) for the model and memory tests.
#pragma once
#include "core/scenario.hpp"

namespace dssim::test {

inline ModelSpec gpt_spec(int layers, int hidden, int heads) {
  ModelSpec m;
  m.name = "gpt";
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.vocab = 51200;
  m.seq_len = 2048;
  m.dropout = 0.1;
  return m;
}

}  // namespace dssim::test

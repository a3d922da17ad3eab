// `dssim run --dump-params FILE`: the whole model's parameters in fp32, in a single-rank run's
// layout, written by rank 0, so the tests can compare any parallel layout with one rank on real
// tensors (tests/torch: parallel_tests, moe_tests, finetune_tests). The engine hands over what each
// rank holds; this file puts the pieces together across pipeline stages, TP ranks and expert groups.
#pragma once
#include <string>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/comm.hpp"
#include "backends/torch/gpt.hpp"
#include "core/grid.hpp"
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim::tb {

// Where the pieces are: the run's layout and this rank's place in it.
struct DumpWorld {
  const Scenario& sc;
  const Program& program;
  const ProcessGrid& grid;
  const GptConfig& cfg;  // this rank's (its TP slice)
  Communicator& world;
  int rank;
  RankCoord coord;
};

// Rank 0: the whole dense model from the data-parallel rank 0 of every (stage, TP rank), unsliced
// to the tp = 1 shapes, in the one-stage order (embedding, blocks, final norm). `mine`: this rank's
// flat fp32 master of its units. Other ranks send theirs (DP rank 0) and return an empty tensor.
at::Tensor assemble_whole_model(const DumpWorld& w, const at::Tensor& mine);
// Rank 0: every MoE layer's experts, layer by layer, expert by expert (the one-rank layout), from
// the members of each stage's first expert-parallel group. `mine`: this rank's experts' fp32 master
// (on the host), `local`: experts per rank. Other ranks return an empty tensor.
at::Tensor assemble_experts(const DumpWorld& w, const at::Tensor& mine, int local);
// Writes a contiguous fp32 tensor's bytes to `path` (truncating it).
void write_fp32(const std::string& path, const at::Tensor& t);

}  // namespace dssim::tb

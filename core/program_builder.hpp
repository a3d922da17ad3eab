// Builds the Program of a Scenario: the 1F1B (or interleaved) pipeline schedule, with ZeRO, TP,
// MoE, 1-bit Adam and offload communication placed where DeepSpeed and Megatron place it.
#pragma once
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim {

struct BuildOptions {
  // Materialize only the rank with dp = 0, tp = 0 of every pipeline stage. Groups still list all
  // their members. Exact for interpreters that assume symmetric, contention-free ranks.
  bool representative_only = false;
};

Program build_program(const Scenario& sc, const BuildOptions& opts = {});

}  // namespace dssim

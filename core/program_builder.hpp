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
  // Collapse each run of compute-stream instructions that start back to back (after the first,
  // no dependency that the first does not have; no other instruction waits for one but the last;
  // compute, offload copies and collectives of a group with one materialized member, which
  // complete on arrival) into one instruction standing for the run (Program::chains). The
  // analytic estimator times it as its members run back to back and attributes each member's
  // seconds as before: the same timeline for every other instruction, far fewer to walk
  // (dssim plan). Interpreters that run instructions one by one (simulator, torch) build without it.
  bool collapse_chains = false;
};

Program build_program(const Scenario& sc, const BuildOptions& opts = {});

}  // namespace dssim

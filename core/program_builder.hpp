// Builds the Program of a Scenario: the 1F1B (or interleaved) pipeline schedule, with ZeRO, TP,
// MoE, 1-bit Adam and offload communication placed where DeepSpeed and Megatron place it.
#pragma once
#include <memory>
#include "core/program.hpp"
#include "core/scenario.hpp"

namespace dssim {

// The builder's per-stage plans (core/stage_plan.hpp: layer ranges, compute segments and their
// kernel lists, ZeRO partitions and buckets), kept across the Programs of one search (dssim plan).
// They are keyed by what of them differs between a search's points (parallel layout and partition,
// micro-batch size, ZeRO stage, offload, recompute, checkpointing, LoRA rank), not by the
// micro-batch count (the fast path's Programs of one configuration share them, and so do
// configurations that differ only in the optimizer offload below ZeRO-3). The stages' partitions
// (chunks, tensors, ZeRO partitions and buckets) are kept by fewer keys (not the micro-batch size,
// recompute, SP or offload), and the segments cut from a copy. Use one cache only for scenarios
// that agree in everything else (model, precision, ZeRO buckets, engine, cluster).
class StagePlanCache {
 public:
  StagePlanCache();
  ~StagePlanCache();
  StagePlanCache(const StagePlanCache&) = delete;
  StagePlanCache& operator=(const StagePlanCache&) = delete;
  struct Impl;
  std::unique_ptr<Impl> impl;
};

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
  // When set, stage plans are looked up here and kept (StagePlanCache).
  StagePlanCache* stage_plans = nullptr;
};

Program build_program(const Scenario& sc, const BuildOptions& opts = {});

}  // namespace dssim

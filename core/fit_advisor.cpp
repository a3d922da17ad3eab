#include "core/fit_advisor.hpp"

#include <algorithm>

#include "core/estimator.hpp"
#include "core/memory.hpp"
#include "core/pipeline_partition.hpp"
#include "core/scenario_loader.hpp"
#include "core/validate.hpp"

namespace dssim {

std::vector<FitCandidate> fit_candidates(const Scenario& sc) {
  std::vector<FitCandidate> out;
  auto consider = [&](std::string change, Scenario s) {
    try {
      validate(s);
    } catch (const ConfigError&) {
      return;  // DeepSpeed would refuse it (e.g. ZeRO-2 with pp > 1): not a suggestion
    }
    out.push_back({std::move(change), std::move(s)});
  };
  for (int stage = sc.zero.stage + 1; stage <= 3; ++stage) {
    Scenario s = sc;
    s.zero.stage = stage;
    consider("zero.stage=" + std::to_string(stage), s);
  }
  if (!sc.zero.offload_optimizer) {
    Scenario s = sc;
    s.zero.offload_optimizer = true;
    if (s.zero.stage == 0) s.zero.stage = 1;  // ZeRO-Offload needs a ZeRO stage >= 1
    consider(sc.zero.stage == 0 ? "zero.stage=1 zero.offload_optimizer=true" : "zero.offload_optimizer=true", s);
  }
  if (!sc.zero.offload_param) {
    Scenario s = sc;
    s.zero.stage = 3;
    s.zero.offload_optimizer = true;
    s.zero.offload_param = true;
    consider("zero.stage=3 zero.offload_optimizer=true zero.offload_param=true", s);
  }
  for (int mb = sc.training.micro_batch / 2; mb >= 1; mb /= 2) {
    Scenario s = sc;
    s.training.micro_batch = mb;
    s.training.grad_accum = static_cast<int>(sc.training.global_batch / (int64_t(mb) * sc.parallel.dp));
    consider("training.micro_batch=" + std::to_string(mb) + " training.grad_accum=" +
                 std::to_string(s.training.grad_accum), s);
    if (mb == 1) break;
  }
  if (sc.recompute == Recompute::none) {
    Scenario s = sc;
    s.recompute = Recompute::selective;
    consider("activation_checkpointing=selective", s);
  }
  if (sc.recompute != Recompute::full) {
    Scenario s = sc;
    s.recompute = Recompute::full;
    consider("activation_checkpointing=full", s);
  }
  // DeepSpeed's activation checkpointing options on the full recompute's kept inputs.
  if (sc.recompute == Recompute::full && sc.parallel.tp > 1 && !sc.checkpointing.partition_activations) {
    Scenario s = sc;
    s.checkpointing.partition_activations = true;
    consider("activation_checkpointing.partition_activations=true", s);
  }
  if (sc.recompute == Recompute::full && !sc.checkpointing.offloads(sc.recompute)) {
    Scenario s = sc;
    s.checkpointing.partition_activations = s.checkpointing.cpu_checkpointing = true;
    consider("activation_checkpointing.partition_activations=true activation_checkpointing.cpu_checkpointing=true", s);
  }
  // ZeRO-Infinity, where the cluster states its NVMe bandwidth.
  if (sc.cluster.nvme_bandwidth > 0 && sc.zero.stage == 3 && !sc.zero.on_nvme_optimizer(sc.cluster.nvme_bandwidth)) {
    Scenario s = sc;
    s.zero.offload_optimizer = s.zero.offload_param = true;
    s.zero.nvme_optimizer = s.zero.nvme_param = true;
    consider("zero.offload_optimizer=true zero.offload_param=true zero.offload_optimizer_device=nvme zero.offload_param_device=nvme", s);
  }
  // A fine-tuning job that trains every parameter: LoRA (PEFT's defaults) trains adapters only.
  if (sc.finetune.declared && !sc.finetune.freezes_anything()) {
    Scenario s = sc;
    s.finetune.method = FinetuneSpec::Method::lora;
    s.finetune.rank = 16;
    consider("finetune.method=lora finetune.rank=16", s);
  }
  if (sc.parallel.dp % 2 == 0) {
    Scenario s = sc;
    s.parallel.pp *= 2;
    s.parallel.dp /= 2;
    s.parallel.partition.clear();
    try {
      resolve_pipeline_partition(s);
    } catch (const ConfigError&) {
      s.parallel.partition.clear();  // no partition of the layers on 2 pp: validation refuses the candidate
    }
    s.training.grad_accum = static_cast<int>(sc.training.global_batch / (int64_t(s.training.micro_batch) * s.parallel.dp));
    consider("parallel.pp=" + std::to_string(s.parallel.pp) + " parallel.dp=" + std::to_string(s.parallel.dp), s);
  }
  return out;
}

std::vector<FitSuggestion> fit_suggestions(const Scenario& sc) {
  std::vector<FitSuggestion> out;
  for (const FitCandidate& c : fit_candidates(sc)) {
    Report r = analytic_report(c.scenario, /*suggest=*/false);
    out.push_back({c.change, r.memory.total(), r.iteration_seconds, r.fits});
  }
  std::stable_sort(out.begin(), out.end(), [](const FitSuggestion& a, const FitSuggestion& b) {
    if (a.fits != b.fits) return a.fits;
    return a.fits ? a.iteration_seconds < b.iteration_seconds : a.peak_bytes < b.peak_bytes;
  });
  return out;
}

}  // namespace dssim

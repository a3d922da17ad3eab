// Checkpoints of the torch engine: per rank a file of its optimizer state (step, Adam step, loss
// scaler, fp32 master shard, Adam moments), per run a manifest naming the step and the layout that
// wrote it. Every file is written as a temp file renamed into place, so a checkpoint is whole or
// absent; the engine puts a barrier between the rank files and the manifest.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/loss_scaler.hpp"

namespace dssim::tb {

struct RankCheckpoint {
  int64_t step = 0, adam_step = 0;
  DynamicLossScaler::State scaler{};
  at::Tensor master, exp_avg, exp_avg_sq;  // read into in place (their sizes must match)
  std::vector<at::Tensor> extra;           // further optimizer state (1-bit Adam's error buffers), same

};

// What must match to resume: resharding across layouts is not implemented.
struct CheckpointLayout {
  int world = 1, tp = 1, pp = 1, zero_stage = 0;
  std::string dtype;
  int64_t padded_numel = 0;  // of the writing rank 0's partition (compared when pp == 1)
};

std::string checkpoint_step_dir(int64_t step);  // "step-000012"
void write_rank_checkpoint(const std::filesystem::path& dir, int rank, const RankCheckpoint& c);
void write_checkpoint_manifest(const std::filesystem::path& root, int64_t step, const CheckpointLayout& l);
// Reads root/manifest.json and checks it against this run's layout (std::invalid_argument with
// the reason, as --resume errors); returns the directory of the step it names and sets *step.
std::filesystem::path read_checkpoint_manifest(const std::filesystem::path& root, const CheckpointLayout& mine,
                                               int64_t* step);
// Fills c's tensors (and counters) from dir's file of `rank`; `step` is the manifest's.
void read_rank_checkpoint(const std::filesystem::path& dir, int rank, int64_t step, RankCheckpoint& c);

}  // namespace dssim::tb

// ZeRO partitioning of a flat parameter / gradient buffer, as DeepSpeed lays it out, on plain sizes
// so the torch backend can apply it to real tensors and the Program builder to byte counts.
//
// Stage 1/2 (deepspeed/runtime/zero/stage_1_and_2.py): the 16-bit parameters of a group are
// flattened in model order and padded at the end so the total divides dp * alignment
// (nccl_start_alignment_factor * dp); rank r owns [r P, (r + 1) P), P = padded / dp.
// Gradients are reduced in "ipg" buckets filled in the order backward produces them (reverse model
// order): a tensor that would push the bucket past reduce_bucket_size closes the bucket first; a
// tensor larger than the limit gets a bucket of its own. Each bucket is a contiguous range of the
// flat buffer; its per-rank sub-shards are its intersections with the ranks' shards (what
// average_tensor reduces to each owner). The padding belongs to the first bucket (the buffer's end).
// After the step the updated shards are all-gathered in pieces of allgather_bucket_size / dp
// elements per rank (deepspeed/runtime/utils.py all_gather_dp_groups).
//
// Stage 3 (deepspeed/runtime/zero/partition_parameters.py): every tensor is partitioned on its own,
// ceil(numel / dp) elements per rank; parameters are fetched per layer (module), so the partition
// lists per-layer groups.
#pragma once
#include <cstdint>
#include <vector>

namespace dssim {

struct ZeroPartitionSpec {
  std::vector<int64_t> numel;   // parameter tensors, model order
  std::vector<int> layer;       // layer (module) of each tensor, for stage-3 groups; empty = all 0
  // Stage 3 with frozen parameters (core/finetune.hpp): which tensors train (gradients reduced,
  // optimizer state); empty = all. Stages 0-2 leave frozen tensors out of the spec instead.
  std::vector<bool> trainable;
  int dp = 1;
  int64_t alignment = 2;        // DeepSpeed's nccl_start_alignment_factor
  int64_t reduce_bucket_size = 500000000;     // elements
  int64_t allgather_bucket_size = 500000000;  // elements
};

struct Range {
  int64_t begin = 0, count = 0;
  int64_t end() const { return begin + count; }
  bool operator==(const Range&) const = default;
};

struct GradBucket {
  Range range;                 // in the padded flat buffer
  int first_tensor = 0;        // tensors [first_tensor, last_tensor] (model order), all whole
  int last_tensor = 0;
  std::vector<Range> sub_shards;  // [rank]: range ∩ rank's shard (count 0 when disjoint)
};

struct AllGatherBucket {
  int64_t shard_offset = 0;    // offset inside every rank's shard
  int64_t count_per_rank = 0;  // elements each rank contributes; output = dp * count_per_rank
};

struct Stage3Group {
  int layer = 0;
  std::vector<int> tensors;    // model order
  int64_t numel = 0;           // unpadded elements of the group
  int64_t shard_numel = 0;     // elements per rank: sum of ceil(numel_i / dp)
  int64_t padded_numel() const;  // shard_numel * dp (all-gather output / reduce-scatter input)
  int dp = 1;
  // The trainable tensors' part (= the whole group unless ZeroPartitionSpec::trainable says
  // otherwise): what the reduce-scatter moves and the optimizer steps.
  int64_t trainable_numel = 0;
  int64_t trainable_shard_numel = 0;
  int64_t trainable_padded_numel() const { return trainable_shard_numel * dp; }
};

struct ZeroPartition {
  int dp = 1;
  std::vector<int64_t> offsets;  // flat offset of each tensor
  int64_t numel = 0;             // unpadded total
  int64_t padded_numel = 0;      // divisible by dp * alignment
  int64_t shard_numel = 0;       // padded_numel / dp
  std::vector<Range> shards;     // [rank]
  std::vector<GradBucket> grad_buckets;           // in reduction order (reverse model order)
  std::vector<AllGatherBucket> allgather_buckets;
  std::vector<Stage3Group> stage3_groups;         // layer order

  Range shard(int rank) const { return shards[rank]; }
};

// Throws std::invalid_argument on dp < 1, alignment < 1, non-positive bucket sizes or a negative
// tensor size.
ZeroPartition make_zero_partition(const ZeroPartitionSpec& spec);

}  // namespace dssim

#include "core/zero_partition.hpp"

#include <algorithm>
#include <stdexcept>

namespace dssim {

int64_t Stage3Group::padded_numel() const { return shard_numel * dp; }

ZeroPartition make_zero_partition(const ZeroPartitionSpec& spec) {
  if (spec.dp < 1) throw std::invalid_argument("zero partition: dp must be >= 1");
  if (spec.alignment < 1) throw std::invalid_argument("zero partition: alignment must be >= 1");
  // 0 is legal in DeepSpeed (ge=0): reduce_bucket_size 0 flushes the bucket at every tensor,
  // allgather_bucket_size 0 gathers each shard whole (all_gather_into_tensor ignores the size).
  if (spec.reduce_bucket_size < 0 || spec.allgather_bucket_size < 0)
    throw std::invalid_argument("zero partition: bucket sizes must be >= 0 elements");
  if (!spec.layer.empty() && spec.layer.size() != spec.numel.size())
    throw std::invalid_argument("zero partition: one layer per tensor");
  if (!spec.trainable.empty() && spec.trainable.size() != spec.numel.size())
    throw std::invalid_argument("zero partition: one trainable flag per tensor");

  ZeroPartition z;
  z.dp = spec.dp;
  const int n = static_cast<int>(spec.numel.size());
  z.offsets.resize(n);
  for (int i = 0; i < n; ++i) {
    if (spec.numel[i] < 0) throw std::invalid_argument("zero partition: negative tensor size");
    z.offsets[i] = z.numel;
    z.numel += spec.numel[i];
  }
  const int64_t unit = spec.alignment * spec.dp;
  z.padded_numel = (z.numel + unit - 1) / unit * unit;
  if (z.padded_numel == 0) z.padded_numel = unit;  // DeepSpeed keeps at least one aligned slot
  z.shard_numel = z.padded_numel / spec.dp;
  z.shards.reserve(spec.dp);
  for (int r = 0; r < spec.dp; ++r) z.shards.push_back({r * z.shard_numel, z.shard_numel});

  // ipg buckets in backward order.
  const auto close = [&](int first, int last, int64_t begin, int64_t end) {
    GradBucket b;
    b.first_tensor = first;
    b.last_tensor = last;
    b.range = {begin, end - begin};
    b.sub_shards.reserve(z.shards.size());
    for (const Range& s : z.shards) {
      const int64_t lo = std::max(begin, s.begin), hi = std::min(end, s.end());
      b.sub_shards.push_back(hi > lo ? Range{lo, hi - lo} : Range{std::clamp(lo, s.begin, s.end()), 0});
    }
    z.grad_buckets.push_back(std::move(b));
  };
  int last = n - 1;         // highest tensor of the open bucket
  int64_t in_bucket = 0;
  int64_t bucket_end = z.padded_numel;  // the padding rides with the first bucket
  for (int i = n - 1; i >= 0; --i) {
    if (in_bucket > 0 && in_bucket + spec.numel[i] > spec.reduce_bucket_size) {
      close(i + 1, last, z.offsets[i + 1], bucket_end);
      bucket_end = z.offsets[i + 1];
      last = i;
      in_bucket = 0;
    }
    in_bucket += spec.numel[i];
  }
  if (n > 0) close(0, last, 0, bucket_end);
  else close(0, -1, 0, bucket_end);

  // All-gather of the updated shards, allgather_bucket_size elements of output per piece.
  const int64_t piece = spec.allgather_bucket_size == 0
                            ? std::max<int64_t>(1, z.shard_numel)
                            : std::max<int64_t>(spec.alignment, spec.allgather_bucket_size / spec.dp / spec.alignment * spec.alignment);
  for (int64_t off = 0; off < z.shard_numel; off += piece)
    z.allgather_buckets.push_back({off, std::min(piece, z.shard_numel - off)});

  // Stage 3: per-layer groups, per-tensor partitions.
  for (int i = 0; i < n; ++i) {
    const int layer = spec.layer.empty() ? 0 : spec.layer[i];
    if (z.stage3_groups.empty() || z.stage3_groups.back().layer != layer) {
      Stage3Group g;
      g.layer = layer;
      g.dp = spec.dp;
      z.stage3_groups.push_back(g);
    }
    Stage3Group& g = z.stage3_groups.back();
    g.tensors.push_back(i);
    g.numel += spec.numel[i];
    g.shard_numel += (spec.numel[i] + spec.dp - 1) / spec.dp;
    if (spec.trainable.empty() || spec.trainable[i]) {
      g.trainable_numel += spec.numel[i];
      g.trainable_shard_numel += (spec.numel[i] + spec.dp - 1) / spec.dp;
    }
  }
  return z;
}

}  // namespace dssim

#include <catch2/catch.hpp>

#include <numeric>
#include <random>
#include <stdexcept>

#include "core/zero_partition.hpp"

using namespace dssim;

namespace {
// Every property the torch backend relies on.
void check_partition(const ZeroPartitionSpec& spec, const ZeroPartition& z) {
  const int n = int(spec.numel.size());
  const int64_t total = std::accumulate(spec.numel.begin(), spec.numel.end(), int64_t(0));
  REQUIRE(z.numel == total);
  CHECK(z.padded_numel >= total);
  CHECK(z.padded_numel % (spec.dp * spec.alignment) == 0);
  if (total > 0) CHECK(z.padded_numel - total < spec.dp * spec.alignment);
  // Offsets: contiguous, model order.
  for (int i = 0; i < n; ++i)
    CHECK(z.offsets[i] == (i == 0 ? 0 : z.offsets[i - 1] + spec.numel[i - 1]));
  // Shards partition the padded buffer.
  REQUIRE(int(z.shards.size()) == spec.dp);
  int64_t at = 0;
  for (const Range& s : z.shards) {
    CHECK(s.begin == at);
    CHECK(s.count == z.padded_numel / spec.dp);
    at = s.end();
  }
  CHECK(at == z.padded_numel);
  // Buckets: reverse model order, contiguous, cover every element once, whole tensors, size limit.
  std::vector<int> owner(z.padded_numel, 0);
  int expect_last = n - 1;
  int64_t expect_end = z.padded_numel;
  for (const GradBucket& b : z.grad_buckets) {
    CHECK(b.last_tensor == expect_last);
    CHECK(b.range.end() == expect_end);
    for (int64_t e = b.range.begin; e < b.range.end(); ++e) ++owner[e];
    int64_t tensors = 0;
    int nonempty = 0;
    for (int i = b.first_tensor; i <= b.last_tensor; ++i) {
      tensors += spec.numel[i];
      nonempty += spec.numel[i] > 0;
    }
    // Over the limit only when one tensor alone exceeds it (DeepSpeed does not split tensors).
    if (nonempty > 1) CHECK(tensors <= spec.reduce_bucket_size);
    if (n > 0) CHECK(b.range.begin == z.offsets[b.first_tensor]);
    // DeepSpeed fills greedily: the next tensor (in backward order) did not fit.
    if (b.first_tensor > 0) CHECK(tensors + spec.numel[b.first_tensor - 1] > spec.reduce_bucket_size);
    // Sub-shards partition the bucket.
    REQUIRE(int(b.sub_shards.size()) == spec.dp);
    int64_t sub = 0;
    for (int r = 0; r < spec.dp; ++r) {
      const Range& ss = b.sub_shards[r];
      sub += ss.count;
      if (ss.count > 0) {
        CHECK(ss.begin >= z.shards[r].begin);
        CHECK(ss.end() <= z.shards[r].end());
        CHECK(ss.begin >= b.range.begin);
        CHECK(ss.end() <= b.range.end());
      }
    }
    CHECK(sub == b.range.count);
    expect_last = b.first_tensor - 1;
    expect_end = b.range.begin;
  }
  CHECK(expect_end == 0);
  CHECK(std::all_of(owner.begin(), owner.end(), [](int k) { return k == 1; }));
  // All-gather pieces cover each shard once and respect the output limit.
  int64_t ag = 0;
  for (const AllGatherBucket& a : z.allgather_buckets) {
    CHECK(a.shard_offset == ag);
    if (spec.allgather_bucket_size > 0)  // 0: one piece per shard
      CHECK(a.count_per_rank * spec.dp <= std::max(spec.allgather_bucket_size, spec.dp * spec.alignment));
    ag += a.count_per_rank;
  }
  CHECK(ag == z.shard_numel);
}
}  // namespace

TEST_CASE("zero_partition: small hand-checked layout", "[zero_partition]") {
  ZeroPartitionSpec spec;
  spec.numel = {10, 7, 3, 20};  // total 40
  spec.layer = {0, 0, 1, 1};
  spec.dp = 4;
  spec.alignment = 2;           // pad to a multiple of 8 -> 40 stays 40
  spec.reduce_bucket_size = 22;
  spec.allgather_bucket_size = 16;
  const ZeroPartition z = make_zero_partition(spec);
  CHECK(z.offsets == std::vector<int64_t>{0, 10, 17, 20});
  CHECK(z.padded_numel == 40);
  CHECK(z.shard(2) == Range{20, 10});
  // Backward order: 20 (+3 would be 23 > 22) | 3 + 7 (+10 = 20 fits) ... -> {20}, {3,7,10}.
  REQUIRE(z.grad_buckets.size() == 2);
  CHECK(z.grad_buckets[0].range == Range{20, 20});
  CHECK(z.grad_buckets[0].first_tensor == 3);
  CHECK(z.grad_buckets[1].range == Range{0, 20});
  CHECK(z.grad_buckets[1].sub_shards[1] == Range{10, 10});
  CHECK(z.grad_buckets[1].sub_shards[2].count == 0);
  // All-gather: 16 / 4 = 4 elements per rank per piece, shard 10 -> 4, 4, 2.
  REQUIRE(z.allgather_buckets.size() == 3);
  CHECK(z.allgather_buckets[2].count_per_rank == 2);
  // Stage 3 groups per layer, each tensor padded to dp.
  REQUIRE(z.stage3_groups.size() == 2);
  CHECK(z.stage3_groups[0].shard_numel == 3 + 2);
  CHECK(z.stage3_groups[1].shard_numel == 1 + 5);
  CHECK(z.stage3_groups[1].padded_numel() == 24);
  check_partition(spec, z);
}

TEST_CASE("zero_partition: padding as DeepSpeed pads", "[zero_partition]") {
  ZeroPartitionSpec spec;
  spec.numel = {1001};
  spec.dp = 8;
  spec.alignment = 2;
  const ZeroPartition z = make_zero_partition(spec);
  CHECK(z.padded_numel == 1008);
  CHECK(z.shard_numel == 126);
  REQUIRE(z.grad_buckets.size() == 1);
  CHECK(z.grad_buckets[0].range == Range{0, 1008});
  check_partition(spec, z);
  spec.dp = 0;
  CHECK_THROWS_AS(make_zero_partition(spec), std::invalid_argument);
}

TEST_CASE("zero_partition: random layouts keep every invariant", "[zero_partition]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    ZeroPartitionSpec spec;
    const int n = 1 + int(rng() % 30);
    for (int i = 0; i < n; ++i) {
      spec.numel.push_back(int64_t(rng() % 500));
      spec.layer.push_back(i / 4);
    }
    spec.dp = 1 + int(rng() % 9);
    spec.alignment = 1 + int(rng() % 4);
    spec.reduce_bucket_size = 1 + int64_t(rng() % 1500);
    spec.allgather_bucket_size = 1 + int64_t(rng() % 3000);
    INFO("trial " << trial);
    check_partition(spec, make_zero_partition(spec));
  }
}

TEST_CASE("zero_partition: bucket sizes 0 as DeepSpeed runs them", "[zero_partition]") {
  ZeroPartitionSpec spec;
  spec.numel = {10, 7, 3, 20};
  spec.dp = 4;
  spec.alignment = 2;
  spec.reduce_bucket_size = 0;     // the ipg bucket is flushed at every tensor
  spec.allgather_bucket_size = 0;  // all_gather_into_tensor gathers each shard whole
  const ZeroPartition z = make_zero_partition(spec);
  CHECK(z.grad_buckets.size() == 4);
  REQUIRE(z.allgather_buckets.size() == 1);
  CHECK(z.allgather_buckets[0].count_per_rank == z.shard_numel);
  check_partition(spec, z);
}

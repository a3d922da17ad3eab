#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <stdexcept>

#include "core/grid.hpp"

using namespace dssim;

namespace {
ParallelSpec spec(int tp, int pp, int dp, int ep = 1) {
  ParallelSpec p;
  p.tp = tp; p.pp = pp; p.dp = dp; p.ep = ep;
  return p;
}
}  // namespace

TEST_CASE("grid: coordinates round-trip and follow Megatron's order", "[grid]") {
  const ProcessGrid g(spec(4, 3, 4, 2));
  REQUIRE(g.world() == 48);
  for (int r = 0; r < g.world(); ++r) {
    const RankCoord c = g.coord(r);
    CHECK(g.rank_of(c.dp, c.pp, c.tp) == r);
    CHECK(c.ep == (c.tp + 4 * c.dp) % 2);
    CHECK(c.edp == (c.tp + 4 * c.dp) / 2);
  }
  // tp fastest, then dp, then pp.
  CHECK(g.coord(1) == RankCoord{0, 0, 1, 1, 0});
  CHECK(g.coord(4) == RankCoord{1, 0, 0, 0, 2});
  CHECK(g.coord(5) == RankCoord{1, 0, 1, 1, 2});
  CHECK(g.coord(16) == RankCoord{0, 1, 0, 0, 0});
}

TEST_CASE("grid: Megatron's groups for tp=2 pp=4 dp=2 (initialize_model_parallel docstring)", "[grid]") {
  // The docstring example of megatron/core/parallel_state.py: 16 GPUs, 2 TP, 4 PP -> 2 DP.
  const ProcessGrid g(spec(2, 4, 2));
  using V = std::vector<std::vector<int>>;
  CHECK(g.groups(GroupKind::TP) == V{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(g.groups(GroupKind::DP) == V{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(g.groups(GroupKind::PP) == V{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
  CHECK(g.groups(GroupKind::Embedding) == V{{0, 12}, {1, 13}, {2, 14}, {3, 15}});
  CHECK(g.group_of(GroupKind::Embedding, 5).empty());
  CHECK(g.group_index(GroupKind::Embedding, 5) == -1);
}

TEST_CASE("grid: expert groups are carved out of data parallelism", "[grid]") {
  // DeepSpeed's MoE layer with non-TP experts (deepspeed/moe/layer.py _create_process_groups ->
  // deepspeed/utils/groups.py _create_expert_and_data_parallel without mp_size): consecutive ranks of
  // a pipeline stage form the EP groups, the ranks ep apart the expert-data-parallel ones.
  const ProcessGrid g(spec(2, 1, 8, 4));
  CHECK(g.group_of(GroupKind::EP, 0) == std::vector<int>{0, 1, 2, 3});
  CHECK(g.group_of(GroupKind::EP, 9) == std::vector<int>{8, 9, 10, 11});
  CHECK(g.group_of(GroupKind::ExpertDP, 2) == std::vector<int>{2, 6, 10, 14});
  CHECK(g.group_of(GroupKind::ExpertDP, 7) == std::vector<int>{3, 7, 11, 15});
  CHECK(g.coord(9).ep == 1);
  CHECK(g.coord(9).edp == 2);
  // The docstring example of _create_expert_and_data_parallel: 16 ranks, expert_parallel_size 2:
  // EP [0, 1], [2, 3], ...; expert-data-parallel [0, 2, ..., 14], [1, 3, ..., 15]. With tp 2 an
  // EP group is a TP group: the TP peers hold different experts.
  const ProcessGrid d(spec(2, 1, 8, 2));
  CHECK(d.groups(GroupKind::EP) ==
        std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(d.groups(GroupKind::ExpertDP) ==
        std::vector<std::vector<int>>{{0, 2, 4, 6, 8, 10, 12, 14}, {1, 3, 5, 7, 9, 11, 13, 15}});
  // ep 1 with tp 2: every rank of the stage holds every expert, the TP peers too.
  CHECK(ProcessGrid(spec(2, 2, 2, 1)).group_of(GroupKind::ExpertDP, 5) == std::vector<int>{4, 5, 6, 7});
  // tp 1: E consecutive data-parallel ranks, as before.
  const ProcessGrid one(spec(1, 2, 4, 2));
  CHECK(one.group_of(GroupKind::EP, 5) == std::vector<int>{4, 5});
  CHECK(one.group_of(GroupKind::ExpertDP, 5) == std::vector<int>{5, 7});
  CHECK(expert_data_parallel_size(spec(2, 1, 8, 4)) == 4);
  CHECK_THROWS_AS(ProcessGrid(spec(1, 1, 6, 4)), std::invalid_argument);
}

TEST_CASE("grid: the groups of each kind partition the world", "[grid]") {
  for (auto p : {spec(1, 1, 1), spec(2, 4, 2), spec(4, 3, 4, 2), spec(8, 8, 16, 4), spec(1, 2, 8, 8)}) {
    const ProcessGrid g(p);
    for (GroupKind kind : {GroupKind::TP, GroupKind::DP, GroupKind::PP, GroupKind::EP,
                           GroupKind::ExpertDP, GroupKind::World}) {
      INFO("kind " << to_string(kind) << " tp " << p.tp << " pp " << p.pp << " dp " << p.dp);
      std::vector<int> seen(g.world(), 0);
      const auto all = g.groups(kind);
      REQUIRE(int(all.size()) == g.group_count(kind));
      for (size_t i = 0; i < all.size(); ++i) {
        REQUIRE(!all[i].empty());
        CHECK(std::is_sorted(all[i].begin(), all[i].end()));
        for (int r : all[i]) {
          ++seen[r];
          CHECK(g.group_index(kind, r) == int(i));
          CHECK(g.group_of(kind, r) == all[i]);
        }
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
    }
    // Group sizes.
    CHECK(g.group_of(GroupKind::TP, 0).size() == size_t(p.tp));
    CHECK(g.group_of(GroupKind::DP, 0).size() == size_t(p.dp));
    CHECK(g.group_of(GroupKind::PP, 0).size() == size_t(p.pp));
    CHECK(g.group_of(GroupKind::EP, 0).size() == size_t(p.ep));
    CHECK(g.group_of(GroupKind::ExpertDP, 0).size() == size_t(p.tp * p.dp / p.ep));
    // Embedding groups cover exactly the first and last stages, once each.
    std::vector<int> seen(g.world(), 0);
    for (const auto& grp : g.groups(GroupKind::Embedding))
      for (int r : grp) ++seen[r];
    for (int r = 0; r < g.world(); ++r) {
      const int stage = g.coord(r).pp;
      CHECK(seen[r] == ((stage == 0 || stage == p.pp - 1) ? 1 : 0));
    }
  }
}

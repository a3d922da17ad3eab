// Link accounting: the bytes the report puts on each link are the bytes the simulated flows put
// there. Multi-node data parallelism on rail-optimised DGX nodes (one NIC per GPU): NCCL runs a
// collective of S bytes over m members on each of n nodes as one n-node ring per rail over S/m,
// so every NIC carries passes x (n-1)/n x S/m (x the protocol's wire factor) per collective in
// each direction (passes: 2 for an all-reduce, 1 for an all-gather or reduce-scatter).
#include <catch2/catch.hpp>
#include <map>
#include <regex>
#include <string>
#include "backends/sim/sim_backend.hpp"
#include "core/collective_model.hpp"
#include "core/program_builder.hpp"
#include "core/scenario_loader.hpp"

using namespace dssim;

namespace {

Scenario zero3_scenario(const std::string& model, int tp, int dp, int gpn, int nodes) {
  const std::string yaml =
      "name: sim-links\n"
      "model: " + model + "\n"
      "training: {global_batch: " + std::to_string(dp) + ", micro_batch: 1}\n"
      "parallel: {tp: " + std::to_string(tp) + ", pp: 1, dp: " + std::to_string(dp) + "}\n"
      "zero: {stage: 3}\n"
      "precision: fp16\n"
      "cluster: {preset: dgx-a100-hdr, gpus_per_node: " + std::to_string(gpn) +
      ", nics_per_node: " + std::to_string(gpn) + ", nodes: " + std::to_string(nodes) + "}\n";
  return load_scenario_from_string(yaml, {}, "sim-links");
}

// Closed form: bytes each direction of `rank`'s NIC carries in one iteration.
double nic_bytes_closed_form(const Scenario& sc, const Program& p, int rank) {
  const int gpn = sc.cluster.gpus_per_node;
  double total = 0;
  for (const RankProgram& rp : p.ranks) {
    if (rp.rank != rank) continue;
    for (const Instruction& in : rp.instructions) {
      if (!is_collective(in.op) || in.group < 0 || in.bytes <= 0) continue;
      const std::vector<int>& ranks = p.groups[in.group].ranks;
      std::map<int, int> per_node;
      for (int r : ranks) per_node[r / gpn]++;
      const int n = static_cast<int>(per_node.size());
      if (n <= 1) continue;  // inside the node: NVLink only
      const int m = per_node.begin()->second;
      for (auto& [node, k] : per_node) REQUIRE(k == m);  // the rail-optimised layout
      REQUIRE(m > 1);
      REQUIRE(in.op != Op::AllToAll);
      const double passes = in.op == Op::AllReduce ? 2 : 1;
      const double wire = nccl_choice(sc.cluster, in.op, in.bytes, ranks).wire_factor;
      total += std::max(1, in.repeat) * passes * double(n - 1) / n * in.bytes / m * wire;
    }
  }
  return total;
}

struct Links {
  std::map<std::string, double> bytes, utilization;
  double max_class_utilization = 0;
};

Links links_of(const Scenario& sc, bool symmetry) {
  SimOptions o;
  o.symmetry = symmetry;
  o.busiest_links = 1 << 20;  // every link with traffic
  const Report r = simulate(sc, o);
  const auto& l = r.extras.at("sim").at("links");
  Links out;
  for (const auto& e : l.at("busiest")) {
    out.bytes[e.at("name").get<std::string>()] = e.at("bytes").get<double>();
    out.utilization[e.at("name").get<std::string>()] = e.at("utilization").get<double>();
  }
  for (auto& [cls, e] : l.at("classes").items())
    out.max_class_utilization = std::max(out.max_class_utilization, e.at("max_utilization").get<double>());
  return out;
}

void check_nic_bytes(const Scenario& sc) {
  const Program full = build_program(sc);
  const int gpn = sc.cluster.gpus_per_node;
  const Links unfolded = links_of(sc, false), folded = links_of(sc, true);
  const std::regex nic_re("nic-([0-9]+)-([0-9]+)_(UP|DOWN)");
  int unfolded_nics = 0, folded_nics = 0;
  for (const Links* run : {&unfolded, &folded}) {
    const char* what = run == &unfolded ? "unfolded" : "folded";
    INFO(what << " run");
    CHECK(run->max_class_utilization <= 1.0 + 1e-9);
    for (auto& [name, u] : run->utilization) {
      INFO(name);
      CHECK(u <= 1.0 + 1e-9);
    }
    for (auto& [name, b] : run->bytes) {
      std::smatch m;
      if (!std::regex_match(name, m, nic_re)) continue;
      const int rank = std::stoi(m[1]) * gpn + std::stoi(m[2]);
      const double expected = nic_bytes_closed_form(sc, full, rank);
      INFO(name << ": " << b << " bytes, closed form " << expected);
      REQUIRE(expected > 0);
      CHECK(b == Approx(expected).epsilon(1e-9));
      ++(run == &unfolded ? unfolded_nics : folded_nics);
    }
  }
  // Every GPU's NIC carries its share, both directions (the unfolded run has them all).
  CHECK(unfolded_nics == 2 * sc.cluster.nodes * gpn);
  CHECK(folded_nics > 0);
  // Folding changes what is simulated, not what the links carry.
  for (auto& [name, b] : folded.bytes) {
    INFO(name);
    REQUIRE(unfolded.bytes.count(name));
    CHECK(b == Approx(unfolded.bytes.at(name)).epsilon(1e-9));
  }
}

}  // namespace

TEST_CASE("link bytes: multi-node ZeRO-3 data parallelism puts each rail's ring on its own NIC", "[links]") {
  SECTION("dp 16 on 4 nodes of 4 GPUs, 4 NICs each") {
    check_nic_bytes(zero3_scenario("{preset: gpt-350m, layers: 4}", 1, 16, 4, 4));
  }
  SECTION("tp 2 (folded) x dp 4 on 2 nodes of 4 GPUs: 2 DP members per node") {
    check_nic_bytes(zero3_scenario("{preset: gpt-350m, layers: 4}", 2, 4, 4, 2));
  }
  SECTION("the reported case: gpt-1.3b, dp 16 on 2 DGX A100 nodes") {
    check_nic_bytes(zero3_scenario("{preset: gpt-1.3b, seq_len: 1024}", 1, 16, 8, 2));
  }
}

// Send/recv plans are built once per (source, destination, bytes) and reused by every micro-batch:
// each reuse still charges its bytes. Two pipeline stages on two one-GPU nodes, m micro-batches:
// stage 0's NIC sends every activation, stage 1's every activation gradient, so each NIC's up link
// carries the sum of its rank's Send instructions (x repeat), m of them each (embeddings untied:
// no embedding all-reduce between the stages).
TEST_CASE("link bytes: every pipeline send is charged to its NIC, micro-batch after micro-batch", "[links]") {
  const int m = 6;
  const std::string yaml =
      "name: sim-links-pp\n"
      "model: {preset: gpt-350m, layers: 4, tied_embeddings: false}\n"
      "training: {global_batch: " + std::to_string(m) + ", micro_batch: 1}\n"
      "parallel: {tp: 1, pp: 2, dp: 1}\n"
      "precision: fp16\n"
      "cluster: {preset: dgx-a100-hdr, gpus_per_node: 1, nics_per_node: 1, nodes: 2}\n";
  const Scenario sc = load_scenario_from_string(yaml, {}, "sim-links-pp");
  const Program full = build_program(sc);
  const Links l = links_of(sc, false);
  for (int rank = 0; rank < 2; ++rank) {
    double sent = 0;
    int sends = 0;
    for (const RankProgram& rp : full.ranks) {
      if (rp.rank != rank) continue;
      for (const Instruction& in : rp.instructions)
        if (in.op == Op::Send && in.bytes > 0) { sent += std::max(1, in.repeat) * in.bytes; ++sends; }
    }
    const std::string name = "nic-" + std::to_string(rank) + "-0_UP";
    INFO(name);
    CHECK(sends == m);
    REQUIRE(l.bytes.count(name));
    CHECK(l.bytes.at(name) == Approx(sent).epsilon(1e-12));
  }
}

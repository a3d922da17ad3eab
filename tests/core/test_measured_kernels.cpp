// `dssim compare` prices the fused kernels the measured run took (validation/compare.hpp
// apply_measured_kernels): a `dssim run --json` report with and without extras.measured's
// gemm_epilogues / cross_entropy_kernel, and the records made from it.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>
#include "core/memory.hpp"
#include "scenario_test_util.hpp"
#include "validation/compare.hpp"

using namespace dssim;

TEST_CASE("compare prices the measured run's kernels - reports without them leave the scenario as it is", "[epilogues]") {
  const std::string y = dssim::test::tiny_yaml_with_model("  cross_entropy: fused_linear\n");
  nlohmann::json report = {{"backend", "cuda"}, {"extras", {{"measured", {{"memory_bytes", {{"peak", 1.0}}}}}}}};
  Scenario sc = load_scenario_from_string(y);
  CHECK(validation::apply_measured_kernels(sc, report).empty());  // an older report
  CHECK_FALSE(sc.model.gemm_epilogues);
  CHECK_FALSE(sc.model.cross_entropy_kernel);
  report["extras"]["measured"]["gemm_epilogues"] = "fgb";
  report["extras"]["measured"]["cross_entropy_kernel"] = true;
  CHECK(validation::apply_measured_kernels(sc, report) ==
        "priced with the run's kernels: GEMM epilogues on, cross-entropy kernel on");
  CHECK(sc.model.gemm_epilogues);
  CHECK(sc.model.cross_entropy_kernel);
  // The record's scenario says what ran, and re-predicts with it.
  const nlohmann::json record = validation::make_record(sc, report, "NVIDIA H100", "test");
  const Scenario back = validation::record_scenario(record, "r.json");
  CHECK(back.model.gemm_epilogues);
  CHECK(back.model.cross_entropy_kernel);
  for (const char* mode : {"none", "off"}) {
    report["extras"]["measured"]["gemm_epilogues"] = mode;
    report["extras"]["measured"]["cross_entropy_kernel"] = false;
    Scenario s = load_scenario_from_string(y + "");
    s.model.gemm_epilogues = true;  // the scenario's key loses to what ran
    CHECK(validation::apply_measured_kernels(s, report) ==
          "priced with the run's kernels: GEMM epilogues off, cross-entropy kernel off");
    CHECK_FALSE(s.model.gemm_epilogues);
  }
  // Not fused_linear: the cross-entropy kernel never applies.
  Scenario plain = load_scenario_from_string(dssim::test::tiny_yaml());
  report["extras"]["measured"]["cross_entropy_kernel"] = true;
  validation::apply_measured_kernels(plain, report);
  CHECK_FALSE(plain.model.cross_entropy_kernel);
  // An old record (no fields in its report) re-predicts as written.
  nlohmann::json old = validation::make_record(load_scenario_from_string(y), {{"extras", {{"measured", nlohmann::json::object()}}}},
                                               "NVIDIA H200", "test");
  CHECK_FALSE(validation::record_scenario(old, "o.json").model.gemm_epilogues);
}

TEST_CASE("compare: a ZeRO-3 run that folded where the model prices no fold is not like for like", "[epilogues][zero3]") {
  // One rank, ZeRO-3, partition in the training dtype: the model prices backward into the partition.
  const Scenario direct = load_scenario_from_string(dssim::test::tiny_yaml("  tp: 1\n  pp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 1\n",
                                                                           "zero:\n  stage: 3\n"));
  REQUIRE(zero3_backward_into_partition(direct));
  nlohmann::json report = {{"backend", "cuda"}, {"extras", {{"measured", {{"memory_bytes", {{"peak", 1.0}}}}}}}};
  CHECK(validation::unpriced_departure(direct, report).empty());  // reports before the field
  report["extras"]["measured"]["zero3_backward_into_partition"] = true;
  CHECK(validation::unpriced_departure(direct, report).empty());
  report["extras"]["measured"]["zero3_backward_into_partition"] = false;  // DSSIM_ZERO3_FOLD=1
  CHECK_THAT(validation::unpriced_departure(direct, report), Catch::Contains("DSSIM_ZERO3_FOLD"));
  // Where the model prices the fold itself (two ranks), a folding run is like for like.
  const Scenario two = load_scenario_from_string(dssim::test::tiny_yaml("  tp: 1\n  pp: 1\n", "  preset: single-node-pcie\n  gpus_per_node: 2\n",
                                                                        "zero:\n  stage: 3\n"));
  REQUIRE_FALSE(zero3_backward_into_partition(two));
  CHECK(validation::unpriced_departure(two, report).empty());
}

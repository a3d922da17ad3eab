// The ds_config corpus (issue 19): tests/data/ds_configs/corpus/manifest.json lists ds_config files
// written in the styles of DeepSpeedExamples, Megatron-DeepSpeed, DeepSpeed's tests, Hugging Face
// accelerate / transformers, LLaMA-Factory, FastChat, Stanford Alpaca and BigScience, each with what
// dssim must make of it on every scenario listed: mapped values, warnings, or an error naming the key.
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>
#include "core/scenario_loader.hpp"
#include "scenario_test_util.hpp"

using namespace dssim;
using namespace dssim::test;
using json = nlohmann::json;

namespace {

// The resolved value at a dotted key path, as to_yaml writes it.
YAML::Node resolved(const Scenario& s, const std::string& key) {
  YAML::Node n = YAML::Load(to_yaml(s));
  std::stringstream path(key);
  std::string part;
  while (std::getline(path, part, '.')) {
    if (!n.IsMap() || !n[part]) return YAML::Node();
    n.reset(n[part]);
  }
  return n;
}

bool same(const YAML::Node& got, const json& want) {
  if (!got.IsDefined()) return false;
  if (want.is_array()) {
    if (!got.IsSequence() || got.size() != want.size()) return false;
    for (size_t i = 0; i < want.size(); ++i)
      if (!same(got[i], want[i])) return false;
    return true;
  }
  if (!got.IsScalar()) return false;
  if (want.is_boolean()) return got.as<bool>() == want.get<bool>();
  if (want.is_number()) {
    const double g = got.as<double>(), w = want.get<double>();
    return std::abs(g - w) <= 1e-12 * std::max(1.0, std::abs(w));
  }
  return got.Scalar() == want.get<std::string>();
}

}  // namespace

TEST_CASE("ds_config corpus: every file does what its manifest says on every scenario", "[deepspeed][corpus]") {
  const std::string dir = std::string(DSSIM_TEST_DATA_DIR) + "/ds_configs/corpus/";
  std::ifstream in(dir + "manifest.json");
  REQUIRE(in);
  const json manifest = json::parse(in);
  const auto& files = manifest.at("files");
  REQUIRE(files.size() >= 60);
  int checked = 0, errors = 0;
  for (const auto& f : files) {
    const std::string file = f.at("file");
    for (auto sc = manifest.at("scenarios").begin(); sc != manifest.at("scenarios").end(); ++sc) {
      // expectations: the file's, then the scenario's
      json expect = f.value("expect", json::object());
      json warnings = f.value("warnings", json::array());
      json once = f.value("warnings_once", json::array());
      json none = f.value("warnings_none", json::array());
      std::string error = f.value("error", "");
      if (f.contains("per_scenario") && f.at("per_scenario").contains(sc.key())) {
        const json& p = f.at("per_scenario").at(sc.key());
        const json pe = p.value("expect", json::object());
        for (auto it = pe.begin(); it != pe.end(); ++it) expect[it.key()] = it.value();
        for (const auto& w : p.value("warnings", json::array())) warnings.push_back(w);
        if (p.contains("error")) error = p.at("error");
      }
      LoadOptions o;
      o.deepspeed_config = dir + file;
      INFO(file << " on " << sc.key());
      if (!error.empty()) {
        const std::string msg = config_error([&] { load_scenario(shipped(sc.value()), o); });
        CHECK_THAT(msg, Catch::Contains(error));
        // the file is named, or (DeepSpeed's batch rules, checked over the whole scenario) the ds key
        CHECK_THAT(msg, Catch::Contains(file) || Catch::Contains("(ds_config "));
        ++errors;
        continue;
      }
      Scenario s;
      try {
        s = load_scenario(shipped(sc.value()), o);
      } catch (const ConfigError& e) {
        FAIL_CHECK("refused: " << e.what());
        continue;
      }
      for (auto it = expect.begin(); it != expect.end(); ++it) {
        const YAML::Node got = resolved(s, it.key());
        INFO(it.key() << ": got " << (got.IsDefined() ? YAML::Dump(got) : "nothing") << ", want " << it.value().dump());
        CHECK(same(got, it.value()));
      }
      for (const auto& w : warnings) {
        INFO("warning containing: " << w.get<std::string>());
        CHECK(has_warning_with(s, w.get<std::string>()));
      }
      for (const auto& w : once) {
        int n = 0;
        for (const auto& x : s.warnings) n += x.find(w.get<std::string>()) != std::string::npos;
        INFO("exactly one warning containing: " << w.get<std::string>());
        CHECK(n == 1);
      }
      for (const auto& w : none) {
        INFO("no warning containing: " << w.get<std::string>());
        CHECK_FALSE(has_warning_with(s, w.get<std::string>()));
      }
      ++checked;
    }
  }
  CHECK(checked > 60);
  CHECK(errors > 20);
}

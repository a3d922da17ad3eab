#include "validation/harness.hpp"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>

#include "core/memory.hpp"
#include "core/scenario_loader.hpp"
#include "validation/compare.hpp"

#include <fstream>

namespace dssim::validation {

namespace fs = std::filesystem;

namespace {

template <class T>
T required(const YAML::Node& n, const std::string& key, const std::string& file) {
  if (!n[key]) throw ConfigError(file + ": missing key '" + key + "'");
  try {
    return n[key].as<T>();
  } catch (const YAML::Exception&) {
    throw ConfigError(file + ": key '" + key + "' at line " + std::to_string(n[key].Mark().line + 1) +
                      " has the wrong type");
  }
}

void score(Table& t) {
  double sum = 0;
  t.max_abs_error = 0;
  for (Row& r : t.rows) {
    r.error = (r.predicted - r.published) / r.published;
    sum += std::fabs(r.error);
    t.max_abs_error = std::max(t.max_abs_error, std::fabs(r.error));
  }
  t.mean_abs_error = t.rows.empty() ? 0 : sum / t.rows.size();
}

// tokens_per_second_per_gpu: the whole job's tokens/s over its GPUs, as llm-foundry's
// "Throughput (T/s/GPU)" and torchtitan's "TPS/GPU" report it.
double metric_of(const Report& r, const std::string& metric, const std::string& file, int gpus) {
  if (metric == "hardware_tflops_per_gpu") return r.hardware_tflops_per_gpu;
  if (metric == "model_tflops_per_gpu") return r.model_tflops_per_gpu;
  if (metric == "iteration_seconds") return r.iteration_seconds;
  if (metric == "tokens_per_second") return r.tokens_per_second;
  if (metric == "tokens_per_second_per_gpu") return r.tokens_per_second / gpus;
  if (metric == "peak_memory_gib_per_gpu") return r.memory.total() / (1024.0 * 1024.0 * 1024.0);
  throw ConfigError(file + ": unknown metric '" + metric +
                    "' (hardware_tflops_per_gpu, model_tflops_per_gpu, iteration_seconds, tokens_per_second, "
                    "tokens_per_second_per_gpu, peak_memory_gib_per_gpu)");
}

void throughput_rows(Table& t, const YAML::Node& doc, const Predictor& predict) {
  YAML::Emitter base;
  base << doc["scenario"];
  for (const YAML::Node& row : doc["rows"]) {
    Row r;
    r.label = required<std::string>(row, "label", t.file);
    r.published = required<double>(row, "published", t.file);
    LoadOptions lo;
    if (row["set"]) lo.overrides = row["set"].as<std::vector<std::string>>();
    const Scenario sc = load_scenario_from_string(base.c_str(), lo, t.file + " row " + r.label);
    const Report rep = predict(sc);
    r.predicted = metric_of(rep, t.metric, t.file, sc.cluster.world());
    r.detail = {{"gpus", sc.cluster.world()}, {"tp", sc.parallel.tp}, {"pp", sc.parallel.pp},
                {"dp", sc.parallel.dp}, {"interleave", sc.parallel.interleave},
                {"micro_batch", sc.training.micro_batch}, {"grad_accum", sc.training.grad_accum},
                {"iteration_seconds", rep.iteration_seconds}, {"parameters", rep.parameters},
                {"bubble_seconds", rep.time.bubble}, {"fits", rep.fits}};
    t.rows.push_back(std::move(r));
  }
}

void zero_rows(Table& t, const YAML::Node& doc) {
  const YAML::Node models = doc["models"];
  static const char* columns[] = {"P_os", "P_os+g", "P_os+g+p"};
  for (const YAML::Node& row : doc["rows"]) {
    const std::string model = row[0].as<std::string>();
    if (!models[model]) throw ConfigError(t.file + ": row names model '" + model + "' missing from 'models'");
    const double psi = models[model].as<double>();
    const int n = row[1].as<int>();
    for (int stage = 1; stage <= 3; ++stage) {
      Row r;
      r.label = model + " N=" + std::to_string(n) + " " + columns[stage - 1];
      r.published = row[1 + stage].as<double>();
      r.predicted = zero_model_state_bytes(psi, stage, n) / 1e9;
      t.rows.push_back(std::move(r));
    }
  }
}

// validation/measured/*.json: runs measured on real GPUs (measurement records, compare.hpp), each
// re-predicted: iteration time and peak memory per GPU.
Table measured_table(const std::string& dir, const Predictor& predict) {
  Table t;
  t.name = "measured_runs";
  t.file = "measured/";
  t.kind = "measured";
  t.metric = "iteration_seconds and peak memory per GPU";
  t.unit = "s, GiB";
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".json") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  std::set<std::string> gpus, dates;
  for (const auto& f : files) {
    nlohmann::json rec;
    try {
      std::ifstream in(f);
      rec = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      throw ConfigError(f + ": not valid JSON: " + e.what());
    }
    const std::string name = fs::path(f).stem().string();
    const Scenario sc = record_scenario(rec, f);
    const Report pred = predict(sc);
    const nlohmann::json& m = rec.at("report");
    gpus.insert(rec.value("gpu", std::string("?")));
    dates.insert(rec.value("date", std::string("?")));
    Row it{name + " iteration", m.at("throughput").value("iteration_seconds", 0.0), pred.iteration_seconds};
    Row mem{name + " peak memory",
            m.at("extras").at("measured").at("memory_bytes").value("peak", 0.0) / (1 << 30),
            pred.memory.total() / (1 << 30)};
    t.rows.push_back(it);
    t.rows.push_back(mem);
  }
  auto join = [](const std::set<std::string>& v) {
    std::string r;
    for (const auto& x : v) r += (r.empty() ? "" : ", ") + x;
    return r;
  };
  t.citation = "measured by `dssim compare --record` on " + join(gpus) + " (" + join(dates) + ")";
  score(t);
  return t;
}

void apply_thresholds(Table& t, const YAML::Node& thresholds) {
  if (!thresholds[t.name]) return;
  t.allowed_max = thresholds[t.name]["max_abs_error"].as<double>(-1);
  t.allowed_mean = thresholds[t.name]["mean_abs_error"].as<double>(-1);
}

}  // namespace

Table run_table(const std::string& path, const Predictor& predict) {
  YAML::Node doc;
  try {
    doc = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    throw ConfigError(path + ": " + e.what());
  }
  Table t;
  t.file = fs::path(path).filename().string();
  t.name = required<std::string>(doc, "name", t.file);
  t.citation = required<std::string>(doc, "citation", t.file);
  t.kind = required<std::string>(doc, "kind", t.file);
  t.metric = required<std::string>(doc, "metric", t.file);
  t.unit = required<std::string>(doc, "unit", t.file);
  if (t.kind == "throughput") {
    throughput_rows(t, doc, predict);
  } else if (t.kind == "zero_model_states") {
    zero_rows(t, doc);
  } else {
    throw ConfigError(t.file + ": unknown kind '" + t.kind + "' (throughput, zero_model_states)");
  }
  score(t);
  return t;
}

std::vector<Table> run_validation(const std::string& dir, const Predictor& predict) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(fs::path(dir) / "published"))
    if (e.path().extension() == ".yaml") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  YAML::Node thresholds;
  const fs::path tpath = fs::path(dir) / "thresholds.yaml";
  if (fs::exists(tpath)) thresholds = YAML::LoadFile(tpath.string());
  std::vector<Table> out;
  for (const auto& f : files) {
    Table t = run_table(f, predict);
    apply_thresholds(t, thresholds);
    out.push_back(std::move(t));
  }
  const fs::path measured = fs::path(dir) / "measured";
  if (fs::is_directory(measured) && !fs::is_empty(measured)) {
    Table t = measured_table(measured.string(), predict);
    apply_thresholds(t, thresholds);
    if (!t.rows.empty()) out.push_back(std::move(t));
  }
  return out;
}

std::string to_text(const std::vector<Table>& tables, bool verbose) {
  std::ostringstream o;
  char buf[512];
  for (const Table& t : tables) {
    o << t.name << " (" << t.metric << ", " << t.unit << ")\n";
    if (verbose) o << "  " << t.citation << "\n";
    std::snprintf(buf, sizeof buf, "  %-24s %12s %12s %9s\n", "row", t.kind == "measured" ? "measured" : "published", "predicted", "error");
    o << buf;
    for (const Row& r : t.rows) {
      std::snprintf(buf, sizeof buf, "  %-24s %12.4g %12.4g %+8.1f%%\n", r.label.c_str(), r.published, r.predicted,
                    100 * r.error);
      o << buf;
    }
    std::snprintf(buf, sizeof buf, "  mean |error| %.2f%%  max |error| %.2f%%", 100 * t.mean_abs_error,
                  100 * t.max_abs_error);
    o << buf;
    if (t.allowed_max >= 0)
      o << "  (thresholds: mean " << 100 * t.allowed_mean << "%, max " << 100 * t.allowed_max << "%)  "
        << (t.pass() ? "PASS" : "FAIL");
    o << "\n\n";
  }
  return o.str();
}

nlohmann::json to_json(const std::vector<Table>& tables) {
  nlohmann::json j;
  j["schema"] = "dssim.validate/1";
  j["tables"] = nlohmann::json::array();
  for (const Table& t : tables) {
    nlohmann::json rows = nlohmann::json::array();
    for (const Row& r : t.rows)
      rows.push_back({{"label", r.label}, {"published", r.published}, {"predicted", r.predicted},
                      {"error", r.error}, {"detail", r.detail}});
    j["tables"].push_back({{"name", t.name}, {"citation", t.citation}, {"kind", t.kind}, {"metric", t.metric},
                           {"unit", t.unit}, {"rows", rows}, {"mean_abs_error", t.mean_abs_error},
                           {"max_abs_error", t.max_abs_error}, {"allowed_mean_abs_error", t.allowed_mean},
                           {"allowed_max_abs_error", t.allowed_max}, {"pass", t.pass()}});
  }
  return j;
}

}  // namespace dssim::validation

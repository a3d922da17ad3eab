// `dssim compare FILE.yaml --backend cuda|cpu`: the scenario predicted (simulator, or the analytic
// estimator where dssim was built without SimGrid) and trained for real by `dssim run`, side by
// side per instruction kind, then iteration time, throughput and peak memory.
// `--measured RECORD.json` compares against a committed measurement instead of running one;
// `--record OUT.json` writes the measurement record (validation/measured/ holds them).
#include <boost/program_options.hpp>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cli/output_file.hpp"
#include "cli/options.hpp"
#include "cli/predictors.hpp"
#include "cli/verbs.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"
#include "validation/compare.hpp"

namespace po = boost::program_options;

namespace dssim::cli {

namespace {

// The GPU a record names: the run's own (`dssim run --backend cuda` reports measured.device), else
// the scenario's; "cpu" for a CPU run.
std::string measured_gpu_name(const Scenario& sc, const nlohmann::json& run) {
  if (run.value("backend", std::string()) != "cuda") return "cpu";
  const auto& m = run.at("extras").at("measured");
  const std::string device = m.value("device", std::string());
  return device.empty() ? sc.cluster.gpu.name : device;
}

// A JSON file named by an option, with errors that say which option and file.
nlohmann::json read_json(const std::string& option, const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(option + ": cannot read '" + path + "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw ConfigError(option + ": " + path + " is not valid JSON: " + e.what());
  }
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string self_exe() {
  std::array<char, 4096> buf{};
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  return n > 0 ? std::string(buf.data(), n) : std::string("dssim");
}

}  // namespace

int verb_compare(int argc, char** argv) {
  po::options_description opts("dssim compare FILE.yaml --backend cuda|cpu [options]");
  opts.add_options()
      ("help,h", "show this help")
      ("backend", po::value<std::string>(), "measure with `dssim run --backend` cuda or cpu")
      ("measured", po::value<std::string>(), "compare against this measurement record instead of running")
      ("run-json", po::value<std::string>(), "use this `dssim run --json` output of FILE.yaml (measured elsewhere, e.g. on a GPU machine)")
      ("record", po::value<std::string>(), "write the measurement record (JSON) to this file")
      ("gpu-name", po::value<std::string>()->default_value(""), "GPU named in the record (default: the scenario's)")
      ("predictor", po::value<std::string>()->default_value(default_predictor()), "sim or analytic")
      ("steps", po::value<int>()->default_value(10), "training steps to measure (median after warm-up)")
      ("nproc", po::value<int>()->default_value(0), "local ranks for `dssim run` (0: one)")
      ("deepspeed_config", po::value<std::string>(), "a ds_config.json mapped onto the scenario")
      ("set", po::value<std::vector<std::string>>()->composing(), "override a key (repeatable)")
      ("json", "print the comparison as JSON (schema dssim.compare/1)");
  po::variables_map vm;
  if (auto rc = parse_options("compare", argc, argv, opts, vm, true)) return *rc;
  const std::string predictor = vm["predictor"].as<std::string>();
  if (!has_predictor(predictor)) {
    std::fprintf(stderr, "dssim compare: unknown --predictor '%s' (available: %s)\n", predictor.c_str(),
                 available_predictors().c_str());
    return 2;
  }
  if (vm.count("measured") + vm.count("backend") + vm.count("run-json") != 1) {
    std::fprintf(stderr, "dssim compare: give one of --backend cuda|cpu (measure now), --run-json RUN.json "
                         "(a measurement of FILE.yaml) or --measured RECORD.json\n");
    return 2;
  }
  try {
    Scenario sc;
    nlohmann::json measured, record;
    LoadOptions lo;
    if (vm.count("deepspeed_config")) lo.deepspeed_config = vm["deepspeed_config"].as<std::string>();
    if (vm.count("set")) lo.overrides = vm["set"].as<std::vector<std::string>>();
    if (vm.count("measured")) {
      const std::string path = vm["measured"].as<std::string>();
      record = read_json("--measured", path);
      sc = validation::record_scenario(record, path);
      measured = record.at("report");
    } else {
      if (!vm.count("file")) throw ConfigError("missing FILE.yaml");
      sc = load_scenario(vm["file"].as<std::string>(), lo);
      if (vm.count("run-json")) {
        const std::string path = vm["run-json"].as<std::string>();
        measured = read_json("--run-json", path);
        if (!measured.contains("extras") || !measured["extras"].contains("measured"))
          throw ConfigError("--run-json: " + path + " is not a `dssim run --json` report (no extras.measured)");
        validation::apply_measured_kernels(sc, measured);  // the record's scenario says what ran
        std::string gpu = vm["gpu-name"].as<std::string>();
        if (gpu.empty()) gpu = measured_gpu_name(sc, measured);
        record = validation::make_record(sc, measured, gpu, "dssim run " + vm["file"].as<std::string>() + " --json");
      }
    }
    if (vm.count("backend")) {
      const std::string backend = vm["backend"].as<std::string>();
      if (backend != "cuda" && backend != "cpu") throw ConfigError("--backend must be cuda or cpu");
      std::string cmd = quote(self_exe()) + " run " + quote(vm["file"].as<std::string>()) + " --backend " + backend +
                        " --json --steps " + std::to_string(vm["steps"].as<int>());
      if (vm["nproc"].as<int>() > 0) cmd += " --nproc " + std::to_string(vm["nproc"].as<int>());
      if (vm.count("deepspeed_config")) cmd += " --deepspeed_config " + quote(lo.deepspeed_config);
      for (const auto& s : lo.overrides) cmd += " --set " + quote(s);
      std::fprintf(stderr, "dssim compare: measuring: %s\n", cmd.c_str());
      std::fflush(stderr);
      FILE* pipe = ::popen(cmd.c_str(), "r");
      if (!pipe) throw std::runtime_error("cannot start `dssim run`");
      std::string out;
      std::array<char, 65536> buf;
      for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0;) out.append(buf.data(), n);
      const int status = ::pclose(pipe);
      if (status != 0) {
        std::fprintf(stderr, "dssim compare: the measurement (`dssim run`) failed (status %d); see its messages above\n",
                     status);
        return 1;
      }
      try {
        measured = nlohmann::json::parse(out);
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string("`dssim run --json` printed no JSON report: ") + e.what());
      }
      validation::apply_measured_kernels(sc, measured);
      std::string gpu = vm["gpu-name"].as<std::string>();
      if (gpu.empty()) gpu = measured_gpu_name(sc, measured);
      record = validation::make_record(sc, measured, gpu, "dssim compare " + vm["file"].as<std::string>() +
                                                             " --backend " + backend);
    }
    const validation::Comparison c = validation::compare(sc, predict_with_kinds(sc, predictor), measured);
    if (vm.count("record") && !c.unpriced.empty())
      throw ConfigError("--record: " + c.unpriced + "; a record must be priced like for like: measure again without it");
    if (vm.count("record")) write_file_atomically(vm["record"].as<std::string>(), record.dump(1) + "\n");
    if (vm.count("json"))
      std::cout << c.to_json().dump(2) << "\n";
    else
      std::cout << c.to_text();
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "dssim compare: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim compare: failed: %s\n", e.what());
    return 1;
  }
}

}  // namespace dssim::cli

// `dssim scenario FILE.yaml`: the predicted report of one training iteration.
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "cli/output_file.hpp"
#include "cli/options.hpp"
#include "cli/predictors.hpp"
#include "cli/verbs.hpp"
#include "core/estimator.hpp"
#include "core/fit_advisor.hpp"
#ifdef DSSIM_HAVE_SIM
#include "backends/sim/sim_backend.hpp"
#endif
#include "core/report.hpp"
#include "core/reliability.hpp"
#include "core/scenario_loader.hpp"
#include "core/what_if.hpp"

namespace po = boost::program_options;

namespace dssim::cli {

int verb_scenario(int argc, char** argv) {
  po::options_description opts("dssim scenario FILE.yaml [options]");
  opts.add_options()
      ("help,h", "show this help")
      ("deepspeed_config", po::value<std::string>(), "a DeepSpeed ds_config.json mapped onto the scenario")
      ("set", po::value<std::vector<std::string>>()->composing(), "override a key: --set parallel.pp=16 (repeatable)")
      ("gpus", po::value<int>()->default_value(0), "resize the cluster to N GPUs (data parallelism absorbs it)")
      ("backend", po::value<std::string>()->default_value(default_predictor()),
       "analytic (closed form over the Program) or sim (SimGrid cluster model)")
      ("trace", po::value<std::string>(), "sim: write a Chrome trace / Perfetto timeline (JSON) to this file")
      ("trace-ranks", po::value<std::string>(), "sim: comma-separated ranks to put in the trace (default: all simulated)")
      ("collective-detail", po::value<std::string>()->default_value("phase"),
       "sim: phase (one set of concurrent flows per collective phase) or step (every ring step)")
      ("what-if", po::value<std::vector<std::string>>()->composing(),
       "sim: a what-if compared with the clean run (repeatable): 'slow-gpu RANKS xF', 'link NAME xF', 'nic NODE.I xF', "
       "'node N down-links xF', 'noise P%', 'background-traffic F' (docs/simulator.md)")
      ("seed", po::value<uint64_t>()->default_value(1), "sim: the noise what-if's first seed")
      ("samples", po::value<int>()->default_value(1), "sim: iterations drawn with the noise what-if (seeds seed, seed+1, ...)")
      ("reliability", "report failures, checkpoints and goodput over the run (defaults, or the scenario's reliability: section)")
      ("json", "print the report as JSON (keys: docs/report-json.md)")
      ("output,o", po::value<std::string>(), "also write the JSON report to this file (atomically)")
      ("verbose,v", "more detail: zero rows, bytes per collective");
  // Exit codes: 0 report printed and it fits; 2 bad input; 3 report printed but it does not fit
  // in GPU memory; 1 internal failure.
  po::variables_map vm;
  if (auto rc = parse_options("scenario", argc, argv, opts, vm, true)) return *rc;
  if (!vm.count("file")) {
    std::fprintf(stderr, "dssim scenario: missing FILE.yaml (e.g. dssim scenario scenarios/gpt175b.yaml)\n");
    return 2;
  }
  const std::string backend = vm["backend"].as<std::string>();
  if (!has_predictor(backend)) {
    std::fprintf(stderr, "dssim scenario: unknown --backend '%s' (available: %s)\n", backend.c_str(),
                 available_predictors().c_str());
    return 2;
  }
  if (backend != "sim" && (vm.count("trace") || vm.count("trace-ranks"))) {
    std::fprintf(stderr, "dssim scenario: --trace needs --backend sim\n");
    return 2;
  }
  LoadOptions lo;
  if (vm.count("deepspeed_config")) lo.deepspeed_config = vm["deepspeed_config"].as<std::string>();
  if (vm.count("set")) lo.overrides = vm["set"].as<std::vector<std::string>>();
  lo.gpus = vm["gpus"].as<int>();
  try {
    const Scenario sc = load_scenario(vm["file"].as<std::string>(), lo);
    std::vector<WhatIf> what_ifs = sc.what_if;
    if (vm.count("what-if"))
      for (const std::string& spec : vm["what-if"].as<std::vector<std::string>>()) what_ifs.push_back(parse_what_if(spec));
    check_what_ifs(sc, what_ifs);
    if (!what_ifs.empty() && backend != "sim")
      throw ConfigError("what-ifs (--what-if, the scenario's what_if list) need the simulator: use --backend sim" +
                        std::string(has_predictor("sim") ? "" : " (this build has no SimGrid)"));
    if (vm["samples"].as<int>() < 1)
      throw ConfigError("--samples must be at least 1, got " + std::to_string(vm["samples"].as<int>()));
    Report r;
#ifdef DSSIM_HAVE_SIM
    if (backend == "sim") {
      SimOptions so;
      if (vm.count("trace")) so.trace_path = vm["trace"].as<std::string>();
      if (vm.count("trace-ranks")) {
        std::istringstream list(vm["trace-ranks"].as<std::string>());
        for (std::string item; std::getline(list, item, ',');) {
          try {
            so.trace_ranks.push_back(std::stoi(item));
          } catch (const std::exception&) {
            throw ConfigError("--trace-ranks: '" + item + "' is not a rank number (e.g. --trace-ranks 0,8,16)");
          }
        }
      }
      try {
        so.detail = parse_collective_detail(vm["collective-detail"].as<std::string>());
      } catch (const std::invalid_argument& e) {
        throw ConfigError(std::string("--collective-detail: ") + e.what());
      }
      so.what_ifs = what_ifs;
      so.noise_seed = vm["seed"].as<uint64_t>();
      r = what_ifs.empty() ? simulate(sc, so) : simulate_what_if(sc, so, vm["samples"].as<int>());
      if (!r.fits) r.suggestions = fit_suggestions(sc);
    } else
#endif
    r = analytic_report(sc);
    if (vm.count("reliability") || sc.reliability.declared) {
      double it = r.iteration_seconds;
      if (r.extras.contains("what_if") && r.extras["what_if"].contains("noise"))
        it = r.extras["what_if"]["noise"]["mean_seconds"].get<double>();
      r.extras["reliability"] = goodput_json(goodput_report(sc, it));
    }
    const nlohmann::json j = report_json(sc, r);
    if (vm.count("output")) write_file_atomically(vm["output"].as<std::string>(), j.dump(2) + "\n");
    if (vm.count("json"))
      std::cout << j.dump(2) << "\n";
    else
      std::cout << report_text(sc, r, vm.count("verbose") > 0);
    if (!r.fits) {
      // Capacity planning answered "no": say so on stderr with the best fix, and exit non-zero so
      // scripts notice (the report above lists every alternative).
      std::string fix = "see the report's list of changes";
      for (const auto& s : r.suggestions)
        if (s.fits) {
          fix = "try";
          std::istringstream words(s.change);
          for (std::string w; words >> w;) fix += " --set " + w;
          break;
        }
      std::fprintf(stderr, "dssim scenario: error: %s does not fit in %s memory: needs %.2f GiB of %.2f GiB per GPU; %s\n",
                   sc.name.c_str(), sc.cluster.gpu.name.c_str(), r.memory.total() / (1 << 30),
                   r.gpu_memory_bytes / (1 << 30), fix.c_str());
      return 3;
    }
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "dssim scenario: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim scenario: failed: %s\n", e.what());
    return 1;
  }
}

}  // namespace dssim::cli

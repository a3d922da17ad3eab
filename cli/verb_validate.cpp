// `dssim validate`: every row of the published tables (validation/published) predicted by dssim,
// with the error, the mean and max absolute error per table, and the committed thresholds.
// Exit code 1 when a table's errors exceed its thresholds (CI runs this).
#include <boost/program_options.hpp>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

#include "cli/options.hpp"
#include "cli/predictors.hpp"
#include "cli/verbs.hpp"
#include "core/scenario_loader.hpp"
#include "validation/harness.hpp"

namespace po = boost::program_options;

namespace dssim::cli {

int verb_validate(int argc, char** argv) {
  po::options_description opts("dssim validate [options]");
  opts.add_options()
      ("help,h", "show this help")
      ("backend", po::value<std::string>()->default_value(default_predictor()), "analytic or sim")
      ("dir", po::value<std::string>(), "validation directory (default: <dssim data root>/validation)")
      ("json", "print the results as JSON (schema dssim.validate/1)")
      ("verbose,v", "print citations");
  po::variables_map vm;
  if (auto rc = parse_options("validate", argc, argv, opts, vm, false)) return *rc;
  const std::string backend = vm["backend"].as<std::string>();
  if (!has_predictor(backend)) {
    std::fprintf(stderr, "dssim validate: unknown --backend '%s' (available: %s)\n", backend.c_str(),
                 available_predictors().c_str());
    return 2;
  }
  const validation::Predictor predict = [backend](const Scenario& sc) { return predict_report(sc, backend); };
  const std::string dir = vm.count("dir") ? vm["dir"].as<std::string>()
                                          : (std::filesystem::path(data_root()) / "validation").string();
  if (!std::filesystem::is_directory(std::filesystem::path(dir) / "published")) {
    std::fprintf(stderr, "dssim validate: error: --dir %s has no published/ directory of tables; point --dir at a "
                         "copy of the repository's validation/ directory\n", dir.c_str());
    return 2;
  }
  try {
    const auto tables = validation::run_validation(dir, predict);
    if (vm.count("json"))
      std::cout << validation::to_json(tables).dump(2) << "\n";
    else
      std::cout << "dssim validate - " << backend << " predictions vs published tables\n\n"
                << validation::to_text(tables, vm.count("verbose") > 0);
    int failed = 0;
    for (const auto& t : tables) {
      if (t.pass()) continue;
      // Name only the thresholds a table exceeds, each with its figure.
      std::string over;
      char buf[96];
      if (t.allowed_mean >= 0 && t.mean_abs_error > t.allowed_mean) {
        std::snprintf(buf, sizeof buf, "mean |error| %.2f%% > %.2f%%", 100 * t.mean_abs_error, 100 * t.allowed_mean);
        over = buf;
      }
      if (t.allowed_max >= 0 && t.max_abs_error > t.allowed_max) {
        std::snprintf(buf, sizeof buf, "max |error| %.2f%% > %.2f%%", 100 * t.max_abs_error, 100 * t.allowed_max);
        over += (over.empty() ? "" : ", ") + std::string(buf);
      }
      std::fprintf(stderr, "dssim validate: %s: errors exceed the committed thresholds (%s)\n", t.name.c_str(), over.c_str());
      ++failed;
    }
    return failed ? 1 : 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "dssim validate: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim validate: failed: %s\n", e.what());
    return 1;
  }
}

}  // namespace dssim::cli

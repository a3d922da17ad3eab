// `dssim plan FILE.yaml`: the fastest configurations that fit (core/plan.hpp, docs/plan.md).
#include <boost/program_options.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <unistd.h>

#include "cli/options.hpp"
#include "cli/output_file.hpp"
#include "cli/predictors.hpp"
#include "cli/verbs.hpp"
#include "core/deepspeed_config.hpp"
#include "core/human_units.hpp"
#include "core/plan.hpp"
#include "core/scenario_loader.hpp"

namespace po = boost::program_options;

namespace dssim::cli {

namespace {

// --gpus N or A..B (A, 2A, 4A, ... up to B, and B).
std::vector<int> parse_gpus(const std::string& s) {
  auto number = [&](const std::string& t) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(t, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (t.empty() || used != t.size() || v < 1)
      throw ConfigError("--gpus '" + s + "': expected a GPU count N or a range A..B (e.g. --gpus 1024 or --gpus 512..4096)");
    return v;
  };
  const size_t dots = s.find("..");
  if (dots == std::string::npos) return {number(s)};
  const int a = number(s.substr(0, dots)), b = number(s.substr(dots + 2));
  if (b < a) throw ConfigError("--gpus " + s + ": the range is empty (A must be at most B)");
  std::vector<int> out;
  for (long n = a; n <= b; n *= 2) out.push_back(static_cast<int>(n));
  if (out.back() != b) out.push_back(b);
  return out;
}

std::vector<PlanDim> parse_vary(const std::string& list) {
  std::vector<PlanDim> out;
  std::istringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    if (item == "dp") continue;  // always GPUs / (tp * pp)
    auto d = parse_plan_dim(item);
    if (!d)
      throw ConfigError("--vary: unknown dimension '" + item +
                        "'; use a comma-separated list of tp, pp, dp, micro_batch, zero, recompute, interleave, "
                        "sequence_parallel, offload, ep (e.g. --vary tp,pp,micro_batch)");
    out.push_back(*d);
  }
  if (out.empty())
    throw ConfigError("--vary '" + list + "': nothing to search (dp is always GPUs / (tp * pp)); name the dimensions, "
                      "e.g. --vary tp,pp,micro_batch");
  return out;
}

struct SimCheck {
  size_t rank = 0;
  double analytic = 0, simulated = 0;
};

void print_table(const PlanResult& r, size_t top, PlanObjective objective) {
  const PlanEntry& best = r.ranked[0];
  const char* value_head = objective == PlanObjective::cost ? "GPU-hours" : objective == PlanObjective::time_to_train ? "to train" : "tokens/s";
  std::printf("%5s  %-54s %11s %10s %6s %17s  %-22s %7s\n", "rank", "configuration", "iteration", value_head, "MFU",
              "peak / capacity", "dominant · overhead", "gap");
  auto row = [&](size_t i, const char* mark) {
    const PlanEntry& e = r.ranked[i];
    const auto dom = e.dominant(), over = e.largest_overhead();
    std::string value = objective == PlanObjective::cost ? fmt("%.0f", e.gpu_hours)
                        : objective == PlanObjective::time_to_train ? human_seconds(e.time_to_train_seconds)
                                                                   : human_count(e.tokens_per_second);
    char cost[64];
    std::snprintf(cost, sizeof cost, "%s %.0f%% · %s %.0f%%", dom.first.c_str(), 100 * dom.second / e.iteration_seconds,
                  over.first.c_str(), 100 * over.second / e.iteration_seconds);
    char mem[48];
    std::snprintf(mem, sizeof mem, "%.1f / %.0f GiB", e.memory.total() / kGiB, e.capacity / kGiB);
    const std::string gap = i == 0 ? "best" : fmt("+%.1f%%", 100 * (e.objective / best.objective - 1));
    std::printf("%5zu%s %-54s %11s %10s %5.1f%% %17s  %-22s %7s\n", i + 1, mark, e.point.label().c_str(),
                human_seconds(e.iteration_seconds).c_str(), value.c_str(), 100 * e.mfu, mem, cost, gap.c_str());
  };
  const size_t shown = std::min(top, r.ranked.size());
  for (size_t i = 0; i < shown; ++i) row(i, r.base_rank && *r.base_rank == i ? "*" : " ");
  if (r.base_rank && *r.base_rank >= shown) {
    if (*r.base_rank > shown) std::printf("  ...\n");
    row(*r.base_rank, "*");
  }
}

}  // namespace

int verb_plan(int argc, char** argv) {
  po::options_description opts("dssim plan FILE.yaml [options]");
  opts.add_options()
      ("help,h", "show this help")
      ("gpus", po::value<std::string>(), "GPU count N, or a sweep A..B (A, 2A, ... B); default: the scenario's cluster")
      ("top", po::value<int>()->default_value(10), "rows of the ranked table")
      ("vary", po::value<std::string>(), "dimensions to search (default all): tp,pp,dp,micro_batch,zero,recompute,interleave,sequence_parallel,offload,ep; the others keep the scenario's values")
      ("fix", po::value<std::vector<std::string>>()->composing(), "hold a key: --fix parallel.tp=8 (repeatable); a key the planner does not search is applied like --set")
      ("set", po::value<std::vector<std::string>>()->composing(), "override a scenario key before planning (repeatable)")
      ("objective", po::value<std::string>()->default_value("throughput"), "throughput | cost (GPU-hours to train) | time-to-train")
      ("max-tp", po::value<int>()->default_value(0), "largest tensor-parallel degree searched (default: GPUs per node)")
      ("exact", "score every configuration with the whole-iteration Program (no micro-batch extrapolation)")
      ("verify-sim", po::value<int>()->default_value(0), "re-run the top K in the SimGrid simulator and compare")
      ("emit-best", po::value<std::string>(), "write the winner to DIR: scenario.yaml, ds_config.json, megatron_args.txt")
      ("json", "print the result as JSON (schema dssim.plan/1, docs/plan.md)");
  // Exit codes as `dssim scenario`: 0 ranked; 2 bad input; 3 nothing fits; 1 internal failure.
  po::variables_map vm;
  if (auto rc = parse_options("plan", argc, argv, opts, vm, true)) return *rc;
  if (!vm.count("file")) {
    std::fprintf(stderr, "dssim plan: missing FILE.yaml (e.g. dssim plan scenarios/gpt175b.yaml)\n");
    return 2;
  }
  try {
    const int top = vm["top"].as<int>();
    if (top < 1) throw ConfigError("--top " + std::to_string(top) + ": must be at least 1 (e.g. --top 10)");
    const int verify = vm["verify-sim"].as<int>();
    if (verify < 0) throw ConfigError("--verify-sim " + std::to_string(verify) + ": must be 0 or more (e.g. --verify-sim 5)");
    if (verify > 0 && !has_predictor("sim"))
      throw ConfigError("--verify-sim needs the SimGrid simulator, which this build of dssim does not have (configure with -DDSSIM_WITH_SIMGRID=ON)");
    PlanOptions po_;
    const auto objective = parse_plan_objective(vm["objective"].as<std::string>());
    if (!objective)
      throw ConfigError("--objective '" + vm["objective"].as<std::string>() + "': use throughput, cost or time-to-train");
    po_.objective = *objective;
    po_.max_tp = vm["max-tp"].as<int>();
    if (po_.max_tp < 0) throw ConfigError("--max-tp must be at least 1 (0 = GPUs per node)");
    po_.exact = vm.count("exact") > 0;
    if (vm.count("vary")) po_.vary = parse_vary(vm["vary"].as<std::string>());
    LoadOptions lo;
    if (vm.count("set")) lo.overrides = vm["set"].as<std::vector<std::string>>();
    if (vm.count("fix"))
      for (const std::string& f : vm["fix"].as<std::vector<std::string>>()) {
        const size_t eq = f.find('=');
        if (eq == std::string::npos || eq == 0)
          throw ConfigError("--fix '" + f + "': expected key=value, e.g. --fix parallel.tp=8");
        const std::string key = f.substr(0, eq);
        if (is_plan_key(key)) po_.fixes.push_back(parse_plan_fix(key, f.substr(eq + 1)));
        else lo.overrides.push_back(f);
      }
    const Scenario base = load_scenario(vm["file"].as<std::string>(), lo);
    const std::vector<int> sizes = vm.count("gpus") ? parse_gpus(vm["gpus"].as<std::string>())
                                                    : std::vector<int>{base.cluster.world()};
    const bool tty = isatty(2) && !vm.count("json");
    std::vector<PlanResult> results;
    for (int n : sizes) {
      PlanOptions o = po_;
      o.gpus = n;
      if (tty)
        o.progress = [](const PlanProgress& p) {
          if (p.phase == PlanProgress::enumerating) {
            std::fprintf(stderr, "\rdssim plan: %d GPUs: enumerated %zu / %zu configurations, %zu fit\033[K", p.gpus, p.done,
                         p.total, p.fitting);
            return;
          }
          std::fprintf(stderr, "\rdssim plan: %d GPUs: scored %zu / %zu configurations", p.gpus, p.done, p.total);
          if (p.best)
            std::fprintf(stderr, ", best so far %s (%.3f s, %s tokens/s)", p.best->point.label().c_str(),
                         p.best->iteration_seconds, human_count(p.best->tokens_per_second).c_str());
          std::fprintf(stderr, p.done == p.total ? "\r\033[K" : "\033[K");
        };
      results.push_back(plan(base, o));
    }
    // Best GPU count by the objective (one entry for a single count).
    const size_t bi = best_plan_index(results);
    const PlanResult& R = results[bi];

    if (R.ranked.empty()) {
      std::fprintf(stderr, "dssim plan: error: %s\n", nothing_fits_message(base, results, po_).c_str());
      return 3;
    }

    // Simulated check of the top K.
    std::vector<SimCheck> checks;
    bool order_changed = false;
    const Scenario best_base = [&] {
      Scenario s = base;
      if (R.gpus != base.cluster.world()) resize_cluster(s.cluster, R.gpus);
      return s;
    }();
    if (verify > 0) {
      for (size_t i = 0; i < std::min<size_t>(verify, R.ranked.size()); ++i) {
        if (tty) std::fprintf(stderr, "\rdssim plan: simulating %zu / %d", i + 1, verify);
        const Scenario s = apply_point(best_base, R.ranked[i].point);
        checks.push_back({i, R.ranked[i].iteration_seconds, predict_report(s, "sim").iteration_seconds});
      }
      if (tty) std::fprintf(stderr, "\r\033[K");
      for (size_t i = 1; i < checks.size(); ++i)
        if (checks[i].simulated < checks[i - 1].simulated) order_changed = true;
    }

    const Scenario best_sc = apply_point(best_base, R.ranked[0].point);
    if (vm.count("emit-best")) {
      // Everything rendered first; then each file written whole (temporary + rename).
      const std::string dir = vm["emit-best"].as<std::string>();
      std::string yaml = "# dssim plan: the best configuration of " + base.name + " on " + std::to_string(R.gpus) +
                         " GPUs (" + R.ranked[0].point.label() + ")\n" + to_yaml(best_sc);
      const std::string ds = to_deepspeed_config(best_sc).dump(2) + "\n";
      const std::string meg = "# Megatron-LM flags for what ds_config.json cannot say (dssim plan, " + base.name + ")\n" +
                              megatron_args(best_sc);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec || !std::filesystem::is_directory(dir))
        throw ConfigError("--emit-best " + dir + ": cannot create the directory (" + ec.message() + ")");
      write_file_atomically(dir + "/scenario.yaml", yaml);
      write_file_atomically(dir + "/ds_config.json", ds);
      write_file_atomically(dir + "/megatron_args.txt", meg);
    }

    const auto other = best_other_family(R);
    if (vm.count("json")) {
      nlohmann::json j = plan_json(base, results, top, po_);
      if (verify > 0) {
        nlohmann::json v = nlohmann::json::array();
        for (const auto& c : checks)
          v.push_back({{"rank", c.rank + 1}, {"key", R.ranked[c.rank].point.key()}, {"analytic_seconds", c.analytic},
                       {"simulated_seconds", c.simulated}});
        j["verify_sim"] = {{"configurations", v}, {"order_changed", order_changed}};
      }
      std::cout << j.dump(2) << "\n";
      return 0;
    }

    // Text.
    const PlanEntry& best = R.ranked[0];
    std::printf("dssim plan %s: %d x %s, global batch %lld, objective %s — best %s: %s, %s tokens/s, MFU %.1f%%\n",
                base.name.c_str(), R.gpus, base.cluster.gpu.name.c_str(), (long long)R.global_batch,
                to_string(po_.objective), best.point.label().c_str(), human_seconds(best.iteration_seconds).c_str(),
                human_count(best.tokens_per_second).c_str(), 100 * best.mfu);
    if (results.size() > 1) {
      std::printf("\nBest per GPU count\n%7s  %-54s %11s %10s %6s %10s\n", "GPUs", "configuration", "iteration", "tokens/s",
                  "MFU", "GPU-hours");
      for (const PlanResult& r : results) {
        if (r.ranked.empty()) {
          std::printf("%7d  %-54s\n", r.gpus, "nothing fits");
          continue;
        }
        const PlanEntry& e = r.ranked[0];
        std::printf("%7d%s %-54s %11s %10s %5.1f%% %10.0f\n", r.gpus, &r == &R ? "*" : " ", e.point.label().c_str(),
                    human_seconds(e.iteration_seconds).c_str(), human_count(e.tokens_per_second).c_str(), 100 * e.mfu,
                    e.gpu_hours);
      }
    }
    const std::string how = po_.exact ? "whole-iteration Programs"
                                      : fmt("%.0f", double(R.extrapolated)) + " from Programs of a few micro-batches extended to " +
                                            "the batch, the others whole";
    std::printf("\n%zu configurations on %d GPUs: %zu refused by validation, %zu over GPU or host memory, %zu fit and "
                "were searched in %.2f s (%s)\n\n",
                R.enumerated, R.gpus, R.invalid, R.too_big, R.ranked.size(), R.seconds, how.c_str());
    print_table(R, top, po_.objective);
    if (R.base_point) {
      if (R.base_rank)
        std::printf("\n* the scenario's own configuration (%s) ranks %zu of %zu: %s, %.1f%% behind the best\n",
                    R.base_point->label().c_str(), *R.base_rank + 1, R.ranked.size(),
                    human_seconds(R.ranked[*R.base_rank].iteration_seconds).c_str(),
                    100 * (R.ranked[*R.base_rank].objective / best.objective - 1));
      else
        std::printf("\nThe scenario's own configuration (%s) is not in this search (it does not fit, or --vary / --fix exclude it)\n",
                    R.base_point->label().c_str());
    }
    if (other) std::printf("\nWhy: %s\n", explain(best, R.ranked[*other]).c_str());
    if (!checks.empty()) {
      std::printf("\nSimulated check (SimGrid) of the top %zu\n%5s  %-54s %11s %11s %8s %8s\n", checks.size(), "rank",
                  "configuration", "analytic", "simulated", "diff", "sim rank");
      std::vector<size_t> order(checks.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return checks[a].simulated < checks[b].simulated; });
      for (size_t i = 0; i < checks.size(); ++i) {
        const size_t sim_rank = std::find(order.begin(), order.end(), i) - order.begin();
        std::printf("%5zu  %-54s %11s %11s %+7.1f%% %8zu\n", i + 1, R.ranked[i].point.label().c_str(),
                    human_seconds(checks[i].analytic).c_str(), human_seconds(checks[i].simulated).c_str(),
                    100 * (checks[i].simulated / checks[i].analytic - 1), sim_rank + 1);
      }
      std::printf("  order %s by the simulator\n", order_changed ? "CHANGED" : "unchanged");
    }
    if (vm.count("emit-best"))
      std::printf("\nWrote %s/scenario.yaml, ds_config.json, megatron_args.txt\n", vm["emit-best"].as<std::string>().c_str());
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "dssim plan: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim plan: failed: %s\n", e.what());
    return 1;
  }
}

}  // namespace dssim::cli

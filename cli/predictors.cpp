#include "cli/predictors.hpp"

#include "core/estimator.hpp"
#include "core/program_builder.hpp"
#ifdef DSSIM_HAVE_SIM
#include "backends/sim/sim_backend.hpp"
#endif

namespace dssim::cli {

#ifdef DSSIM_HAVE_SIM
const char* default_predictor() { return "sim"; }
bool has_predictor(const std::string& name) { return name == "sim" || name == "analytic"; }
std::string available_predictors() { return "analytic, sim"; }
#else
const char* default_predictor() { return "analytic"; }
bool has_predictor(const std::string& name) { return name == "analytic"; }
std::string available_predictors() { return "analytic (this build has no SimGrid)"; }
#endif

Report predict_report(const Scenario& sc, const std::string& name) {
#ifdef DSSIM_HAVE_SIM
  if (name == "sim") return simulate(sc);
#endif
  return analytic_report(sc, /*suggest=*/false);
}

validation::Prediction predict_with_kinds(const Scenario& sc, const std::string& name) {
  validation::Prediction p;
  p.predictor = name;
  BuildOptions rep;
  rep.representative_only = true;
  const Program program = build_program(sc, rep);
#ifdef DSSIM_HAVE_SIM
  if (name == "sim") {
    const SimRun run = simulate_program_run(sc, program);
    p.report = run.report;
    for (size_t k = 0; k < run.ranks.size(); ++k)
      if (run.ranks[k] == 0)
        p.seconds_by_kind = validation::seconds_by_kind(program.ranks.at(run.templates[k]), run.timeline.spans[k]);
    return p;
  }
#endif
  const Timeline tl = estimate(sc, program);
  p.report = make_report(sc, program, tl, "analytic");
  p.seconds_by_kind = validation::seconds_by_kind(program.ranks.at(0), tl.spans.at(0));
  return p;
}

}  // namespace dssim::cli

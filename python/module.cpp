// dssim._core: the Python binding (pybind11) behind `import dssim` (python/dssim/__init__.py,
// docs/python.md). Scenarios load as the CLI loads them; predict and plan return the dicts of
// `dssim scenario --json` and `dssim plan --json` (the same nlohmann::json, handed over through
// Python's json module). A ConfigError (bad input: the CLI's exit code 2) raises dssim.ConfigError
// with the CLI's message; anything else raises RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/estimator.hpp"
#include "core/fit_advisor.hpp"
#include "core/plan.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"
#ifdef DSSIM_HAVE_SIM
#include "backends/sim/sim_backend.hpp"
#endif

namespace py = pybind11;
using namespace dssim;

namespace {

py::object to_python(const nlohmann::json& j) {
  return py::module_::import("json").attr("loads")(j.dump());
}

Scenario load(const std::string& path, const std::vector<std::string>& overrides, const std::string& ds_config, int gpus) {
  LoadOptions lo;
  lo.overrides = overrides;
  lo.deepspeed_config = ds_config;
  lo.gpus = gpus;
  py::gil_scoped_release unlocked;
  return load_scenario(path, lo);
}

py::object predict(const Scenario& sc, const std::string& backend, const std::string& trace) {
  if (backend != "analytic" && backend != "sim")
    throw ConfigError("unknown backend '" + backend + "' (available: analytic, sim)");
  if (!trace.empty() && backend != "sim") throw ConfigError("trace needs backend=\"sim\"");
  Report r;
  {
    py::gil_scoped_release unlocked;
    if (backend == "sim") {
#ifdef DSSIM_HAVE_SIM
      SimOptions so;
      so.trace_path = trace;
      r = simulate(sc, so);
      if (!r.fits) r.suggestions = fit_suggestions(sc);
#else
      throw ConfigError("backend \"sim\": this build of dssim has no SimGrid (use backend=\"analytic\")");
#endif
    } else {
      r = analytic_report(sc);
    }
  }
  return to_python(report_json(sc, r));
}

py::object plan_py(const Scenario& base, const std::vector<int>& gpus, int top, const std::vector<std::string>& vary,
                   const std::vector<std::pair<std::string, std::string>>& fixes, const std::string& objective, int max_tp,
                   bool exact) {
  if (top < 1) throw ConfigError("top " + std::to_string(top) + ": must be at least 1");
  PlanOptions po;
  const auto obj = parse_plan_objective(objective);
  if (!obj) throw ConfigError("objective '" + objective + "': use throughput, cost or time-to-train");
  po.objective = *obj;
  po.max_tp = max_tp;
  po.exact = exact;
  for (const std::string& v : vary) {
    if (v == "dp") continue;
    const auto d = parse_plan_dim(v);
    if (!d)
      throw ConfigError("vary: unknown dimension '" + v + "'; use tp, pp, micro_batch, zero, recompute, interleave, "
                        "sequence_parallel, offload, ep");
    po.vary.push_back(*d);
  }
  for (const auto& [k, v] : fixes) {
    if (!is_plan_key(k))
      throw ConfigError("fix: '" + k + "' is not a key the planner searches; give it to load_scenario(set=...)");
    po.fixes.push_back(parse_plan_fix(k, v));
  }
  std::vector<PlanResult> results;
  {
    py::gil_scoped_release unlocked;
    for (int n : gpus.empty() ? std::vector<int>{base.cluster.world()} : gpus) {
      PlanOptions o = po;
      o.gpus = n;
      results.push_back(plan(base, o));
    }
  }
  if (results[best_plan_index(results)].ranked.empty()) {
    py::gil_scoped_release unlocked;  // the message searches for what would fit
    const std::string why = nothing_fits_message(base, results, po);
    throw ConfigError(why);
  }
  return to_python(plan_json(base, results, static_cast<size_t>(top), po));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "dssim's C++ core (scenario loading, analytic estimator, SimGrid simulator, planner)";
  static py::exception<ConfigError> config_error(m, "ConfigError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ConfigError& e) {
      config_error(e.what());
    }
  });

  py::class_<Scenario>(m, "Scenario", "A resolved scenario (SI units), as `dssim scenario` loads it.")
      .def_readonly("name", &Scenario::name)
      .def_readonly("source", &Scenario::source)
      .def_readonly("warnings", &Scenario::warnings)
      .def_property_readonly("gpus", [](const Scenario& s) { return s.cluster.world(); })
      .def("to_yaml", [](const Scenario& s) { return to_yaml(s); }, "every field explicit, SI units")
      .def("__repr__", [](const Scenario& s) {
        return "<dssim.Scenario " + s.name + " on " + std::to_string(s.cluster.world()) + " x " + s.cluster.gpu.name + ">";
      });

  m.def("load_scenario", &load, py::arg("path"), py::arg("overrides") = std::vector<std::string>{},
        py::arg("deepspeed_config") = std::string{}, py::arg("gpus") = 0);
  m.def("predict", &predict, py::arg("scenario"), py::arg("backend") = "analytic", py::arg("trace") = std::string{});
  m.def("plan", &plan_py, py::arg("scenario"), py::arg("gpus"), py::arg("top"), py::arg("vary"), py::arg("fixes"),
        py::arg("objective"), py::arg("max_tp"), py::arg("exact"));
  m.def("data_root", &data_root);
#ifdef DSSIM_HAVE_SIM
  m.attr("has_sim") = true;
#else
  m.attr("has_sim") = false;
#endif
}

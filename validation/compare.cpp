#include "validation/compare.hpp"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <set>
#include <sstream>

#include "core/memory.hpp"
#include "core/scenario_loader.hpp"

namespace dssim::validation {

std::map<std::string, double> seconds_by_kind(const RankProgram& rank, const std::vector<Span>& spans) {
  std::map<std::string, double> out;
  for (size_t i = 0; i < rank.instructions.size(); ++i)
    out[to_string(rank.instructions[i].op)] += spans.at(i).end - spans.at(i).start;
  return out;
}

namespace {
// The report's fields, when it has both (nullptr otherwise).
const nlohmann::json* measured_kernels(const nlohmann::json& report) {
  if (!report.contains("extras") || !report["extras"].contains("measured")) return nullptr;
  const nlohmann::json& m = report["extras"]["measured"];
  if (!m.contains("gemm_epilogues") || !m["gemm_epilogues"].is_string() || !m.contains("cross_entropy_kernel") ||
      !m["cross_entropy_kernel"].is_boolean())
    return nullptr;
  return &m;
}

std::string kernels_line(const Scenario& sc) {
  return std::string("priced with the run's kernels: GEMM epilogues ") + (sc.model.gemm_epilogues ? "on" : "off") +
         ", cross-entropy kernel " + (sc.model.cross_entropy_kernel ? "on" : "off");
}
}  // namespace

std::string apply_measured_kernels(Scenario& sc, const nlohmann::json& run_report) {
  const nlohmann::json* m = measured_kernels(run_report);
  if (!m) return "";
  const std::string epilogues = (*m)["gemm_epilogues"].get<std::string>();
  sc.model.gemm_epilogues = !epilogues.empty() && epilogues != "none" && epilogues != "off";
  sc.model.cross_entropy_kernel = sc.model.fused_cross_entropy() && (*m)["cross_entropy_kernel"].get<bool>();
  return kernels_line(sc);
}

std::string unpriced_departure(const Scenario& sc, const nlohmann::json& run_report) {
  if (!run_report.contains("extras") || !run_report["extras"].contains("measured")) return "";
  const nlohmann::json& m = run_report["extras"]["measured"];
  auto it = m.find("zero3_backward_into_partition");
  if (it != m.end() && it->is_boolean() && !it->get<bool>() && zero3_backward_into_partition(sc))
    return "the run folded ZeRO-3's layer gradients into the partition (DSSIM_ZERO3_FOLD=1); the prediction "
           "prices backward into the partition (no fold), so backward and peak memory are not like for like";
  return "";
}

Comparison compare(const Scenario& sc, const Prediction& p, const nlohmann::json& m) {
  Comparison c;
  c.scenario = sc.name;
  if (measured_kernels(m)) c.kernels = kernels_line(sc);
  c.unpriced = unpriced_departure(sc, m);
  c.predictor = p.predictor;
  c.measured_backend = m.value("backend", std::string("?"));
  const nlohmann::json& meas = m.at("extras").at("measured");
  std::set<std::string> kinds;
  for (auto& [k, v] : p.seconds_by_kind)
    if (v > 0) kinds.insert(k);
  for (auto it = meas["seconds_per_iteration_by_instruction"].begin();
       it != meas["seconds_per_iteration_by_instruction"].end(); ++it)
    if (it.value().get<double>() > 0) kinds.insert(it.key());
  // Kinds under 0.1% of the iteration on both sides (a wait that found nothing to wait for) are
  // left out of the table.
  const double floor = 1e-3 * std::max(p.report.iteration_seconds, m.at("throughput").value("iteration_seconds", 0.0));
  for (const auto& k : kinds) {
    Pair q{k};
    auto it = p.seconds_by_kind.find(k);
    q.simulated = it == p.seconds_by_kind.end() ? 0 : it->second;
    q.measured = meas["seconds_per_iteration_by_instruction"].value(k, 0.0);
    // The offloaded gradients' copies run beside the compute. The simulator's copy_d2h is its
    // copy stream's busy time (the bus, then the host sum); the engine's GPU thread only issues
    // them, and the busy time is its host worker's (copy wait plus sum).
    if (k == "copy_d2h" && meas.contains("host_offload_per_iteration"))
      q.measured = meas["host_offload_per_iteration"].value("accumulate_seconds", q.measured);
    if (q.simulated < floor && q.measured < floor) continue;
    c.kinds.push_back(q);
  }
  // What of the copies the compute waited for, on both sides.
  const double measured_offload = m["time_seconds"].value("exposed_offload", 0.0);
  if (p.report.time.exposed_offload > floor || measured_offload > floor)
    c.kinds.push_back({"exposed_offload", p.report.time.exposed_offload, measured_offload});
  const double measured_bubble = m["time_seconds"].value("bubble", 0.0);
  if (p.report.time.bubble > 0 || measured_bubble > 0) c.kinds.push_back({"bubble", p.report.time.bubble, measured_bubble});
  const auto& t = m.at("throughput");
  c.totals = {{"iteration_seconds", p.report.iteration_seconds, t.value("iteration_seconds", 0.0)},
              {"tokens_per_second", p.report.tokens_per_second, t.value("tokens_per_second", 0.0)},
              {"model_tflops_per_gpu", p.report.model_tflops_per_gpu, t.value("model_tflops_per_gpu", 0.0)}};
  const auto& mm = meas.value("memory_bytes", nlohmann::json::object());
  const MemoryBreakdown& pm = p.report.memory;
  c.memory = {{"params", pm.params, mm.value("params", 0.0)},
              {"grads", pm.grads, mm.value("grads", 0.0)},
              {"optimizer", pm.optimizer, mm.value("optimizer", 0.0)},
              {"activations_and_temporaries", pm.activations + pm.comm_buffers + pm.temporaries,
               mm.value("activations_and_temporaries", 0.0)},
              {"peak", pm.total(), mm.value("peak", 0.0)}};
  if (pm.host > 0 || mm.contains("host_optimizer"))
    c.memory.push_back({"host_optimizer", pm.host, mm.value("host_optimizer", 0.0)});
  return c;
}

namespace {
nlohmann::json pairs_json(const std::vector<Pair>& v, const char* a, const char* b) {
  nlohmann::json out = nlohmann::json::array();
  for (const Pair& q : v) out.push_back({{"kind", q.name}, {a, q.simulated}, {b, q.measured}, {"error", q.error()}});
  return out;
}
}  // namespace

nlohmann::json Comparison::to_json() const {
  nlohmann::json j;
  j["schema"] = "dssim.compare/1";
  j["scenario"] = scenario;
  j["predictor"] = predictor;
  j["measured_backend"] = measured_backend;
  if (!kernels.empty()) j["kernels"] = kernels;
  if (!unpriced.empty()) j["unpriced"] = unpriced;
  j["kinds"] = pairs_json(kinds, "simulated_seconds", "measured_seconds");
  for (const Pair& q : totals)
    j[q.name] = {{"simulated", q.simulated}, {"measured", q.measured}, {"error", q.error()}};
  j["memory_bytes"] = pairs_json(memory, "simulated_bytes", "measured_bytes");
  return j;
}

std::string Comparison::to_text() const {
  std::ostringstream o;
  char buf[256];
  o << "dssim compare " << scenario << " - " << predictor << " prediction vs " << measured_backend
    << " measurement, one iteration\n";
  if (!kernels.empty()) o << kernels << "\n";
  if (!unpriced.empty()) o << "not like for like: " << unpriced << "\n";
  o << "\n";
  std::snprintf(buf, sizeof buf, "  %-28s %14s %14s %9s\n", "instruction kind", "predicted", "measured", "error");
  o << buf;
  for (const Pair& q : kinds) {
    std::snprintf(buf, sizeof buf, "  %-28s %12.4f s %12.4f s %+8.1f%%\n", q.name.c_str(), q.simulated, q.measured,
                  100 * q.error());
    o << buf;
  }
  o << "\n";
  for (const Pair& q : totals) {
    std::snprintf(buf, sizeof buf, "  %-28s %14.4g %14.4g %+8.1f%%\n", q.name.c_str(), q.simulated, q.measured,
                  100 * q.error());
    o << buf;
  }
  o << "\n  peak memory per GPU (GiB)\n";
  for (const Pair& q : memory) {
    std::snprintf(buf, sizeof buf, "  %-28s %14.2f %14.2f %+8.1f%%\n", q.name.c_str(), q.simulated / (1 << 30),
                  q.measured / (1 << 30), 100 * q.error());
    o << buf;
  }
  return o.str();
}

nlohmann::json make_record(const Scenario& sc, const nlohmann::json& measured, const std::string& gpu,
                           const std::string& command) {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  return {{"schema", "dssim.measurement/1"}, {"date", date}, {"gpu", gpu}, {"command", command},
          {"scenario_yaml", to_yaml(sc)}, {"report", measured}};
}

Scenario record_scenario(const nlohmann::json& record, const std::string& source) {
  if (record.value("schema", std::string()) != "dssim.measurement/1")
    throw ConfigError(source + ": not a dssim measurement record (schema dssim.measurement/1)");
  Scenario sc = load_scenario_from_string(record.at("scenario_yaml").get<std::string>(), {}, source);
  if (record.contains("report")) apply_measured_kernels(sc, record["report"]);
  return sc;
}

}  // namespace dssim::validation

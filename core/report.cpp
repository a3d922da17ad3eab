#include "core/report.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/finetune.hpp"
#include "core/human_units.hpp"
#include "core/model.hpp"
#include "core/pipeline_partition.hpp"
#include "core/program_builder.hpp"

namespace dssim {

void fill_throughput(const Scenario& sc, Report& r) {
  const double batch = static_cast<double>(sc.training.global_batch);
  const double gpus = sc.cluster.world();
  const double peak = sc.precision.dtype == Dtype::fp32 ? sc.cluster.gpu.peak_flops_32
                                                       : sc.cluster.gpu.peak_flops_16;
  r.parameters = total_parameter_count(sc.model, sc.finetune);
  r.trainable_parameters = trainable_parameter_count(sc.model, sc.finetune);
  r.gpu_memory_bytes = sc.cluster.gpu.memory_bytes;
  r.model_flops_per_iteration = model_flops_per_iteration(sc.model, batch) +
                                finetune_flops_delta(sc.model, sc.finetune, batch, sc.recompute, false);
  r.hardware_flops_per_iteration = hardware_flops_per_iteration(sc.model, batch, sc.recompute) +
                                   finetune_flops_delta(sc.model, sc.finetune, batch, sc.recompute, true);
  if (r.iteration_seconds <= 0) return;
  r.samples_per_second = batch / r.iteration_seconds;
  r.tokens_per_second = r.samples_per_second * sc.model.seq_len;
  r.model_tflops_per_gpu = r.model_flops_per_iteration / r.iteration_seconds / gpus / 1e12;
  r.hardware_tflops_per_gpu = r.hardware_flops_per_iteration / r.iteration_seconds / gpus / 1e12;
  r.mfu = r.model_tflops_per_gpu * 1e12 / peak;
  r.hfu = r.hardware_tflops_per_gpu * 1e12 / peak;
  r.time_to_train_seconds = sc.training.tokens_to_train > 0 ? sc.training.tokens_to_train / r.tokens_per_second : 0;
}

OneBitTraffic onebit_traffic(const Scenario& sc) {
  OneBitTraffic t;
  if (sc.optimizer.kind != OptimizerKind::onebit_adam) return t;
  const auto dp_bytes = [&](int64_t step) {
    Scenario s = sc;
    s.optimizer.step = step;
    BuildOptions bo;
    bo.representative_only = true;
    const Program p = build_program(s, bo);
    double b = 0;
    for (const auto& [purpose, v] : wire_bytes_by_purpose(p, 0))
      if (purpose == to_string(Purpose::GradientReduce) || purpose.rfind("onebit", 0) == 0) b += v;
    return b;
  };
  t.uncompressed = dp_bytes(0);
  t.compressed = dp_bytes(std::max<int64_t>(sc.optimizer.freeze_step, sc.optimizer.step));
  return t;
}

std::map<std::string, double> wire_bytes_by_purpose(const Program& program, int rank_index) {
  std::map<std::string, double> out;
  const RankProgram& rp = program.ranks.at(rank_index);
  for (const Instruction& in : rp.instructions) {
    double b = 0;
    if (is_collective(in.op)) {
      b = wire_bytes_per_rank(in.op, in.bytes, static_cast<int>(program.groups.at(in.group).ranks.size()));
    } else if (in.op == Op::Send || in.op == Op::CopyD2H || in.op == Op::CopyH2D) {
      b = in.bytes;
    } else {
      continue;
    }
    out[to_string(in.purpose)] += b * std::max(1, in.repeat);
  }
  return out;
}

namespace {

void line(std::ostringstream& o, const std::string& label, const std::string& value) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "  %-26s %s\n", label.c_str(), value.c_str());
  o << buf;
}

// With pp = 1 there is no pipeline: the compute stream's waits that are not exposed communication
// are waits for other ranks at a collective (MoE's all-to-all, a slow GPU), not a bubble.
const char* bubble_label(int pp) { return pp > 1 ? "pipeline bubble" : "waiting for other ranks"; }

std::vector<std::pair<const char*, double>> time_rows(const TimeBreakdown& t, int pp) {
  return {{"forward", t.forward},           {"backward", t.backward},
          {"recompute", t.recompute},       {"optimizer", t.optimizer},
          {"exposed TP comm", t.exposed_tp}, {"exposed PP comm", t.exposed_pp},
          {"exposed DP comm", t.exposed_dp}, {"exposed EP comm", t.exposed_ep},
          {"exposed offload (PCIe)", t.exposed_offload}, {bubble_label(pp), t.bubble},
          {"idle (waiting for slowest rank)", t.idle}};
}

std::vector<std::pair<const char*, double>> memory_rows(const MemoryBreakdown& m) {
  return {{"parameters", m.params},       {"gradients", m.grads},
          {"optimizer states", m.optimizer}, {"activations", m.activations},
          {"communication buffers", m.comm_buffers}, {"temporaries", m.temporaries}};
}

// What only a simulation can tell (backends/sim fills Report::extras["sim"]).
std::string simulation_text(const nlohmann::json& sim, bool verbose, int pp) {
  std::ostringstream o;
  // Not the breakdown's "exposed" (time the compute stream waited for a transfer): here, the
  // transfer time during which the rank computed nothing at all, whatever it was waiting for.
  o << "\nSimulated communication on the critical rank (outside / under compute)\n";
  if (sim.contains("communication"))
    for (auto& [kind, v] : sim["communication"].items()) {
      const auto& c = v["critical_rank"];
      if (c.value("seconds", 0.0) <= 0) continue;
      line(o, kind, human_seconds(c.value("exposed_seconds", 0.0)) + " outside compute / " +
                        human_seconds(c.value("overlapped_seconds", 0.0)) + " hidden under compute");
    }
  if (sim.contains("bubble")) {
    const auto& b = sim["bubble"];
    if (pp > 1)
      line(o, "pipeline bubble", fmt("%.1f %% simulated", 100 * b.value("critical_rank_fraction", 0.0)) +
                                     fmt(" (1F1B ideal %.1f %%)", 100 * b.value("ideal_1f1b_fraction", 0.0)));
    else if (b.value("critical_rank_fraction", 0.0) > 0)
      line(o, "waiting for other ranks", fmt("%.1f %% simulated (at collectives; no pipeline)",
                                             100 * b.value("critical_rank_fraction", 0.0)));
  }
  if (sim.contains("critical_path")) {
    const auto& c = sim["critical_path"];
    line(o, "straggler", "rank " + std::to_string(c.value("straggler_rank", 0)) + ", bound by " +
                             c.value("dominant", std::string("?")) + fmt(", max slack %.3f s", c.value("max_slack_seconds", 0.0)));
  }
  if (sim.contains("links") && sim["links"].contains("busiest")) {
    o << "Busiest links\n";
    int shown = 0;
    for (const auto& l : sim["links"]["busiest"]) {
      if (shown++ >= (verbose ? 10 : 3)) break;
      line(o, l.value("name", std::string("?")), fmt("%.1f %% busy", 100 * l.value("utilization", 0.0)) + ", " +
                                                     human_bytes(l.value("bytes", 0.0)) + fmt(" at %.0f GB/s", l.value("bandwidth", 0.0) / 1e9));
    }
  }
  return o.str();
}

// The what-if compared with the clean run (backends/sim simulate_what_if).
std::string what_if_text(const nlohmann::json& w) {
  std::ostringstream o;
  o << "\nWhat-if (compared with the clean run of this invocation)\n";
  for (const auto& s : w.value("specs", nlohmann::json::array())) line(o, "what-if", s.get<std::string>());
  const double t0 = w.value("clean_iteration_seconds", 0.0), t = w.value("iteration_seconds", 0.0);
  line(o, "iteration time", human_seconds(t) + " vs " + human_seconds(t0) + " clean" +
                                fmt(" (%+.1f %%)", 100 * w.value("change", 0.0)));
  if (w.contains("time_seconds") && w.contains("clean_time_seconds")) {
    for (const char* k : {"compute", "exposed_communication", "bubble", "idle"}) {
      const double a = w["clean_time_seconds"].value(k, 0.0), b = w["time_seconds"].value(k, 0.0);
      if (a <= 0 && b <= 0) continue;
      line(o, std::string("  ") + k, human_seconds(b) + " vs " + human_seconds(a) + " clean (critical rank)");
    }
  }
  if (w.contains("noise")) {
    const auto& n = w["noise"];
    line(o, "noise", fmt("CV %.1f %% per compute instruction, ", 100 * n.value("cv", 0.0)) +
                         std::to_string(n.value("samples", 0)) + " samples from seed " +
                         std::to_string(n.value("seed", uint64_t(0))));
    line(o, "iteration mean +- sd", human_seconds(n.value("mean_seconds", 0.0)) + " +- " +
                                        human_seconds(n.value("stddev_seconds", 0.0)) + " (range " +
                                        human_seconds(n.value("min_seconds", 0.0)) + " - " +
                                        human_seconds(n.value("max_seconds", 0.0)) + ")");
    line(o, "synchronization cost", fmt("%+.2f %% on average over the clean run", 100 * n.value("mean_change", 0.0)) +
                                        " (each GPU's own compute is unchanged on average; every collective waits for its "
                                        "slowest member)");
  }
  line(o, "summary", w.value("summary", std::string()));
  return o.str();
}

// Failures and goodput (core/reliability.hpp goodput_json).
std::string reliability_text(const nlohmann::json& g) {
  std::ostringstream o;
  o << "\nFailures and goodput over the run\n";
  const double mtbf = g["mtbf_seconds"].is_number() ? g["mtbf_seconds"].get<double>() : 0.0;
  line(o, "failure rate", fmt("%.3g per GPU-hour", g.value("failures_per_gpu_hour", 0.0)) + " x " +
                              std::to_string(g.value("gpus", 0)) + " GPUs: one every " +
                              (mtbf > 0 ? human_seconds(mtbf) : std::string("never")));
  line(o, "checkpoint", human_bytes(g.value("checkpoint_bytes", 0.0)) + " (" +
                            human_bytes(g.value("checkpoint_bytes_per_rank", 0.0)) + " from the busiest rank), written in " +
                            human_seconds(g.value("checkpoint_seconds", 0.0)));
  line(o, "restart", human_seconds(g.value("restart_seconds", 0.0)) + " + restore " +
                         human_seconds(g.value("restore_seconds", 0.0)));
  std::string interval = human_seconds(g.value("checkpoint_interval_seconds", 0.0)) + " (" +
                         std::to_string(g.value("checkpoint_interval_iterations", int64_t(0))) + " iterations)";
  if (g.value("checkpoint_interval_auto", true)) interval += ", Daly's optimum";
  line(o, "checkpoint interval", interval);
  if (g["young_interval_seconds"].is_number() && mtbf > 0)
    line(o, "optimal interval", "Young " + human_seconds(g["young_interval_seconds"].get<double>()) + ", Daly " +
                                    human_seconds(g["daly_interval_seconds"].get<double>()));
  const auto& mc = g["monte_carlo"];
  line(o, "goodput", fmt("%.2f %% closed form", 100 * g.value("goodput", 0.0)) +
                         fmt(", %.2f %% Monte-Carlo", 100 * mc.value("goodput", 0.0)) + " (" +
                         std::to_string(mc.value("jobs", 0)) + " jobs, " +
                         fmt("%.1f failures each)", mc.value("failures_per_job", 0.0)));
  if (mtbf > 0)
    line(o, "lost per failure", human_seconds(g.value("lost_per_failure_seconds", 0.0)) + " (progress since the checkpoint " +
                                    human_seconds(g.value("lost_progress_per_failure_seconds", 0.0)) + ", then the restart)");
  if (g.value("useful_seconds", 0.0) > 0)
    line(o, "time to train", human_seconds(g.value("time_to_train_seconds", 0.0)) + " with failures, " +
                                 human_seconds(g.value("useful_seconds", 0.0)) + " without" +
                                 fmt(" (%.1f failures expected)", g.value("expected_failures", 0.0)));
  return o.str();
}

}  // namespace

std::string report_text(const Scenario& sc, const Report& r, bool verbose) {
  std::ostringstream o;
  const auto& p = sc.parallel;
  const auto& m = sc.model;
  o << "dssim " << (sc.name.empty() ? sc.source : sc.name) << " - " << r.backend
    << (r.backend == "analytic" || r.backend == "sim" ? " prediction" : " measurement") << ", one iteration\n\n";

  o << "Configuration\n";
  std::string model = human_count(r.parameters) + " parameters (" + std::to_string(m.layers) + " layers, h " +
                      std::to_string(m.hidden) + ", " + std::to_string(m.heads) + " heads, s " +
                      std::to_string(m.seq_len) + ", V " + std::to_string(m.vocab);
  if (m.kv_heads_or_heads() != m.heads) model += ", " + std::to_string(m.kv_heads_or_heads()) + " kv heads";
  if (m.swiglu) model += ", SwiGLU";
  if (m.is_moe()) model += ", " + std::to_string(m.experts) + " experts top-" + std::to_string(m.top_k);
  line(o, "model", model + ")");
  if (sc.finetune.freezes_anything()) {
    const auto& ft = sc.finetune;
    std::string what;
    if (ft.lora()) {
      std::string targets;
      for (LoraTarget t : lora_targets(m, ft)) targets += (targets.empty() ? "" : ", ") + std::string(to_string(t));
      what = "LoRA r " + std::to_string(ft.rank) + " on " + targets + ", base frozen";
    } else {
      std::string parts;
      const std::pair<bool, const char*> fz[] = {{ft.freeze_embeddings, "embeddings"}, {ft.freeze_norms, "norms"},
                                                 {ft.freeze_attention, "attention"}, {ft.freeze_mlp, "mlp"},
                                                 {ft.freeze_head, "lm_head"}};
      for (const auto& [on, name] : fz)
        if (on) parts += (parts.empty() ? "" : ", ") + std::string(name);
      what = "full, frozen: " + parts;
    }
    line(o, "fine-tuning", human_count(r.trainable_parameters) + " trainable parameters (" +
                               fmt("%.3g %%", 100 * r.trainable_parameters / r.parameters) + "), " + what);
  }
  line(o, "GPUs", std::to_string(sc.cluster.world()) + " x " + sc.cluster.gpu.name + " (" +
                      std::to_string(sc.cluster.nodes) + " nodes x " + std::to_string(sc.cluster.gpus_per_node) + ")");
  line(o, "parallelism", "TP " + std::to_string(p.tp) + " | PP " + std::to_string(p.pp) + " | DP " +
                             std::to_string(p.dp) + " | EP " + std::to_string(p.ep) +
                             (p.sequence_parallel ? " | sequence parallel" : "") +
                             (p.interleave > 1 ? " | interleave " + std::to_string(p.interleave) : ""));
  if (!uniform_partition(sc)) {
    // Runs of equal counts as "6 x 10": 70 layers on 12 stages reads "5, 6 x 10, 5".
    const std::vector<int> per = layers_per_stage(sc);
    std::string text;
    for (size_t i = 0; i < per.size();) {
      size_t j = i;
      while (j < per.size() && per[j] == per[i]) ++j;
      text += (i ? ", " : "") + std::to_string(per[i]) + (j - i > 1 ? " x " + std::to_string(j - i) : "");
      i = j;
    }
    line(o, "layers per stage", text + (sc.parallel.partition_method.empty() ? "" : " (" + sc.parallel.partition_method + ")"));
  }
  std::string zero = "stage " + std::to_string(sc.zero.stage);
  if (sc.zero.offload_optimizer) zero += ", optimizer offload";
  if (sc.zero.offload_param) zero += ", parameter offload";
  line(o, "ZeRO", zero);
  line(o, "batch", "global " + std::to_string(sc.training.global_batch) + " = micro-batch " +
                       std::to_string(sc.training.micro_batch) + " x accumulation " +
                       std::to_string(sc.training.grad_accum) + " x DP " + std::to_string(p.dp));
  line(o, "precision / recompute", std::string(to_string(sc.precision.dtype)) + " / " + to_string(sc.recompute));
  line(o, "optimizer", sc.optimizer.kind == OptimizerKind::onebit_adam
                           ? "1-bit Adam (freeze_step " + std::to_string(sc.optimizer.freeze_step) + ", reporting step " +
                                 std::to_string(sc.optimizer.step) + ")"
                           : sc.optimizer.kind == OptimizerKind::lamb ? std::string("Lamb (Adam-sized states)")
                           : sc.optimizer.kind == OptimizerKind::lion ? std::string("Lion (one momentum)")
                                                                      : std::string("AdamW"));

  if (const OneBitTraffic& t = r.onebit; t.uncompressed > 0)
    line(o, "1-bit compression", human_bytes(t.compressed) + " sent per GPU per iteration after freeze_step, " +
                                    human_bytes(t.uncompressed) + " before" +
                                    fmt(" (%.1f %% less)", 100 * (1 - t.compressed / t.uncompressed)));

  o << "\nMemory per GPU (peak)\n";
  for (auto& [label, v] : memory_rows(r.memory)) line(o, label, human_bytes(v));
  const double total = r.memory.total();
  const double cap = r.gpu_memory_bytes;
  line(o, "total", human_bytes(total) + " of " + human_bytes(cap) + ": " +
                       (r.fits ? "fits (" + human_bytes(cap - total) + " free)"
                               : "DOES NOT FIT by " + human_bytes(total - cap)));
  if (r.memory.host > 0) line(o, "host (CPU) memory per GPU", human_bytes(r.memory.host));
  if (r.memory.nvme > 0) line(o, "NVMe per GPU", human_bytes(r.memory.nvme));
  if (!r.suggestions.empty()) {
    o << "\n" << (r.fits ? "Other configurations\n" : "Changes that would make it fit\n");
    for (const auto& s : r.suggestions) {
      char buf[512];
      std::snprintf(buf, sizeof buf, "  %-58s %10s %-14s iteration %s\n", s.change.c_str(),
                    human_bytes(s.peak_bytes).c_str(), s.fits ? "fits" : "still too big",
                    human_seconds(s.iteration_seconds).c_str());
      o << buf;
    }
  }

  o << "\nThroughput\n";
  line(o, "iteration time", human_seconds(r.iteration_seconds));
  line(o, "tokens/s", human_count(r.tokens_per_second) + " tokens/s");
  line(o, "samples/s", fmt("%.2f samples/s", r.samples_per_second));
  line(o, "model FLOP/s per GPU", human_flop_rate(r.model_tflops_per_gpu) + fmt("  (MFU %.1f %%)", 100 * r.mfu));
  line(o, "hardware FLOP/s per GPU", human_flop_rate(r.hardware_tflops_per_gpu) + fmt("  (HFU %.1f %%)", 100 * r.hfu));
  if (r.time_to_train_seconds > 0)
    line(o, "time to train " + human_count(sc.training.tokens_to_train) + " tokens", human_seconds(r.time_to_train_seconds));

  o << "\nWhere the time goes (rank " << r.critical_rank << ")\n";
  for (auto& [label, v] : time_rows(r.time, sc.parallel.pp)) {
    if (v <= 0 && !verbose) continue;
    line(o, label, human_seconds(v) + fmt("  %5.1f %%", r.iteration_seconds > 0 ? 100 * v / r.iteration_seconds : 0));
  }
  if (r.extras.contains("sim")) o << simulation_text(r.extras["sim"], verbose, sc.parallel.pp);
  if (r.extras.contains("what_if")) o << what_if_text(r.extras["what_if"]);
  if (r.extras.contains("reliability")) o << reliability_text(r.extras["reliability"]);
  if (verbose && !r.wire_bytes_per_rank.empty()) {
    o << "\nBytes on the wire per rank per iteration\n";
    for (auto& [k, v] : r.wire_bytes_per_rank) line(o, k, human_bytes(v));
  }
  if (!sc.warnings.empty()) {
    o << "\nWarnings\n";
    for (const auto& w : sc.warnings) o << "  - " << w << "\n";
  }
  return o.str();
}

nlohmann::json report_json(const Scenario& sc, const Report& r) {
  using nlohmann::json;
  json j;
  j["schema"] = "dssim.report/1";
  j["backend"] = r.backend;
  j["scenario"] = {{"name", sc.name}, {"source", sc.source}};
  j["config"] = {
      {"parameters", r.parameters},
      {"trainable_parameters", r.trainable_parameters},
      {"layers", sc.model.layers}, {"hidden", sc.model.hidden}, {"heads", sc.model.heads},
      {"seq_len", sc.model.seq_len}, {"vocab", sc.model.vocab}, {"experts", sc.model.experts},
      {"top_k", sc.model.top_k}, {"ffn_hidden", ffn_hidden_of(sc.model)},
      {"kv_heads", sc.model.kv_heads_or_heads()}, {"mlp", sc.model.swiglu ? "swiglu" : "gelu"},
      {"norm", sc.model.rmsnorm ? "rmsnorm" : "layernorm"}, {"position", sc.model.rotary ? "rotary" : "learned"},
      {"bias", sc.model.bias}, {"tied_embeddings", sc.model.tied_embeddings},
      {"attention", sc.model.flash_attention ? "flash" : "unfused"},
      {"gpus", sc.cluster.world()}, {"gpu", sc.cluster.gpu.name}, {"nodes", sc.cluster.nodes},
      {"gpus_per_node", sc.cluster.gpus_per_node},
      {"tp", sc.parallel.tp}, {"pp", sc.parallel.pp}, {"dp", sc.parallel.dp}, {"ep", sc.parallel.ep},
      {"sequence_parallel", sc.parallel.sequence_parallel}, {"interleave", sc.parallel.interleave},
      {"layers_per_stage", layers_per_stage(sc)}, {"uniform_partition", uniform_partition(sc)},
      {"pipeline_engine", to_string(sc.parallel.pipeline_engine)},
      {"zero_stage", sc.zero.stage}, {"zero_engine", to_string(sc.zero.engine)},
      {"offload_optimizer", sc.zero.offload_optimizer},
      {"offload_param", sc.zero.offload_param},
      {"micro_batch", sc.training.micro_batch}, {"grad_accum", sc.training.grad_accum},
      {"global_batch", sc.training.global_batch},
      {"precision", to_string(sc.precision.dtype)}, {"recompute", to_string(sc.recompute)},
      {"optimizer", to_string(sc.optimizer.kind)}};
  j["memory_bytes"] = {{"params", r.memory.params}, {"grads", r.memory.grads},
                       {"optimizer", r.memory.optimizer}, {"activations", r.memory.activations},
                       {"comm_buffers", r.memory.comm_buffers}, {"temporaries", r.memory.temporaries},
                       {"total", r.memory.total()}, {"host", r.memory.host}, {"nvme", r.memory.nvme},
                       {"gpu_capacity", r.gpu_memory_bytes}};
  j["fits"] = r.fits;
  json sug = json::array();
  for (const auto& s : r.suggestions)
    sug.push_back({{"change", s.change}, {"peak_bytes", s.peak_bytes}, {"iteration_seconds", s.iteration_seconds},
                   {"fits", s.fits}});
  j["suggestions"] = sug;
  j["throughput"] = {{"iteration_seconds", r.iteration_seconds},
                     {"tokens_per_second", r.tokens_per_second},
                     {"samples_per_second", r.samples_per_second},
                     {"model_flops_per_iteration", r.model_flops_per_iteration},
                     {"hardware_flops_per_iteration", r.hardware_flops_per_iteration},
                     {"model_tflops_per_gpu", r.model_tflops_per_gpu},
                     {"hardware_tflops_per_gpu", r.hardware_tflops_per_gpu},
                     {"mfu", r.mfu}, {"hfu", r.hfu},
                     {"time_to_train_seconds", r.time_to_train_seconds}};
  const TimeBreakdown& t = r.time;
  j["time_seconds"] = {{"forward", t.forward}, {"backward", t.backward}, {"recompute", t.recompute},
                       {"optimizer", t.optimizer}, {"exposed_tp", t.exposed_tp}, {"exposed_pp", t.exposed_pp},
                       {"exposed_dp", t.exposed_dp}, {"exposed_ep", t.exposed_ep},
                       {"exposed_offload", t.exposed_offload}, {"bubble", t.bubble}, {"idle", t.idle}};
  j["critical_rank"] = r.critical_rank;
  j["wire_bytes_per_rank"] = r.wire_bytes_per_rank;
  if (const OneBitTraffic& t = r.onebit; sc.optimizer.kind == OptimizerKind::onebit_adam) {
    j["onebit_adam"] = {{"uncompressed_bytes_per_iteration", t.uncompressed},
                        {"compressed_bytes_per_iteration", t.compressed}};
  }
  if (!r.losses.empty()) j["losses"] = r.losses;
  j["warnings"] = sc.warnings;
  j["extras"] = r.extras;
  return j;
}

}  // namespace dssim

namespace dssim {

int critical_rank_index(const Timeline& timeline) {
  int critical = 0;
  double latest = -1;
  for (size_t ri = 0; ri < timeline.spans.size(); ++ri) {
    double end = 0;
    for (const Span& s : timeline.spans[ri]) end = std::max(end, s.end);
    if (end > latest * (1 + 1e-12)) { latest = end; critical = static_cast<int>(ri); }
  }
  return critical;
}

Report make_report(const Scenario& sc, const Program& program, const Timeline& timeline,
                   const std::string& backend) {
  Report r;
  r.backend = backend;
  r.iteration_seconds = timeline.makespan;
  const int critical = critical_rank_index(timeline);
  if (!program.ranks.empty()) {
    r.critical_rank = program.ranks[critical].rank;
    r.time = attribute_time(program, timeline, critical);
    r.wire_bytes_per_rank = wire_bytes_by_purpose(program, critical);
  }
  r.onebit = onebit_traffic(sc);
  r.memory = peak_memory(sc);
  fill_throughput(sc, r);
  r.fits = r.memory.total() <= r.gpu_memory_bytes;
  return r;
}

}  // namespace dssim

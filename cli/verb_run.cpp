// dssim run FILE.yaml --backend cuda|cpu [--nproc N] [--steps K] [--data FILE]
//          [--deepspeed_config F] [--set k=v]... [--json] [--checkpoint-dir D] [--resume]
// Trains the scenario's model for real with the torch backend and prints the measured Report.
// Options are parsed by hand: this file is also linked into dssim_torch_run, which the GPU script
// builds where Boost may be missing.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>
#include "backends/torch/run.hpp"
#include "cli/verbs.hpp"
#include "core/launch_env.hpp"
#include "core/scenario_loader.hpp"

namespace dssim::cli {
namespace {

const char* kUsage =
    "usage: dssim run FILE.yaml [options]\n"
    "  --backend cuda|cpu        where to train (default cpu)\n"
    "  --nproc N                 spawn N local ranks (otherwise RANK/WORLD_SIZE/LOCAL_RANK/\n"
    "                            MASTER_ADDR/MASTER_PORT from the environment, as torchrun sets them;\n"
    "                            under srun, from SLURM_PROCID/NTASKS/LOCALID/JOB_NODELIST)\n"
    "  --steps K                 optimizer steps (default 10)\n"
    "  --warmup K                steps left out of the median iteration time (default min(2, K/4))\n"
    "  --data FILE               train byte-level on a text file (default: synthetic tokens)\n"
    "  --deepspeed_config F      a ds_config.json mapped onto the scenario\n"
    "  --set key=value           override a scenario key (repeatable)\n"
    "  --json                    print the report as JSON\n"
    "  --checkpoint-dir D        write sharded checkpoints to D (at the end, and every --save-every)\n"
    "  --save-every K            checkpoint every K steps\n"
    "  --resume                  continue from the checkpoint in --checkpoint-dir\n"
    "  --timeout S               seconds a collective or the rendezvous may wait (default 300)\n"
    "  --quiet                   no progress line per step\n";

bool parse_int(const std::string& s, int& out) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end) return false;
  out = int(v);
  return true;
}

}  // namespace

int verb_run(int argc, char** argv) {
  tb::RunOptions o;
  std::string file;
  LoadOptions lo;
  int nproc = 0;
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "dssim run: %s\n\n%s", msg.c_str(), kUsage);
    return 2;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], v;
    const auto eq = a.find('=');
    bool has_inline = a.rfind("--", 0) == 0 && eq != std::string::npos;
    if (has_inline) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    auto value = [&](std::string& out) {
      if (has_inline) { out = v; return true; }
      if (i + 1 >= argc) return false;
      out = argv[++i];
      return true;
    };
    auto int_value = [&](int& out) {
      std::string s;
      return value(s) && parse_int(s, out);
    };
    if (a == "--help" || a == "-h") { std::fputs(kUsage, stdout); return 0; }
    else if (a == "--backend") { if (!value(o.backend)) return fail("--backend needs a value"); }
    else if (a == "--nproc") { if (!int_value(nproc) || nproc < 1) return fail("--nproc needs a positive integer"); }
    else if (a == "--steps") { if (!int_value(o.engine.steps) || o.engine.steps < 1) return fail("--steps needs a positive integer"); }
    else if (a == "--warmup") { if (!int_value(o.engine.warmup_steps) || o.engine.warmup_steps < 0) return fail("--warmup needs an integer >= 0"); }
    else if (a == "--data") { if (!value(o.engine.data_path)) return fail("--data needs a file"); }
    else if (a == "--deepspeed_config") { if (!value(lo.deepspeed_config)) return fail("--deepspeed_config needs a file"); }
    else if (a == "--set") { std::string s; if (!value(s)) return fail("--set needs key=value"); lo.overrides.push_back(s); }
    else if (a == "--json") o.json = true;
    else if (a == "--verbose" || a == "-v") o.verbose = true;
    else if (a == "--quiet") o.engine.progress = false;
    else if (a == "--checkpoint-dir") { if (!value(o.engine.checkpoint_dir)) return fail("--checkpoint-dir needs a directory"); }
    else if (a == "--save-every") { if (!int_value(o.engine.save_every) || o.engine.save_every < 0) return fail("--save-every needs an integer >= 0"); }
    else if (a == "--resume") o.engine.resume = true;
    else if (a == "--timeout") {
      std::string s;
      if (!value(s)) return fail("--timeout needs seconds");
      o.timeout_seconds = std::atof(s.c_str());
      if (o.timeout_seconds <= 0) return fail("--timeout must be positive");
    }
    // Test hooks, not in the usage text.
    else if (a == "--kill-rank") { if (!int_value(o.engine.kill_rank)) return fail("--kill-rank needs a rank"); }
    else if (a == "--kill-at-step") { if (!int_value(o.engine.kill_at_step)) return fail("--kill-at-step needs a step"); }
    else if (a == "--hang-rank") { if (!int_value(o.engine.hang_rank)) return fail("--hang-rank needs a rank"); }
    else if (a == "--hang-at-step") { if (!int_value(o.engine.hang_at_step)) return fail("--hang-at-step needs a step"); }
    else if (a == "--dump-params") { if (!value(o.engine.dump_params)) return fail("--dump-params needs a file"); }
    else if (a == "--inject-overflow") {
      std::string s, item;
      if (!value(s)) return fail("--inject-overflow needs steps, comma separated");
      std::stringstream ss(s);
      while (std::getline(ss, item, ',')) {
        int k = 0;
        if (!parse_int(item, k)) return fail("--inject-overflow: bad step '" + item + "'");
        o.engine.overflow_steps.push_back(k);
      }
    }
    else if (a.rfind("-", 0) == 0) return fail("unknown option '" + a + "'");
    else if (file.empty()) file = a;
    else return fail("more than one scenario file ('" + file + "', '" + a + "')");
  }
  if (file.empty()) return fail("no scenario file");
  if (o.backend != "cpu" && o.backend != "cuda") return fail("--backend must be cuda or cpu");
  if (o.engine.resume && o.engine.checkpoint_dir.empty()) return fail("--resume needs --checkpoint-dir");

  // Under srun (no torchrun variables, no --nproc): each Slurm task is a rank.
  if (nproc == 0) apply_slurm_env();
  if (nproc > 1 && !tb::env_has_rank()) return tb::spawn_local_ranks(nproc, o.timeout_seconds);
  Scenario sc;
  try {
    lo.gpus = tb::env_has_rank() ? tb::env_world_size() : (nproc > 0 ? nproc : 0);
    sc = load_scenario(file, lo);
    // ZeRO++ changes the Program's stage-3 collectives (quantized gathers, all-to-all gradient
    // reduction, intra-node secondary gathers), which the torch engine does not implement.
    if (sc.zero.quantized_weights || sc.zero.quantized_gradients || sc.zero.hpz())
      throw ConfigError("the torch backend does not implement ZeRO++ (zero.quantized_weights / ds_config "
                        "zero_quantized_weights, zero.quantized_gradients / zero_quantized_gradients, "
                        "zero.hpz_partition_size / zero_hpz_partition_size): simulate it with 'dssim scenario', "
                        "or turn the keys off to train the plain ZeRO-3 run");
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "dssim run: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim run: %s\n", e.what());
    return 2;
  }
  return tb::run_rank(sc, o);
}

}  // namespace dssim::cli

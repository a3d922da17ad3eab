// dssim calibrate --backend cuda|cpu [--out FILE] [--quick] [--dtype bf16,fp16,fp32] [--device N]
// Measures the device with libtorch and writes a device profile (core/device_profile.hpp) that
// scenarios name with cluster.device_profile. Options are parsed by hand: this file is also linked
// into dssim_calibrate_run, which the GPU script builds where Boost may be missing.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include "backends/torch/calibrate.hpp"
#include "cli/output_file.hpp"
#include "cli/verbs.hpp"
#include "core/scenario_loader.hpp"

namespace dssim::cli {
namespace {

const char* kUsage =
    "usage: dssim calibrate [options]\n"
    "  --backend cuda|cpu     the device to measure (default cpu)\n"
    "  --out FILE             write the profile there (atomically); default: YAML on stdout\n"
    "  --quick                a few tiny shapes in seconds (tests); not a calibration\n"
    "  --dtype LIST           comma-separated fp32,fp16,bf16 (default bf16 on cuda, fp32 on cpu)\n"
    "  --device N             CUDA device index (default 0)\n"
    "  --seconds-per-point S  timing budget of one measured point (default 0.05)\n"
    "  --no-collectives       skip NCCL collectives even with several GPUs\n"
    "  --only LIST            measure only these families: gemm, epilogues, attention, elementwise,\n"
    "                         backward, moe, optimizer, host, copies, collectives (comma-separated)\n"
    "  --merge FILE           start from the profile FILE and replace only the rows measured now\n"
    "                         (its other rows and metadata kept; a note records the merge)\n"
    "  --quiet                no progress lines on stderr\n"
    "A scenario uses the result with `cluster.device_profile: FILE` (docs/device-profile.md).\n";

bool parse_dtypes(const std::string& list, std::vector<Dtype>& out) {
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item == "fp32") out.push_back(Dtype::fp32);
    else if (item == "fp16") out.push_back(Dtype::fp16);
    else if (item == "bf16") out.push_back(Dtype::bf16);
    else return false;
  }
  return !out.empty();
}

}  // namespace

int verb_calibrate(int argc, char** argv) {
  tb::CalibrateOptions o;
  std::string out, merge;
  bool quiet = false;
  std::string command = "dssim calibrate";
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "dssim calibrate: %s\n\n%s", msg.c_str(), kUsage);
    return 2;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], v;
    const auto eq = a.find('=');
    const bool has_inline = a.rfind("--", 0) == 0 && eq != std::string::npos;
    if (has_inline) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    auto value = [&](std::string& dst) {
      if (has_inline) { dst = v; return true; }
      if (i + 1 >= argc) return false;
      dst = argv[++i];
      return true;
    };
    if (a == "--help" || a == "-h") { std::fputs(kUsage, stdout); return 0; }
    else if (a == "--backend") {
      if (!value(o.backend) || (o.backend != "cuda" && o.backend != "cpu")) return fail("--backend needs cuda or cpu");
      command += " --backend " + o.backend;
    } else if (a == "--out") { if (!value(out) || out.empty()) return fail("--out needs a file"); }
    else if (a == "--quick") { o.quick = true; command += " --quick"; }
    else if (a == "--dtype") {
      std::string s;
      if (!value(s) || !parse_dtypes(s, o.dtypes)) return fail("--dtype needs a list of fp32, fp16, bf16 (e.g. bf16,fp16)");
      command += " --dtype " + s;
    } else if (a == "--device") {
      std::string s;
      char* end = nullptr;
      if (!value(s) || (o.device = int(std::strtol(s.c_str(), &end, 10)), s.empty() || *end) || o.device < 0)
        return fail("--device needs a GPU index");
    } else if (a == "--seconds-per-point") {
      std::string s;
      char* end = nullptr;
      if (!value(s) || (o.seconds_per_point = std::strtod(s.c_str(), &end), s.empty() || *end) || !(o.seconds_per_point > 0))
        return fail("--seconds-per-point needs a positive number");
    } else if (a == "--no-collectives") { o.collectives = false; }
    else if (a == "--only") {
      std::string s, item;
      if (!value(s) || s.empty()) return fail("--only needs a list of families (e.g. moe)");
      std::stringstream ss(s);
      while (std::getline(ss, item, ',')) {
        static const std::vector<std::string> known = {"gemm",      "epilogues", "attention", "elementwise", "backward",
                                                       "moe",       "optimizer", "host",      "copies",      "collectives"};
        if (std::find(known.begin(), known.end(), item) == known.end())
          return fail("--only: unknown family '" + item + "' (gemm, epilogues, attention, elementwise, backward, moe, optimizer, "
                      "host, copies, collectives)");
        o.only.push_back(item);
      }
      command += " --only " + s;
    } else if (a == "--merge") {
      if (!value(merge) || merge.empty()) return fail("--merge needs a profile file");
    }
    else if (a == "--quiet") { quiet = true; }
    else return fail("unknown option '" + a + "'");
  }
  o.command_line = command;
  if (!quiet) o.progress = [](const std::string& line) { std::fprintf(stderr, "calibrate: %s\n", line.c_str()); };

  DeviceProfile p;
  try {
    p = tb::calibrate(o);
  } catch (const tb::CalibrateUsageError& e) {
    std::fprintf(stderr, "dssim calibrate: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim calibrate: failed: %s\n", e.what());
    return 1;
  }
  if (p.gemm.empty() && p.attention.empty() && p.elementwise.empty() && p.copy.empty() && p.collectives.empty()) {
    // Every family asked for was skipped (--only epilogues on a CPU, collectives on one GPU): say
    // why and write nothing.
    std::fprintf(stderr, "dssim calibrate: nothing was measured, no profile written%s\n",
                 p.metadata.notes.empty() ? "" : (" (" + p.metadata.notes.back() + ")").c_str());
    return 2;
  }
  if (!merge.empty()) {
    try {
      p = merge_device_profile(load_device_profile(merge), p);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dssim calibrate: --merge %s: %s\n", merge.c_str(), e.what());
      return 2;
    }
  }
  const std::string yaml = to_yaml(p);
  try {
    parse_device_profile(yaml, "calibrate output");  // what we write, the loader reads
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim calibrate: internal error, the profile does not load: %s\n", e.what());
    return 1;
  }
  if (out.empty()) {
    std::fputs(yaml.c_str(), stdout);
    std::fputs(device_profile_summary(p).c_str(), stderr);
    return 0;
  }
  try {
    write_file_atomically(out, yaml);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim calibrate: %s\n", e.what());
    return 1;
  }
  std::printf("wrote %s\n%s", out.c_str(), device_profile_summary(p).c_str());
  return 0;
}

}  // namespace dssim::cli

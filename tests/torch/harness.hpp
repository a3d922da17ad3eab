// Shared by the torch backend tests: drives the dssim_torch_run binary (the `dssim run` verb) as a
// real multi-process job on a tiny scenario and reads back its JSON report and parameter dumps.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
#include <sys/wait.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

namespace dssim::test {

namespace fs = std::filesystem;

struct Result {
  int code = -1;
  std::string out, err;
  double seconds = 0;
  nlohmann::json json;
};

// A scratch directory per test process, removed when it exits.
struct Scratch {
  fs::path dir = fs::temp_directory_path() / ("dssim_torch_tests_" + std::to_string(::getpid()));
  Scratch() { fs::create_directories(dir); }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};
inline fs::path scratch() {
  static Scratch s;
  return s.dir;
}

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs dssim_torch_run on a tiny scenario with the given arguments (JSON report on stdout), one
// thread per rank. `limit_s` bounds the whole job (coreutils timeout signals the launcher's process
// group, so its ranks too): a hang fails the test with exit code 124 instead of stalling CI.
inline Result run(const std::string& args, const std::string& scenario = "scenarios/tiny/tiny_dp2.yaml",
                  int limit_s = 300) {
  static int n = 0;
  const fs::path out = scratch() / ("out" + std::to_string(n) + ".txt");
  const fs::path err = scratch() / ("err" + std::to_string(n++) + ".txt");
  const std::string cmd = "DSSIM_CPU_THREADS=1 timeout -k 5 " + std::to_string(limit_s) + " " + DSSIM_TORCH_RUN +
                          " " + DSSIM_TEST_SOURCE_DIR + "/" + scenario + " --quiet " + args + " >" + out.string() +
                          " 2>" + err.string();
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  Result r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  r.out = slurp(out);
  r.err = slurp(err);
  if (r.code == 0 && args.find("--json") != std::string::npos) r.json = nlohmann::json::parse(r.out);
  INFO(cmd);
  return r;
}

inline std::vector<double> losses(const Result& r) { return r.json.at("losses").get<std::vector<double>>(); }
inline const nlohmann::json& measured(const Result& r) { return r.json.at("extras").at("measured"); }

inline std::vector<float> read_floats(const fs::path& p) {
  const std::string s = slurp(p);
  std::vector<float> v(s.size() / 4);
  std::memcpy(v.data(), s.data(), v.size() * 4);
  return v;
}

// A run that also dumps the whole model's final fp32 parameters (--dump-params, to a scratch file of
// its own); it must succeed (its stderr is the failure's message).
struct Trained {
  Result r;
  std::vector<float> params;
};
inline Trained train_and_dump(const std::string& args, const std::string& scenario = "scenarios/tiny/tiny_dp2.yaml") {
  static int n = 0;
  const fs::path dump = scratch() / ("params" + std::to_string(n++) + ".bin");
  Trained t{run(args + " --dump-params " + dump.string(), scenario), {}};
  INFO(scenario << " " << args << "\n" << t.r.err);
  REQUIRE(t.r.code == 0);
  t.params = read_floats(dump);
  return t;
}

inline double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]) / std::abs(a[i]));
  return m;
}

// ||a - b|| / ||a||
inline double norm_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += double(a[i] - b[i]) * double(a[i] - b[i]);
    n += double(a[i]) * double(a[i]);
  }
  return std::sqrt(d / n);
}

// Measured bytes per (op, purpose) equal the Program's, key by key (control traffic aside: the
// gradient-norm and loss all-reduces and the parameter dump's messages, purpose "none").
// `dynamic`: keys whose bytes are known at run time only (MoE all-to-alls without token dropping):
// present in both, bytes not compared.
inline void require_bytes_match(const Result& r, const std::vector<std::string>& dynamic = {}) {
  const auto& m = measured(r);
  const auto& got = m.at("bytes_per_iteration");
  const auto& want = m.at("expected_bytes_per_iteration");
  REQUIRE(!want.empty());
  for (auto it = want.begin(); it != want.end(); ++it) {
    INFO(it.key());
    if (std::find(dynamic.begin(), dynamic.end(), it.key()) != dynamic.end()) {
      CHECK(got.contains(it.key()));
      continue;
    }
    REQUIRE(got.contains(it.key()));
    CHECK(got.at(it.key()).get<double>() == Approx(it.value().get<double>()).epsilon(1e-12));
  }
  for (auto it = got.begin(); it != got.end(); ++it) {
    if (it.key().find("/none") != std::string::npos) continue;
    INFO(it.key());
    CHECK(want.contains(it.key()));
  }
}

}  // namespace dssim::test

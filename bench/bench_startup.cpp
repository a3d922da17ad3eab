// Startup of the dssim program: runs `dssim scenario SCENARIO --backend analytic` (its output
// discarded) N times after one warm-up run and prints the median and the slowest wall time, the
// largest resident set of the runs (the child's getrusage ru_maxrss), and the libtorch / CUDA /
// NCCL libraries the executable loads (ldd). Not a timed test: the figures go in docs/plan.md
// (issue 13's target: under 0.1 s).
//   bench_startup [DSSIM] [SCENARIO] [--runs N]
// DSSIM defaults to ../dssim next to this program (build/bench/bench_startup -> build/dssim),
// SCENARIO to scenarios/tiny/tiny_dp2.yaml under the source tree.
#include <sys/resource.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/scenario_loader.hpp"

namespace {

std::string self_dir() {
  std::array<char, 4096> buf{};
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  const std::string exe = n > 0 ? std::string(buf.data(), size_t(n)) : std::string(".");
  const size_t slash = exe.rfind('/');
  return slash == std::string::npos ? "." : exe.substr(0, slash);
}

struct Run {
  double seconds = 0;
  long max_rss_kib = 0;
  int status = -1;
};

Run run_once(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(null, 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  Run r;
  int status = 0;
  struct rusage ru {};
  if (pid > 0 && ::wait4(pid, &status, 0, &ru) == pid) {
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.max_rss_kib = ru.ru_maxrss;
    r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  return r;
}

// Shared libraries of `exe` whose names say libtorch, c10, CUDA or NCCL (ldd's list).
std::vector<std::string> heavy_libraries(const std::string& exe) {
  std::vector<std::string> out;
  FILE* p = ::popen(("ldd '" + exe + "' 2>/dev/null").c_str(), "r");
  if (!p) return out;
  std::array<char, 1024> line{};
  while (std::fgets(line.data(), int(line.size()), p)) {
    std::string l(line.data());
    const size_t b = l.find_first_not_of(" \t");
    const size_t e = l.find(' ', b);
    const std::string name = b == std::string::npos ? "" : l.substr(b, e == std::string::npos ? std::string::npos : e - b);
    for (const char* k : {"libtorch", "libc10", "libcuda", "libnccl", "libcudnn", "libcublas", "libnvrtc", "libcupti"})
      if (name.rfind(k, 0) == 0) {
        out.push_back(name);
        break;
      }
  }
  ::pclose(p);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dssim = self_dir() + "/../dssim";
  std::string scenario = dssim::data_root() + "/scenarios/tiny/tiny_dp2.yaml";
  int runs = 20;
  int positional = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::max(1, std::atoi(argv[++i]));
    else if (positional++ == 0) dssim = argv[i];
    else scenario = argv[i];
  }
  const std::vector<std::string> args{dssim, "scenario", scenario, "--backend", "analytic"};
  const Run first = run_once(args);  // page cache warm-up, not counted
  if (first.status != 0) {
    std::fprintf(stderr, "bench_startup: %s scenario %s --backend analytic exited %d\n", dssim.c_str(), scenario.c_str(),
                 first.status);
    return 1;
  }
  std::vector<double> secs;
  long rss = 0;
  for (int i = 0; i < runs; ++i) {
    const Run r = run_once(args);
    secs.push_back(r.seconds);
    rss = std::max(rss, r.max_rss_kib);
  }
  std::sort(secs.begin(), secs.end());
  const auto heavy = heavy_libraries(dssim);
  std::printf("%s scenario %s --backend analytic, %d runs\n", dssim.c_str(), scenario.c_str(), runs);
  std::printf("wall time: median %.4f s, slowest %.4f s; max RSS %.1f MiB\n", secs[secs.size() / 2], secs.back(),
              rss / 1024.0);
  std::printf("libtorch / CUDA / NCCL libraries it loads: %zu", heavy.size());
  for (size_t i = 0; i < heavy.size() && i < 6; ++i) std::printf("%s%s", i ? ", " : " (", heavy[i].c_str());
  std::printf("%s\n", heavy.empty() ? "" : heavy.size() > 6 ? ", ...)" : ")");
  return 0;
}

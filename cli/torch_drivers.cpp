// `dssim run` and `dssim calibrate` without libtorch in the dssim executable: both verbs replace
// the process (execv) with their driver, dssim_torch_run / dssim_calibrate_run, built next to
// dssim in the same build directory (cli/CMakeLists.txt makes dssim depend on them). The driver
// gets the verb's arguments with its own path where the verb stood, so options, output and exit
// codes are the driver's, which are the verb's (the same cli/verb_run.cpp, cli/verb_calibrate.cpp).
// Keeping libtorch (and CUDA, NCCL) out of dssim's load path lets every other verb start in
// milliseconds (bench/bench_startup).
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/verbs.hpp"

namespace dssim::cli {
namespace {

std::string self_dir() {
  std::array<char, 4096> buf{};
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return ".";
  const std::string exe(buf.data(), size_t(n));
  const size_t slash = exe.rfind('/');
  return slash == std::string::npos ? "." : exe.substr(0, slash);
}

// argv[0] is the verb ("run"); the driver takes the same arguments after its own path.
int exec_driver(const char* verb, const char* driver, int argc, char** argv) {
  const std::string path = self_dir() + "/" + driver;
  if (::access(path.c_str(), X_OK) != 0) {
    std::fprintf(stderr,
                 "dssim %s: this dssim was built without the torch backend (%s not found next to it; "
                 "configure with -DDSSIM_WITH_TORCH=ON and libtorch installed)\n",
                 verb, path.c_str());
    return 2;
  }
  std::vector<char*> args;
  args.push_back(const_cast<char*>(path.c_str()));
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  ::execv(path.c_str(), args.data());
  std::fprintf(stderr, "dssim %s: cannot start %s: %s\n", verb, path.c_str(), std::strerror(errno));
  return 1;
}

}  // namespace

int verb_run(int argc, char** argv) { return exec_driver("run", "dssim_torch_run", argc, argv); }
int verb_calibrate(int argc, char** argv) { return exec_driver("calibrate", "dssim_calibrate_run", argc, argv); }

}  // namespace dssim::cli

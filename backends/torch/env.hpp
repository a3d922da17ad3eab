// The torch backend's environment variables (launch.cpp's torchrun / Slurm rendezvous, and the
// A/B and profiling switches DSSIM_GEMM_EPILOGUES, DSSIM_CE_KERNEL, DSSIM_ZERO3_FOLD,
// DSSIM_KERNEL_TRACE): unset and empty both mean the default.
#pragma once
#include <cstdlib>
#include <string>

namespace dssim::tb {

inline int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}
inline std::string env_str(const char* name, const std::string& dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : dflt;
}

}  // namespace dssim::tb

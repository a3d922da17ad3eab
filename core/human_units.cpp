#include "core/human_units.hpp"

#include <cstdio>

namespace dssim {

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::string human_count(double v) {
  if (v >= 1e12) return fmt("%.2f T", v / 1e12);
  if (v >= 1e9) return fmt("%.2f B", v / 1e9);
  if (v >= 1e6) return fmt("%.2f M", v / 1e6);
  if (v >= 1e3) return fmt("%.2f k", v / 1e3);
  return fmt("%.0f", v);
}

std::string human_seconds(double s) {
  if (s >= 86400) return fmt("%.1f days", s / 86400);
  if (s >= 3600) return fmt("%.1f h", s / 3600);
  if (s >= 1) return fmt("%.3f s", s);
  if (s >= 1e-3) return fmt("%.2f ms", s * 1e3);
  return fmt("%.1f us", s * 1e6);
}

std::string human_flop_rate(double tflops) {
  if (tflops >= 1 || tflops == 0) return fmt("%.1f TFLOP/s", tflops);
  if (tflops >= 1e-3) return fmt("%.1f GFLOP/s", tflops * 1e3);
  return fmt("%.1f MFLOP/s", tflops * 1e6);
}

std::string human_bytes(double b) {
  if (b >= kGiB) return fmt("%.2f GiB", b / kGiB);
  if (b >= 1024.0 * 1024.0) return fmt("%.1f MiB", b / (1024.0 * 1024.0));
  if (b >= 1024.0) return fmt("%.1f KiB", b / 1024.0);
  return fmt("%.0f B", b);
}

}  // namespace dssim

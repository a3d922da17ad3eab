// Quantities printed for people, with their units: "2.45 GiB", "0.250 s", "4.5 ms", "65.57 k",
// "591.5 TFLOP/s". The reverse of scenario_units.hpp, which reads what users write. The report's
// text and `dssim plan`'s print through these, so a quantity reads the same in both.
#pragma once
#include <string>

namespace dssim {

inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// printf of one number: fmt("%.1f k", 65.6) -> "65.6 k".
std::string fmt(const char* format, double v);
// 1.23 T, 4.56 B, 7.89 M, 65.57 k, else the integer.
std::string human_count(double v);
// days, h, s (three decimals), ms, us.
std::string human_seconds(double s);
// TFLOP/s, GFLOP/s, MFLOP/s; the argument in TFLOP/s.
std::string human_flop_rate(double tflops);
// GiB, MiB, KiB, B.
std::string human_bytes(double b);

}  // namespace dssim

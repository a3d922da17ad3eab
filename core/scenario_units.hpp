// Quantities as users write them in scenarios ("200 Gb/s", "80 GiB", "2 us", "312 TFLOP/s"),
// converted to SI: bytes, bytes/s, seconds, FLOP/s, watts. Plain numbers are taken as already SI.
#pragma once
#include <optional>
#include <string>

namespace dssim {

enum class Dimension {
  None,       // a plain number (efficiencies, ratios, element counts)
  Bytes,      // B, kB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024); b/bit = 1/8 B
  Bandwidth,  // bytes/s: "300 GB/s", "200 Gb/s", "25GBps", "200 Gbps"
  Time,       // seconds: s, ms, us (µs), ns
  FlopRate,   // FLOP/s: "312 TFLOP/s", "312 TFLOPS", "1.5e12 FLOP/s"
  Flops,      // FLOP: "5 GFLOP"
  Power,      // watts: "500 W", "0.7 kW"
};
const char* to_string(Dimension);
// What a user may write, for error messages: "a bandwidth such as '200 Gb/s' or 25e9 (bytes/s)".
std::string example_of(Dimension);

// Parses `text` as a quantity of dimension `d`; nullopt if it is not a number with a unit of that
// dimension (a unit of another dimension is rejected, so "80 GiB" is not a bandwidth).
std::optional<double> parse_quantity(const std::string& text, Dimension d);

}  // namespace dssim

// Wall-clock timing on the host, shared by the engine (ZeRO state, instruction timings) and
// `dssim calibrate`.
#pragma once
#include <chrono>

namespace dssim::tb {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace dssim::tb

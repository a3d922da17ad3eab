// Writing a result file so that a failed or interrupted run never leaves a partial one:
// write a temporary next to it, then rename over the target.
#pragma once
#include <string>

namespace dssim::cli {

void write_file_atomically(const std::string& path, const std::string& contents);

}  // namespace dssim::cli

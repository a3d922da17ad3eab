#include "cli/output_file.hpp"

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <unistd.h>

namespace dssim::cli {

void write_file_atomically(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write '" + path + "': cannot create " + tmp);
    f << contents;
    f.flush();
    if (!f) {
      std::remove(tmp.c_str());
      throw std::runtime_error("cannot write '" + path + "' (disk full?)");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write '" + path + "': rename failed");
  }
}

}  // namespace dssim::cli

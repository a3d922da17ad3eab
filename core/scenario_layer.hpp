// One layer of scenario settings, flattened to dotted key paths ("parallel.tp"), each remembering
// where it was written so that errors can point at it. Layers stack: preset < scenario file <
// ds_config.json < --set.
#pragma once
#include <map>
#include <string>
#include <yaml-cpp/yaml.h>

namespace dssim {

struct Entry {
  std::string key;         // dssim key path, e.g. "zero.stage"
  YAML::Node value;        // a scalar or a sequence
  std::string origin;      // file it came from, "--set", or the ds_config path
  int line = 0;            // 1-based line in `origin`; 0 = not a YAML line
  std::string written_as;  // the key as the user wrote it when it differs (a ds_config key)

  Entry() = default;
  Entry(std::string k, YAML::Node v, std::string o, int l, std::string w)
      : key(std::move(k)), value(std::move(v)), origin(std::move(o)), line(l), written_as(std::move(w)) {}
  Entry(const Entry&) = default;
  // YAML::Node's operator= writes through to the node it refers to (it would rewrite the
  // document the value came from): rebind instead.
  Entry& operator=(const Entry& o) {
    key = o.key;
    value.reset(o.value);
    origin = o.origin;
    line = o.line;
    written_as = o.written_as;
    return *this;
  }

  // "parallel.tp at line 3", "zero_optimization.stage (zero.stage)", "parallel.tp (--set)".
  std::string where() const {
    std::string w = written_as.empty() ? key : written_as + " (" + key + ")";
    if (line > 0) w += " at line " + std::to_string(line);
    else if (origin == "--set") w += " (--set)";
    return w;
  }
};

using Layer = std::map<std::string, Entry>;

}  // namespace dssim

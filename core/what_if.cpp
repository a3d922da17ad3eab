#include "core/what_if.hpp"

#include <cmath>
#include <cstdlib>
#include <sstream>
#include "core/scenario_loader.hpp"

namespace dssim {

const char* what_if_grammar() {
  return "slow-gpu RANKS xF (e.g. 'slow-gpu 17 x0.8', 'slow-gpu 16-23 x0.5'), link NAME xF|down (e.g. 'link nic-3-1 x0.5'), "
         "nic NODE.I xF|down (e.g. 'nic 2.0 x0.5', 'nic 2.0 down'), node N down-links xF (e.g. 'node 2 down-links x0.25'), "
         "noise P% (e.g. 'noise 5%'), background-traffic F (e.g. 'background-traffic 0.3')";
}

namespace {

[[noreturn]] void bad(const std::string& spec, const std::string& why) {
  throw ConfigError("what-if '" + spec + "': " + why + "; the forms are: " + what_if_grammar());
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end && *end == '\0' && std::isfinite(out);
}

bool parse_int(const std::string& s, int& out) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  out = std::atoi(s.c_str());
  return true;
}

double parse_factor(const std::string& spec, const std::string& w) {
  double f = 0;
  if (w.size() < 2 || w[0] != 'x' || !parse_double(w.substr(1), f))
    bad(spec, "expected a factor written xF (x0.5 = half the speed or bandwidth), got '" + w + "'");
  if (f <= 0) bad(spec, "the factor must be greater than 0, got '" + w + "' (a NIC that is down: 'nic NODE.I down' or 'link nic-N-J down')");
  return f;
}

std::vector<int> parse_ranks(const std::string& spec, const std::string& w) {
  std::vector<int> out;
  std::istringstream items(w);
  for (std::string item; std::getline(items, item, ',');) {
    const auto dash = item.find('-');
    int a = 0, b = 0;
    if (dash == std::string::npos) {
      if (!parse_int(item, a)) bad(spec, "'" + item + "' is not a rank (ranks: 17, 3,17 or 16-23)");
      out.push_back(a);
    } else {
      if (!parse_int(item.substr(0, dash), a) || !parse_int(item.substr(dash + 1), b) || b < a)
        bad(spec, "'" + item + "' is not a rank range (16-23: first to last, inclusive)");
      if (b - a > 10'000'000) bad(spec, "rank range '" + item + "' is too large");
      for (int r = a; r <= b; ++r) out.push_back(r);
    }
  }
  if (out.empty()) bad(spec, "no ranks given");
  return out;
}

}  // namespace

WhatIf parse_what_if(const std::string& spec) {
  std::istringstream in(spec);
  std::vector<std::string> w;
  for (std::string t; in >> t;) w.push_back(t);
  WhatIf wi;
  wi.spec = spec;
  if (w.empty()) bad(spec, "empty");
  const std::string& k = w[0];
  if (k == "slow-gpu") {
    if (w.size() != 3) bad(spec, "slow-gpu takes RANKS and xF");
    wi.kind = WhatIf::Kind::SlowGpu;
    wi.ranks = parse_ranks(spec, w[1]);
    wi.factor = parse_factor(spec, w[2]);
  } else if (k == "link") {
    if (w.size() != 3) bad(spec, "link takes NAME and xF (or down)");
    wi.kind = WhatIf::Kind::Link;
    wi.link = w[1];
    for (const char* suffix : {"_UP", "_DOWN"}) {
      const std::string s(suffix);
      if (wi.link.size() > s.size() && wi.link.compare(wi.link.size() - s.size(), s.size(), s) == 0)
        bad(spec, "what-ifs scale both directions of a link: write 'link " + wi.link.substr(0, wi.link.size() - s.size()) +
                      " " + w[2] + "'");
    }
    wi.factor = w[2] == "down" ? 0.0 : parse_factor(spec, w[2]);
  } else if (k == "nic") {
    if (w.size() != 3) bad(spec, "nic takes NODE.I and xF");
    const auto dot = w[1].find('.');
    if (dot == std::string::npos || !parse_int(w[1].substr(0, dot), wi.node) || !parse_int(w[1].substr(dot + 1), wi.nic))
      bad(spec, "expected NODE.I (node index, NIC index in the node: 2.0), got '" + w[1] + "'");
    wi.kind = WhatIf::Kind::Nic;
    wi.factor = w[2] == "down" ? 0.0 : parse_factor(spec, w[2]);
  } else if (k == "node") {
    if (w.size() != 4 || w[2] != "down-links") bad(spec, "node takes N down-links xF");
    if (!parse_int(w[1], wi.node)) bad(spec, "'" + w[1] + "' is not a node index");
    wi.kind = WhatIf::Kind::Node;
    wi.factor = parse_factor(spec, w[3]);
  } else if (k == "noise") {
    if (w.size() != 2 || w[1].size() < 2 || w[1].back() != '%' || !parse_double(w[1].substr(0, w[1].size() - 1), wi.factor))
      bad(spec, "noise takes a percentage, e.g. 'noise 5%'");
    if (wi.factor < 0 || wi.factor > 100) bad(spec, "the noise's coefficient of variation must be between 0% and 100%");
    wi.kind = WhatIf::Kind::Noise;
    wi.factor /= 100;
  } else if (k == "background-traffic") {
    if (w.size() != 2 || !parse_double(w[1], wi.factor)) bad(spec, "background-traffic takes a fraction, e.g. 0.3");
    if (wi.factor < 0 || wi.factor >= 1)
      bad(spec, "the fraction of each inter-node link taken must be at least 0 and below 1, got " + w[1]);
    wi.kind = WhatIf::Kind::Background;
  } else {
    bad(spec, "unknown what-if '" + k + "'");
  }
  return wi;
}

void check_what_ifs(const Scenario& sc, const std::vector<WhatIf>& what_ifs) {
  const auto& c = sc.cluster;
  int noise = 0;
  for (const WhatIf& w : what_ifs) {
    auto fail = [&](const std::string& why) { throw ConfigError("what-if '" + w.spec + "': " + why); };
    switch (w.kind) {
      case WhatIf::Kind::SlowGpu:
        for (int r : w.ranks)
          if (r >= c.world())
            fail("rank " + std::to_string(r) + " does not exist: the cluster has " + std::to_string(c.world()) +
                 " GPUs (ranks 0-" + std::to_string(c.world() - 1) + ")");
        break;
      case WhatIf::Kind::Nic:
        if (w.nic >= std::max(1, c.nics_per_node))
          fail("node " + std::to_string(w.node) + " has NICs 0-" + std::to_string(std::max(1, c.nics_per_node) - 1) +
               " (cluster.nics_per_node " + std::to_string(c.nics_per_node) + ")");
        [[fallthrough]];
      case WhatIf::Kind::Node:
        if (w.node >= c.nodes)
          fail("node " + std::to_string(w.node) + " does not exist: the cluster has " + std::to_string(c.nodes) +
               " nodes (0-" + std::to_string(c.nodes - 1) + ")");
        if (c.nodes < 2) fail("a one-node cluster has no NICs in use (the GPUs talk over " + c.intra_node + ")");
        break;
      case WhatIf::Kind::Noise:
        if (++noise > 1) fail("give one noise what-if");
        break;
      default:
        break;
    }
  }
}

}  // namespace dssim

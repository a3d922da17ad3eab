// What-ifs of one simulated iteration (docs/simulator.md "What-ifs"): a slow GPU, a degraded link,
// NIC or node, kernel-time noise, background traffic. The spec grammar:
//
//   slow-gpu RANKS xF        RANKS: 17 | 3,17 | 16-23 (combinations: 0,16-23); kernels take 1/F as long
//   link NAME xF             a link as the report names it (nic-3-1, leafup-0-2, nvlink-17, pcie-5,
//                            hostmem-2, podup-0), both directions; bandwidth x F
//   link nic-N-J down        (WhatIf::factor 0) the NIC's GPUs reroute through the node's next NIC
//   nic NODE.I xF | down     NIC I of node NODE; bandwidth x F, or down as above
//   node N down-links xF     every NIC of node N; bandwidth x F
//   noise P%                 every compute instruction's time drawn around its mean, CV P %
//   background-traffic F     a fraction F of every inter-node link (NICs, leaf and pod uplinks) taken
//
// Parsing checks the grammar only; check_what_ifs checks ranks, nodes and NICs against a cluster.
#pragma once
#include <string>
#include <vector>
#include "core/scenario.hpp"

namespace dssim {

// Throws ConfigError naming the spec, what is wrong and the grammar.
WhatIf parse_what_if(const std::string& spec);
// The grammar, one form per line (for messages and --help).
const char* what_if_grammar();
// Ranks, nodes and NICs within the scenario's cluster; throws ConfigError naming the spec.
void check_what_ifs(const Scenario& sc, const std::vector<WhatIf>& what_ifs);

}  // namespace dssim

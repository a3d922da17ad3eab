// Chrome trace / Perfetto JSON of a simulated (or estimated) iteration: one process per rank, one
// thread per stream, one complete ("X") slice per instruction, named as in the Program.
#pragma once
#include <string>
#include <vector>
#include "core/program.hpp"
#include "core/timeline.hpp"

namespace dssim::sim {

// Name of an instruction's slice: the op, then what it is for and which micro-batch
// ("forward mb3", "all_reduce tensor_parallel mb3", "reduce_scatter gradient_reduce b2").
std::string slice_name(const Program& program, const Instruction& in);

// `ranks[k]` is the global rank of spans[k], whose instructions are program.ranks[templates[k]]'s.
// `only`: ranks to write (empty = all). Times are written in microseconds with nanosecond
// resolution; slice boundaries are rounded once, so slices on a stream never overlap.
void write_chrome_trace(const std::string& path, const Program& program, const std::vector<int>& ranks,
                        const std::vector<int>& templates, const std::vector<std::vector<Span>>& spans,
                        const std::vector<int>& only = {});

}  // namespace dssim::sim

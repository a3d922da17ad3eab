// Option parsing shared by the verbs: boost::program_options with an optional positional FILE,
// `--help`, and the same error shape everywhere ("dssim VERB: <problem>" and the usage, exit 2).
#pragma once
#include <boost/program_options.hpp>
#include <optional>

namespace dssim::cli {

// Returns an exit code when the verb should stop now (0 after --help, 2 on a usage error), or
// nothing when `vm` holds the parsed options. With `positional_file`, a bare argument is "file".
std::optional<int> parse_options(const char* verb, int argc, char** argv,
                                 const boost::program_options::options_description& opts,
                                 boost::program_options::variables_map& vm, bool positional_file);

}  // namespace dssim::cli

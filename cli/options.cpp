#include "cli/options.hpp"

#include <cstdio>
#include <iostream>

namespace po = boost::program_options;

namespace dssim::cli {

std::optional<int> parse_options(const char* verb, int argc, char** argv, const po::options_description& opts,
                                 po::variables_map& vm, bool positional_file) {
  po::options_description hidden;
  hidden.add_options()("file", po::value<std::string>(), "input file");
  po::options_description all;
  all.add(opts);
  po::positional_options_description pos;
  if (positional_file) {
    all.add(hidden);
    pos.add("file", 1);
  }
  try {
    po::store(po::command_line_parser(argc, argv).options(all).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::fprintf(stderr, "dssim %s: %s\n\n", verb, e.what());
    std::cerr << opts;
    return 2;
  }
  if (vm.count("help")) {
    std::cout << opts;
    return 0;
  }
  return std::nullopt;
}

}  // namespace dssim::cli

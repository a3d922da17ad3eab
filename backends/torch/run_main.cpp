// dssim_torch_run FILE.yaml ...: the `dssim run` verb on its own. argv[0] stands where the verb
// would be in `dssim run ...`.
#include "cli/verbs.hpp"
int main(int argc, char** argv) { return dssim::cli::verb_run(argc, argv); }

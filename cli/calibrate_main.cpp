// dssim_calibrate_run ...: the `dssim calibrate` verb on its own. argv[0] stands where the verb
// would be in `dssim calibrate ...`.
#include "cli/verbs.hpp"
int main(int argc, char** argv) { return dssim::cli::verb_calibrate(argc, argv); }

// The dssim program's verbs. Each parses its own options (boost::program_options) and returns the
// process exit code: 0 success, 1 runtime failure, 2 bad input (config / usage).
#pragma once

namespace dssim::cli {

int verb_scenario(int argc, char** argv);  // cli/verb_scenario.cpp
int verb_run(int argc, char** argv);       // cli/verb_run.cpp (torch backend)
int verb_validate(int argc, char** argv);  // cli/verb_validate.cpp
int verb_calibrate(int argc, char** argv); // cli/verb_calibrate.cpp (torch backend)
int verb_compare(int argc, char** argv);   // cli/verb_compare.cpp
int verb_plan(int argc, char** argv);      // cli/verb_plan.cpp

}  // namespace dssim::cli

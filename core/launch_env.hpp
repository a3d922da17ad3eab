// The rendezvous environment of a rank, as torchrun sets it (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), filled from Slurm's when a script launches dssim
// with srun instead: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (or the first
// count of SLURM_TASKS_PER_NODE) and the first host of SLURM_JOB_NODELIST. `dssim run` calls it
// (cli/verb_run.cpp) before it reads the torchrun variables; no torch here, so core tests cover it.
#pragma once
#include <functional>
#include <map>
#include <string>

namespace dssim {

// The first host of a Slurm hostlist: "gpu[003-004,010],cpu01" -> "gpu003",
// "rack[1-2]-n[07-08]" -> "rack1-n07", "a,b" -> "a". Empty for an empty list.
std::string slurm_first_host(const std::string& nodelist);

// The torchrun variables to set from Slurm's, given a lookup of the environment (nullptr when a
// variable is unset). Empty when RANK or WORLD_SIZE is already set, or SLURM_PROCID / SLURM_NTASKS
// is not (not launched by srun). MASTER_ADDR only when unset (first host of SLURM_JOB_NODELIST,
// else SLURM_NODELIST); MASTER_PORT is left to its default (29500) or the script.
std::map<std::string, std::string> torchrun_env_from_slurm(const std::function<const char*(const char*)>& getenv);

// The same on the process environment, set with setenv; returns whether Slurm's were used.
bool apply_slurm_env();

}  // namespace dssim

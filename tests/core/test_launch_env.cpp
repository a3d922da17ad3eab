// core/launch_env: torchrun's variables from Slurm's (dssim run under srun).
#include <catch2/catch.hpp>

#include "core/launch_env.hpp"

using namespace dssim;

namespace {
std::map<std::string, std::string> from(const std::map<std::string, std::string>& env) {
  return torchrun_env_from_slurm([&](const char* k) -> const char* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}
}  // namespace

TEST_CASE("launch env: the first host of a Slurm hostlist", "[launch]") {
  CHECK(slurm_first_host("gpu[003-004,010],cpu01") == "gpu003");
  CHECK(slurm_first_host("node7") == "node7");
  CHECK(slurm_first_host("a,b,c") == "a");
  CHECK(slurm_first_host("n[12,15-16]") == "n12");
  CHECK(slurm_first_host("rack[1-2]-n[07-08]") == "rack1-n07");
  CHECK(slurm_first_host("") == "");
}

TEST_CASE("launch env: srun's variables become torchrun's", "[launch]") {
  const auto e = from({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                       {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_JOB_NODELIST", "gpu[003-004]"}});
  CHECK(e.at("RANK") == "5");
  CHECK(e.at("WORLD_SIZE") == "8");
  CHECK(e.at("LOCAL_RANK") == "1");
  CHECK(e.at("LOCAL_WORLD_SIZE") == "4");
  CHECK(e.at("MASTER_ADDR") == "gpu003");
  CHECK(e.count("MASTER_PORT") == 0);
  // SLURM_NTASKS_PER_NODE wins over the task list; an existing MASTER_ADDR is kept.
  const auto f = from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NTASKS_PER_NODE", "2"},
                       {"SLURM_TASKS_PER_NODE", "1(x2)"}, {"SLURM_JOB_NODELIST", "x"}, {"MASTER_ADDR", "10.0.0.1"}});
  CHECK(f.at("LOCAL_WORLD_SIZE") == "2");
  CHECK(f.count("MASTER_ADDR") == 0);
  CHECK(f.at("LOCAL_RANK") == "0");
}

TEST_CASE("launch env: torchrun's variables or no srun leave the environment alone", "[launch]") {
  CHECK(from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}}).empty());
  CHECK(from({{"WORLD_SIZE", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}}).empty());
  CHECK(from({{"SLURM_JOB_NODELIST", "n[1-2]"}}).empty());  // an allocation, not an srun task
  CHECK(from({}).empty());
}

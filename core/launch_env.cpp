#include "core/launch_env.hpp"

#include <cstdlib>

namespace dssim {

std::string slurm_first_host(const std::string& nodelist) {
  // The first top-level item (commas inside brackets belong to the ranges).
  std::string item;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    item += c;
  }
  // Each bracket group becomes the start of its first range ("003-004,010" -> "003").
  std::string host;
  for (size_t i = 0; i < item.size(); ++i) {
    if (item[i] != '[') {
      host += item[i];
      continue;
    }
    const size_t close = item.find(']', i);
    const std::string ranges = item.substr(i + 1, close == std::string::npos ? std::string::npos : close - i - 1);
    host += ranges.substr(0, ranges.find_first_of(",-"));
    if (close == std::string::npos) break;
    i = close;
  }
  return host;
}

std::map<std::string, std::string> torchrun_env_from_slurm(const std::function<const char*(const char*)>& getenv) {
  std::map<std::string, std::string> out;
  auto has = [&](const char* k) { return getenv(k) != nullptr && *getenv(k) != '\0'; };
  if (has("RANK") || has("WORLD_SIZE") || !has("SLURM_PROCID") || !has("SLURM_NTASKS")) return out;
  out["RANK"] = getenv("SLURM_PROCID");
  out["WORLD_SIZE"] = getenv("SLURM_NTASKS");
  if (!has("LOCAL_RANK")) out["LOCAL_RANK"] = has("SLURM_LOCALID") ? getenv("SLURM_LOCALID") : out["RANK"];
  if (!has("LOCAL_WORLD_SIZE")) {
    std::string per_node;
    if (has("SLURM_NTASKS_PER_NODE")) per_node = getenv("SLURM_NTASKS_PER_NODE");
    else if (has("SLURM_TASKS_PER_NODE")) per_node = getenv("SLURM_TASKS_PER_NODE");  // "4(x2),3": the first node's
    const size_t digits = per_node.find_first_not_of("0123456789");
    per_node = per_node.substr(0, digits);
    out["LOCAL_WORLD_SIZE"] = per_node.empty() ? out["WORLD_SIZE"] : per_node;
  }
  if (!has("MASTER_ADDR")) {
    const char* list = has("SLURM_JOB_NODELIST") ? getenv("SLURM_JOB_NODELIST") : has("SLURM_NODELIST") ? getenv("SLURM_NODELIST") : nullptr;
    if (list && !slurm_first_host(list).empty()) out["MASTER_ADDR"] = slurm_first_host(list);
  }
  return out;
}

bool apply_slurm_env() {
  const auto vars = torchrun_env_from_slurm([](const char* k) { return static_cast<const char*>(std::getenv(k)); });
  for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
  return !vars.empty();
}

}  // namespace dssim

#include "backends/torch/checkpoint.hpp"
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <nlohmann/json.hpp>

namespace dssim::tb {
namespace fs = std::filesystem;

namespace {
void write_tensor(std::ofstream& out, const at::Tensor& t) {
  auto c = t.to(at::kCPU).contiguous();
  int64_t n = c.numel() * int64_t(c.element_size());
  out.write(reinterpret_cast<const char*>(&n), sizeof n);
  out.write(static_cast<const char*>(c.data_ptr()), n);
}
void read_tensor(std::ifstream& in, at::Tensor& t, const std::string& file) {
  int64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), sizeof n);
  if (!in || n != t.numel() * int64_t(t.element_size()))
    throw std::runtime_error("checkpoint " + file + ": tensor size does not match this run's layout");
  auto c = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(false));
  in.read(static_cast<char*>(c.data_ptr()), n);
  if (!in) throw std::runtime_error("checkpoint " + file + " is truncated");
  t.copy_(c);
}
std::string rank_file(const fs::path& dir, int rank) { return (dir / ("rank" + std::to_string(rank) + ".bin")).string(); }
}  // namespace

std::string checkpoint_step_dir(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%06lld", (long long)step);
  return name;
}

void write_rank_checkpoint(const fs::path& dir, int rank, const RankCheckpoint& c) {
  fs::create_directories(dir);
  const std::string file = rank_file(dir, rank), tmp = file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&c.step), sizeof c.step);
    out.write(reinterpret_cast<const char*>(&c.adam_step), sizeof c.adam_step);
    out.write(reinterpret_cast<const char*>(&c.scaler), sizeof c.scaler);
    write_tensor(out, c.master);
    write_tensor(out, c.exp_avg);
    write_tensor(out, c.exp_avg_sq);
    for (const auto& t : c.extra) write_tensor(out, t);
    out.flush();
    if (!out) throw std::runtime_error("cannot write checkpoint " + tmp);
  }
  fs::rename(tmp, file);
}

void write_checkpoint_manifest(const fs::path& root, int64_t step, const CheckpointLayout& l) {
  nlohmann::json m = {{"step", step}, {"world", l.world}, {"tp", l.tp}, {"pp", l.pp}, {"zero_stage", l.zero_stage},
                      {"dtype", l.dtype}, {"dir", checkpoint_step_dir(step)}, {"padded_numel", l.padded_numel}};
  const auto mf = root / "manifest.json", mtmp = root / "manifest.json.tmp";
  {
    std::ofstream out(mtmp);
    out << m.dump(2) << "\n";
    if (!out) throw std::runtime_error("cannot write checkpoint manifest " + mtmp.string());
  }
  fs::rename(mtmp, mf);
}

fs::path read_checkpoint_manifest(const fs::path& root, const CheckpointLayout& mine, int64_t* step) {
  const fs::path mf = root / "manifest.json";
  std::ifstream in(mf);
  if (!in) throw std::invalid_argument("--resume: no checkpoint manifest at " + mf.string());
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::invalid_argument("--resume: " + mf.string() + " is not a dssim checkpoint manifest: " + e.what());
  }
  const int world = m.at("world"), stage = m.at("zero_stage");
  const int tp = m.value("tp", 1), pp = m.value("pp", 1);
  if (world != mine.world || stage != mine.zero_stage || tp != mine.tp || pp != mine.pp)
    throw std::invalid_argument("--resume: the checkpoint in " + root.string() + " was written by " +
                                std::to_string(world) + " ranks (tp " + std::to_string(tp) + ", pp " +
                                std::to_string(pp) + ") with ZeRO stage " + std::to_string(stage) + "; this run has " +
                                std::to_string(mine.world) + " ranks (tp " + std::to_string(mine.tp) + ", pp " +
                                std::to_string(mine.pp) + ") with stage " + std::to_string(mine.zero_stage) +
                                ". Resuming with a different world size, layout or stage is not supported.");
  if (mine.pp == 1 && m.at("padded_numel").get<int64_t>() != mine.padded_numel)
    throw std::invalid_argument("--resume: the checkpoint is of a different model");
  *step = m.at("step").get<int64_t>();
  return root / m.at("dir").get<std::string>();
}

void read_rank_checkpoint(const fs::path& dir, int rank, int64_t step, RankCheckpoint& c) {
  const std::string file = rank_file(dir, rank);
  std::ifstream f(file, std::ios::binary);
  if (!f) throw std::runtime_error("--resume: missing shard " + file);
  f.read(reinterpret_cast<char*>(&c.step), sizeof c.step);
  f.read(reinterpret_cast<char*>(&c.adam_step), sizeof c.adam_step);
  f.read(reinterpret_cast<char*>(&c.scaler), sizeof c.scaler);
  if (c.step != step) throw std::runtime_error("--resume: shard " + file + " is of another step");
  read_tensor(f, c.master, file);
  read_tensor(f, c.exp_avg, file);
  read_tensor(f, c.exp_avg_sq, file);
  for (auto& t : c.extra) read_tensor(f, t, file);
}

}  // namespace dssim::tb

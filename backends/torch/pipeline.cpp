#include "backends/torch/pipeline.hpp"
#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace dssim::tb {

int StageLayout::chunk_of_layer(int layer) const {
  for (size_t c = 0; c < chunks.size(); ++c)
    if (layer >= chunks[c].layer_begin && layer < chunks[c].layer_end()) return int(c);
  throw std::runtime_error("Program error: layer " + std::to_string(layer) + " is on another pipeline stage");
}

bool StageLayout::owns(int unit) const { return std::find(units.begin(), units.end(), unit) != units.end(); }

StageLayout stage_layout(const GptConfig& c, const RankProgram& rp, int pp) {
  StageLayout s;
  for (const Instruction& in : rp.instructions) {
    if (in.op != Op::Forward) continue;
    const int ch = std::max(0, in.chunk);
    if (int(s.chunks.size()) <= ch) s.chunks.resize(ch + 1, {-1, 0, false, false});
    auto& k = s.chunks[ch];
    const int b = std::max(0, in.layer_begin), e = in.layer_count > 0 ? b + in.layer_count : c.layers;
    if (k.layer_begin < 0) {
      k.layer_begin = b;
      k.layer_count = e - b;
    } else {
      const int lo = std::min(k.layer_begin, b), hi = std::max(k.layer_end(), e);
      k.layer_begin = lo;
      k.layer_count = hi - lo;
    }
  }
  if (s.chunks.empty()) throw std::runtime_error("Program error: rank " + std::to_string(rp.rank) + " has no Forward");
  for (size_t ch = 0; ch < s.chunks.size(); ++ch) {
    auto& k = s.chunks[ch];
    if (k.layer_begin < 0) throw std::runtime_error("Program error: model chunk " + std::to_string(ch) + " never runs");
    k.first = k.layer_begin == 0;
    k.last = k.layer_end() == c.layers;
    if (k.first) s.units.push_back(0);
    for (int l = k.layer_begin; l < k.layer_end(); ++l) s.units.push_back(c.block_unit(l));
    if (k.last) {
      s.units.push_back(c.final_unit());
      if (pp > 1) s.units.push_back(c.head_copy_unit());
    }
  }
  return s;
}

void PipeMessages::send(const Instruction& in, const at::Tensor& t) {
  at::Tensor msg = t.contiguous();
  const double bytes = double(msg.numel()) * double(msg.element_size());
  if (in.bytes > 0 && std::abs(bytes - in.bytes) > 0.5)
    throw std::runtime_error("Program/engine mismatch: " + std::string(to_string(in.purpose)) + " send of " +
                             std::to_string(bytes) + " bytes, the Program says " + std::to_string(in.bytes));
  sends_.push_back(world_.send(msg, in.peer, in.tag, in.purpose));
}

void PipeMessages::post_recv(const Instruction& in, at::Tensor buffer) {
  const double bytes = double(buffer.numel()) * double(buffer.element_size());
  if (in.bytes > 0 && std::abs(bytes - in.bytes) > 0.5)
    throw std::runtime_error("Program/engine mismatch: " + std::string(to_string(in.purpose)) + " receive of " +
                             std::to_string(bytes) + " bytes, the Program says " + std::to_string(in.bytes));
  const auto key = std::make_tuple(in.purpose, std::max(0, in.chunk), in.micro_batch);
  if (recvs_.count(key))
    throw std::runtime_error("Program error: a second receive of the same message (" + std::string(to_string(in.purpose)) +
                             ", micro-batch " + std::to_string(in.micro_batch) + ")");
  auto work = world_.recv(buffer, in.peer, in.tag, in.purpose);
  recvs_[key] = {buffer, work};
}

at::Tensor PipeMessages::take(Purpose p, int chunk, int mb, double* waited) {
  auto it = recvs_.find({p, chunk, mb});
  if (it == recvs_.end())
    throw std::runtime_error(std::string("Program error: ") + to_string(p) + " of micro-batch " + std::to_string(mb) +
                             " (chunk " + std::to_string(chunk) + ") used before any Recv of it");
  const auto t0 = std::chrono::steady_clock::now();
  it->second.work->wait();
  if (waited) *waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  at::Tensor out = it->second.buffer;
  recvs_.erase(it);
  return out;
}

void PipeMessages::finish_sends() {
  for (auto& w : sends_) w->wait();
  sends_.clear();
}

}  // namespace dssim::tb

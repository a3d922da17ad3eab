#include "backends/torch/onebit_adam.hpp"
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include "core/optimizer_step.hpp"

namespace dssim::tb {

int64_t onebit_padded_numel(int64_t numel, int n) {
  if (n < 1) throw std::invalid_argument("onebit_padded_numel: group size < 1");
  const int64_t divider = int64_t(n) * 8 / std::gcd(n, 8);  // lcm(n, 8)
  const int64_t unit = int64_t(n) * divider;
  return (numel + unit - 1) / unit * unit;
}

at::Tensor pack_signs(const at::Tensor& x) {
  TORCH_CHECK(x.numel() % 8 == 0, "pack_signs: numel must be a multiple of 8");
  static const int64_t kWeights[8] = {128, 64, 32, 16, 8, 4, 2, 1};
  const auto w = at::from_blob(const_cast<int64_t*>(kWeights), {8}, at::kLong).to(x.device()).to(at::kByte);
  // One byte of bits per element, weighted and summed per group of 8: all on x's device.
  return at::sum(x.reshape({-1, 8}).ge(0).to(at::kByte).mul_(w), {1}, false, at::kByte);
}

at::Tensor unpack_signs(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, "unpack_signs: uint8 input");
  static const int64_t kShifts[8] = {7, 6, 5, 4, 3, 2, 1, 0};
  const auto s = at::from_blob(const_cast<int64_t*>(kShifts), {8}, at::kLong).to(packed.device()).to(at::kByte);
  const auto bits = at::bitwise_and(at::bitwise_right_shift(packed.reshape({-1, 1}), s), 1);
  // DeepSpeed: .float().add_(-0.5).mul_(2.0)
  return bits.to(at::kFloat).add_(-0.5).mul_(2.0).reshape({-1});
}

namespace {
// +1 where x >= 0, -1 elsewhere (DeepSpeed: x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)).
at::Tensor signs_of(const at::Tensor& x) { return x.ge(0).to(at::kFloat).add_(-0.5).mul_(2.0); }
}  // namespace

OnebitAdam::OnebitAdam(int64_t numel, Communicator* dp, int64_t freeze_step, const at::TensorOptions& fp32)
    : numel_(numel), dp_(dp), size_(dp ? dp->size() : 1), rank_(dp ? dp->rank() : 0), freeze_step_(freeze_step) {
  if (freeze_step < 1)
    throw std::invalid_argument("torch backend: 1-bit Adam needs optimizer.freeze_step >= 1 (the variance it freezes "
                                "comes from the warm-up's Adam steps)");
  n_ = onebit_padded_numel(numel, size_);
  chunk_ = n_ / size_;
  worker_error_ = at::zeros({n_}, fp32);
  server_error_ = at::zeros({chunk_}, fp32);
}

void OnebitAdam::update_momentum(at::Tensor& m, const at::Tensor& g, double beta1) const {
  m.mul_(beta1).add_(g, 1.0 - beta1);
}

void OnebitAdam::run(const Instruction& in, at::Tensor& m) {
  phase(in.op, in.purpose, in.bytes * std::max(1, in.repeat), m);
}

void OnebitAdam::compressed_allreduce(at::Tensor& m) {
  phase(Op::AllToAll, Purpose::OneBitSigns, double(n_) / 8, m);
  phase(Op::AllGather, Purpose::OneBitScales, 4.0 * size_, m);
  phase(Op::AllGather, Purpose::OneBitServer, double(n_) / 8, m);
  phase(Op::AllGather, Purpose::OneBitScales, 4.0 * size_, m);
}

void OnebitAdam::phase(Op op, Purpose p, double program_bytes, at::Tensor& m) {
  if (!dp_ || size_ < 2) throw std::runtime_error("Program error: 1-bit Adam communication without a data-parallel group");
  static const struct { Op op; Purpose p; } kOrder[4] = {{Op::AllToAll, Purpose::OneBitSigns},
                                                           {Op::AllGather, Purpose::OneBitScales},
                                                           {Op::AllGather, Purpose::OneBitServer},
                                                           {Op::AllGather, Purpose::OneBitScales}};
  if (op != kOrder[next_].op || p != kOrder[next_].p)
    throw std::runtime_error(std::string("Program error: 1-bit Adam expected ") + to_string(kOrder[next_].op) + "/" +
                             to_string(kOrder[next_].p) + ", got " + to_string(op) + "/" + to_string(p));
  const double bytes = (next_ == 0 || next_ == 2) ? double(n_) / 8 : 4.0 * size_;
  if (std::abs(bytes - program_bytes) > 0.5)
    throw std::runtime_error(std::string("Program/engine mismatch: 1-bit Adam ") + to_string(op) + "/" + to_string(p) +
                             " is " + std::to_string(program_bytes) + " bytes in the Program, " +
                             std::to_string(bytes) + " sent (padded buffer of " + std::to_string(n_) + " elements)");
  TORCH_CHECK(m.numel() == numel_ && m.scalar_type() == at::kFloat, "1-bit Adam: momentum of the wrong size or type");
  at::NoGradGuard ng;
  const auto u8 = m.options().dtype(at::kByte);
  switch (next_) {
    case 0: {  // worker side + all-to-all of the packed signs
      at::Tensor scale;
      const at::Tensor packed = compress_worker(m, scale);  // chunk r (n / 8N bytes) is rank r's part
      recv_signs_ = at::empty({n_ / 8}, u8);
      dp_->all_to_all(recv_signs_, packed, p)->wait();
      my_scale_ = scale.reshape({1});
      break;
    }
    case 1: {
      worker_scales_ = at::empty({size_}, m.options());
      dp_->all_gather(worker_scales_, my_scale_, p)->wait();
      break;
    }
    case 2: {  // server side on this rank's chunk + all-gather of its packed signs
      at::Tensor scale;
      server_packed_ = compress_server(recv_signs_, worker_scales_, scale);
      server_signs_ = at::empty({n_ / 8}, u8);
      dp_->all_gather(server_signs_, server_packed_, p)->wait();
      my_server_scale_ = scale.reshape({1});
      recv_signs_ = at::Tensor();
      break;
    }
    case 3: {  // server scales; decompress into m
      server_scales_ = at::empty({size_}, m.options());
      dp_->all_gather(server_scales_, my_server_scale_, p)->wait();
      decompress(server_signs_, server_scales_, m);
      server_signs_ = server_packed_ = at::Tensor();
      ready_ = true;
      break;
    }
  }
  next_ = (next_ + 1) % 4;
}

at::Tensor OnebitAdam::compress_worker(const at::Tensor& m, at::Tensor& scale) {
  at::NoGradGuard ng;
  at::Tensor buf = at::zeros({n_}, m.options());
  buf.narrow(0, 0, numel_).copy_(m.reshape({-1}));
  buf.add_(worker_error_);
  scale = at::norm(buf).div(std::sqrt(double(n_)));
  worker_error_ = buf - scale * signs_of(buf);
  return pack_signs(buf);
}

at::Tensor OnebitAdam::compress_server(const at::Tensor& signs, const at::Tensor& scales, at::Tensor& scale) {
  at::NoGradGuard ng;
  at::Tensor c = unpack_signs(signs).view({size_, chunk_}).mul_(scales.view({size_, 1}).mul(1.0 / size_)).sum(0);
  c.add_(server_error_);
  scale = at::norm(c).div(std::sqrt(double(chunk_)));
  server_error_ = c - scale * signs_of(c);
  return pack_signs(c);
}

void OnebitAdam::decompress(const at::Tensor& signs, const at::Tensor& scales, at::Tensor& m) const {
  at::NoGradGuard ng;
  const at::Tensor full = unpack_signs(signs).view({size_, chunk_}).mul_(scales.view({size_, 1}));
  m.view({-1}).copy_(full.view({-1}).narrow(0, 0, numel_));
}

void OnebitAdam::step(at::Tensor& p, const at::Tensor& m, const at::Tensor& v, int64_t step, const AdamWHyper& h) {
  if (next_ != 0) throw std::runtime_error("Program error: the optimizer step inside 1-bit Adam's compressed all-reduce");
  at::NoGradGuard ng;
  const double bc1 = 1.0 - std::pow(h.beta1, double(step));
  const double bc2 = 1.0 - std::pow(h.beta2, double(freeze_step_));  // the variance stopped there
  // Piece by piece (core/optimizer_step.hpp kOnebitStepChunkElements): the same operations on each
  // element as over the whole buffer, with the denominator's two temporaries one piece long.
  TORCH_CHECK(p.dim() == 1 && m.numel() == p.numel() && v.numel() == p.numel(), "1-bit Adam: step on flat buffers of one size");
  const int64_t n = p.numel(), chunk = kOnebitStepChunkElements;
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t len = std::min(chunk, n - b);
    at::Tensor pc = p.narrow(0, b, len);
    pc.mul_(1.0 - h.lr * h.weight_decay);
    const at::Tensor denom = (v.narrow(0, b, len).sqrt() / std::sqrt(bc2)).add_(h.eps);
    pc.addcdiv_(m.narrow(0, b, len), denom, -h.lr / bc1);
  }
  ready_ = false;
}

}  // namespace dssim::tb

// 1-bit Adam (Tang et al. 2021) as DeepSpeed's OnebitAdam runs it (deepspeed/runtime/fp16/onebit/
// adam.py) with its error-compensated compressed all-reduce (deepspeed/runtime/comm/nccl.py
// NcclBackend.compressed_allreduce), on the engine's flat fp32 buffers (ZeRO-0: every rank holds
// the whole model, tp = pp = 1).
//
// Steps 1..freeze_step are the engine's AdamW with the gradient all-reduce. From then on the
// variance is frozen and the momentum is updated from the LOCAL gradient and communicated by the
// Program's four instructions (core/program_builder.cpp emit_batch_end), which the engine hands
// to run() in order:
//   OneBitSigns  (all-to-all, n/8 bytes)  worker side: m + worker_error, scale = |m|/sqrt(n),
//                                         signs, new worker error; packed signs, chunk r to rank r
//   OneBitScales (all-gather, 4N bytes)   the worker scales
//   OneBitServer (all-gather, n/8 bytes)  server side (rank r owns the r-th n/N of the buffer):
//                                         average the decompressed chunks, + server_error, scale,
//                                         signs, new server error; the packed server signs
//   OneBitScales (all-gather, 4N bytes)   the server scales; every rank decompresses the momentum
// n is the buffer's size padded as DeepSpeed pads it (onebit_padded_numel). Signs are packed on
// the tensor's device, 8 a byte, the first element in the most significant bit (cupy.packbits);
// a sign bit is 1 for x >= 0 (DeepSpeed's sign().add_(1).bool(): zero counts as +1).
#pragma once
#include <cstdint>
#include <ATen/ATen.h>
#include "backends/torch/comm.hpp"
#include "backends/torch/optimizer_kernels.hpp"
#include "core/program.hpp"

namespace dssim::tb {

// DeepSpeed's padding of a compressed buffer of `numel` elements over `n` ranks: a multiple of
// n * lcm(n, 8) (adam.py: divider = size * 8 / gcd(size, 8); corrected_tensor_size).
int64_t onebit_padded_numel(int64_t numel, int n);

// x (numel a multiple of 8) -> uint8 of numel / 8: bit 1 where x >= 0, MSB first.
at::Tensor pack_signs(const at::Tensor& x);
// packed uint8 -> fp32 of 8 x numel, +1 / -1.
at::Tensor unpack_signs(const at::Tensor& packed);

class OnebitAdam {
 public:
  // numel: the momentum buffer's elements; dp: the data-parallel group (the compressed
  // all-reduce's); fp32: where the error buffers live.
  OnebitAdam(int64_t numel, Communicator* dp, int64_t freeze_step, const at::TensorOptions& fp32);

  int64_t freeze_step() const { return freeze_step_; }
  // Whether the step after `steps_done` completed steps is a compressed one.
  bool compressing(int64_t steps_done) const { return steps_done >= freeze_step_; }
  int64_t padded_numel() const { return n_; }

  // m = beta1 m + (1 - beta1) g (DeepSpeed: exp_avg.mul_(beta1).add_(1 - beta1, grad)), from the
  // local gradient; the engine calls it before the OneBitSigns instruction (or before the step
  // when there is no data-parallel group).
  void update_momentum(at::Tensor& m, const at::Tensor& g, double beta1) const;
  // One instruction of the compressed all-reduce of m (in the order above; its bytes checked
  // against what is sent). After the last one m holds the averaged, decompressed momentum.
  void run(const Instruction& in, at::Tensor& m);
  // All four phases at once (for dp groups without a Program: tests).
  void compressed_allreduce(at::Tensor& m);
  // True between the last phase and the step.
  bool momentum_ready() const { return ready_; }

  // The parameter update with the frozen variance (the engine's AdamW continued: decoupled
  // weight decay, the momentum's bias correction at `step`, the variance's frozen at
  // freeze_step). Clears momentum_ready().
  void step(at::Tensor& p, const at::Tensor& m, const at::Tensor& v, int64_t step, const AdamWHyper& h);

  // The local work of the phases (what phase() runs around its collectives; dssim calibrate times
  // them, rows onebit_worker / onebit_server / onebit_decompress at core/program.hpp's bytes):
  // the worker's x = m + error (padded), its scale and packed signs, error = x - scale sign(x);
  at::Tensor compress_worker(const at::Tensor& m, at::Tensor& scale);
  // the server's average of every rank's signs [n / 8] weighted by their scales [N] on its
  // chunk, plus its error, compressed the same way;
  at::Tensor compress_server(const at::Tensor& signs, const at::Tensor& scales, at::Tensor& scale);
  // m from every server's packed signs [n / 8] and scales [N].
  void decompress(const at::Tensor& signs, const at::Tensor& scales, at::Tensor& m) const;

  // The error-feedback state (checkpointed).
  at::Tensor& worker_error() { return worker_error_; }
  at::Tensor& server_error() { return server_error_; }

 private:
  void phase(Op op, Purpose p, double program_bytes, at::Tensor& m);
  int64_t numel_, n_, chunk_;
  Communicator* dp_;
  int size_, rank_;
  int64_t freeze_step_;
  at::Tensor worker_error_, server_error_;
  // Between phases.
  int next_ = 0;
  bool ready_ = false;
  at::Tensor recv_signs_, worker_scales_, my_scale_, server_signs_, server_scales_, my_server_scale_;
  at::Tensor server_packed_;
};

}  // namespace dssim::tb

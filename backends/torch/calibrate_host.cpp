// dssim calibrate's host and interconnect families (calibrate_families.hpp): AdamW on the host (CPU
// offload), pinned host <-> device copies, and NCCL collectives.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>
#include "backends/torch/calibrate_families.hpp"
#include "backends/torch/optimizer_kernels.hpp"

#if defined(DSSIM_HAVE_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace dssim::tb::calibration {

// CPU offload's optimizer: adamw_step on host fp32 tensors (p, g, m, v) writing the updated
// weights as bf16 (out16) and clearing g, one process over all the host's threads. Rows
// `host_adamw`, dtype fp32, bytes = 34 x N (read p, g, m, v: 16; write p, m, v, g: 16; the bf16
// copy: 2): kHostStepBytesPerParam16.
constexpr double kHostAdamWBytesPerParam = kHostStepBytesPerParam16;

// As the engine's HostOptimizerStep runs it: host_step_and_publish (chunks of 2^26, each chunk's
// bf16 parameters copied to the device being calibrated through a pinned buffer); the copies' time
// is left out (the Program's CopyH2D). Two warm-up steps, then the median of 3 or more.
void measure_host_adamw(const CalibrateOptions& o, const Grid& g, const at::Device& dev, DeviceProfile& p,
                        const std::string& cpu) {
  const auto t0 = Clock::now();
  Timer timer{at::Device(at::kCPU)};
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const AdamWHyper h;
  double best = 0;
  for (int64_t n : g.host_adamw) {
    at::Tensor p32 = at::full({n}, 1.0, f32), g32 = at::full({n}, 1e-3, f32), m = at::zeros({n}, f32), v = at::zeros({n}, f32);
    at::Tensor dst = at::empty({n}, f32.dtype(at::kBFloat16).device(dev)), staging;
    int64_t step = 0;
    auto one = [&] {
      const auto s0 = Clock::now();
      const double copies = host_step_and_publish(p32, g32, m, v, ++step, h, dst, staging);
      return std::max(1e-9, seconds_since(s0) - copies);
    };
    one(), one();
    std::vector<double> samples;
    const auto m0 = Clock::now();
    while (samples.size() < 3 || (samples.size() < 15 && seconds_since(m0) < o.seconds_per_point)) samples.push_back(one());
    std::sort(samples.begin(), samples.end());
    const double sec = samples[samples.size() / 2];
    best = std::max(best, add_bandwidth_row(p, "host_adamw", Dtype::fp32, kHostAdamWBytesPerParam * double(n), sec));
  }
  // ZeRO-Offload's gradient accumulation on the host (host_accumulate: fp32 += scale * bf16, the
  // engine's copy_gradients_to_host, on as many threads), bytes = 10 x N (read 2 + 4, write 4).
  // Up to 256M elements.
  double best_acc = 0;
  int acc_rows = 0;
  for (int64_t n : g.host_adamw) {
    if (n > (int64_t(1) << 28)) break;
    at::Tensor acc = at::zeros({n}, f32), src = at::full({n}, 1e-3, f32.dtype(at::kBFloat16));
    const double sec = timer.measure([&] { host_accumulate(acc, src, 0.5, host_accumulate_threads()); }, o.seconds_per_point);
    best_acc = std::max(best_acc, add_bandwidth_row(p, "host_accumulate", Dtype::fp32, 10.0 * double(n), sec));
    ++acc_rows;
  }
  const int nthreads = at::get_num_threads();
  const std::string threads = std::to_string(nthreads) + (nthreads == 1 ? " thread" : " threads");
  const std::string acc_threads = std::to_string(host_accumulate_threads()) + " threads";
  p.metadata.notes.push_back("host_adamw: adamw_step on host fp32 tensors + bf16 copy, one process, " + threads +
                             " on " + cpu + "; host_accumulate on " + acc_threads);
  say(o, "host gradient accumulation (10 bytes/element, " + acc_threads + "): " + std::to_string(acc_rows) +
             " sizes, best " + fmt(best_acc / 1e9, "GB/s"));
  say(o, "host adamw (" + cpu + ", " + threads + ", " + fmt(kHostAdamWBytesPerParam, "bytes/param") + "): " + std::to_string(g.host_adamw.size()) +
             " sizes up to " + fmt(double(g.host_adamw.back()), "params") + ", best " + fmt(best / 1e9, "GB/s") + " = " +
             fmt(best / kHostAdamWBytesPerParam / 1e9, "Gparam/s") + " (" + fmt(seconds_since(t0), "s") + ")");
}

void measure_copies(const CalibrateOptions& o, const Grid& g, const at::Device& dev, Timer& timer, DeviceProfile& p) {
  if (!dev.is_cuda()) {
    p.metadata.notes.push_back("copy: no host <-> device copies on the cpu backend");
    say(o, "copy: skipped (cpu backend)");
    return;
  }
  double h2d = 0, d2h = 0;
  for (int64_t bytes : g.copy_bytes) {
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    at::Tensor device = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(dev));
    host.fill_(1);
    const double up = timer.measure([&] { device.copy_(host, /*non_blocking=*/true); }, o.seconds_per_point);
    const double down = timer.measure([&] { host.copy_(device, /*non_blocking=*/true); }, o.seconds_per_point);
    p.copy.push_back({"h2d", Dtype::bf16, double(bytes), bytes / up});
    p.copy.push_back({"d2h", Dtype::bf16, double(bytes), bytes / down});
    h2d = std::max(h2d, bytes / up);
    d2h = std::max(d2h, bytes / down);
  }
  say(o, "copy (pinned): h2d up to " + fmt(h2d / 1e9, "GB/s") + ", d2h up to " + fmt(d2h / 1e9, "GB/s"));
}

#if defined(DSSIM_HAVE_NCCL)
void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("calibrate: ") + what + ": " + ncclGetErrorString(r));
}
void cuda_check(cudaError_t r, const char* what) {
  if (r != cudaSuccess) throw std::runtime_error(std::string("calibrate: ") + what + ": " + cudaGetErrorString(r));
}

// nccl-tests' way, in one process: one communicator per GPU (ncclCommInitAll), every call of an
// iteration inside one group, wall time over `iters` iterations after warm-up; bf16 elements.
void measure_collectives(const CalibrateOptions& o, const Grid& g, int ngpus, DeviceProfile& p) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off on shared hosts
  const int n = ngpus;
  std::vector<int> devs(n);
  for (int i = 0; i < n; ++i) devs[i] = i;
  std::vector<ncclComm_t> comms(n);
  nccl_check(ncclCommInitAll(comms.data(), n, devs.data()), "ncclCommInitAll");
  const size_t max_bytes = size_t(*std::max_element(g.collective_bytes.begin(), g.collective_bytes.end()));
  std::vector<void*> send(n), recv(n);
  std::vector<cudaStream_t> streams(n);
  for (int i = 0; i < n; ++i) {
    cuda_check(cudaSetDevice(i), "cudaSetDevice");
    cuda_check(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaMalloc(&send[i], max_bytes), "cudaMalloc");
    cuda_check(cudaMalloc(&recv[i], max_bytes), "cudaMalloc");
    cuda_check(cudaMemset(send[i], 0, max_bytes), "cudaMemset");
  }
  const ncclDataType_t type = ncclBfloat16;
  const size_t e = 2;
  auto run = [&](const std::string& c, size_t bytes) {
    const size_t count = bytes / e;
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < n; ++r) {
      if (c == "all_reduce") {
        nccl_check(ncclAllReduce(send[r], recv[r], count, type, ncclSum, comms[r], streams[r]), "ncclAllReduce");
      } else if (c == "reduce_scatter") {  // size = input bytes
        nccl_check(ncclReduceScatter(send[r], recv[r], count / n, type, ncclSum, comms[r], streams[r]), "ncclReduceScatter");
      } else if (c == "all_gather") {      // size = output bytes
        nccl_check(ncclAllGather(send[r], recv[r], count / n, type, comms[r], streams[r]), "ncclAllGather");
      } else if (c == "all_to_all") {
        const size_t chunk = count / n;
        for (int peer = 0; peer < n; ++peer) {
          nccl_check(ncclSend(static_cast<char*>(send[r]) + peer * chunk * e, chunk, type, peer, comms[r], streams[r]), "ncclSend");
          nccl_check(ncclRecv(static_cast<char*>(recv[r]) + peer * chunk * e, chunk, type, peer, comms[r], streams[r]), "ncclRecv");
        }
      } else {                             // send_recv: a ring, every rank sends `bytes` to the next
        nccl_check(ncclSend(send[r], count, type, (r + 1) % n, comms[r], streams[r]), "ncclSend");
        nccl_check(ncclRecv(recv[r], count, type, (r + n - 1) % n, comms[r], streams[r]), "ncclRecv");
      }
    }
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  };
  auto sync = [&] {
    for (int r = 0; r < n; ++r) {
      cuda_check(cudaSetDevice(r), "cudaSetDevice");
      cuda_check(cudaStreamSynchronize(streams[r]), "cudaStreamSynchronize");
    }
  };
  for (const std::string c : {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv"}) {
    double best = 0;
    for (int64_t b : g.collective_bytes) {
      const size_t bytes = size_t(b) / (e * n) * (e * n);  // divisible into n chunks of whole elements
      for (int i = 0; i < 3; ++i) run(c, bytes);
      sync();
      const int iters = bytes >= (size_t(1) << 28) ? 5 : 20;
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) run(c, bytes);
      sync();
      const double sec = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
      CollectivePoint x;
      x.collective = c;
      x.ranks = n;
      x.bytes = double(bytes);
      x.seconds = sec;
      x.algorithm_bandwidth = bytes / sec;
      x.bus_bandwidth = x.algorithm_bandwidth * bus_bandwidth_factor(c, n);
      best = std::max(best, x.bus_bandwidth);
      p.collectives.push_back(x);
    }
    say(o, "nccl " + c + " (" + std::to_string(n) + " GPUs): bus bandwidth up to " + fmt(best / 1e9, "GB/s"));
  }
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(i);
    cudaFree(send[i]);
    cudaFree(recv[i]);
    cudaStreamDestroy(streams[i]);
    ncclCommDestroy(comms[i]);
  }
  cudaSetDevice(0);
}
#endif

}  // namespace dssim::tb::calibration

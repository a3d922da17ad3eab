// nccl: NCCL called directly on this communicator's own CUDA stream. Every collective first makes
// its stream wait for libtorch's current stream (an event), and Work::wait() makes libtorch's
// stream wait for the collective (another event), so the host never blocks and gradient reduction
// can overlap the backward kernels that follow it. A watchdog thread watches the outstanding
// collectives: one that does not finish within the timeout (a dead or hung peer), or an
// asynchronous NCCL error, aborts the communicator and ends the process with a clear message.
// Point-to-point messages are ncclSend / ncclRecv on the same stream (NCCL has no tags: a send
// matches the recv its peer issued in the same order). Sub-groups are NCCL communicators of their
// own, initialised by their members only (the first member publishes the unique id in the store).
#include <cuda_runtime.h>
#include <nccl.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include "backends/torch/comm.hpp"
#include "backends/torch/torch_compat.hpp"

namespace dssim::tb {
namespace {

using Clock = std::chrono::steady_clock;

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CommError(std::string(what) + ": " + cudaGetErrorString(e));
}
void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress) throw CommError(std::string(what) + ": " + ncclGetErrorString(r));
}

ncclDataType_t nccl_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kDouble: return ncclFloat64;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: throw CommError("nccl: unsupported tensor dtype");
  }
}

class NcclCommunicator;

class NcclWork final : public Work {
 public:
  // `keep`: a tensor the operation reads or writes, alive until this Work is gone.
  NcclWork(cudaEvent_t done, int device, at::Tensor keep = {})
      : done_(done), device_(device), keep_(std::move(keep)) {}
  ~NcclWork() override { cudaEventDestroy(done_); }
  void wait() override {
    // Libtorch's stream continues after the collective; the host does not block.
    check_cuda(cudaStreamWaitEvent(torch_current_stream(device_), done_, 0), "cudaStreamWaitEvent");
  }

 private:
  cudaEvent_t done_;
  int device_;
  at::Tensor keep_;
};

class NcclCommunicator final : public Communicator {
 public:
  // The world: rank 0 publishes the unique id.
  NcclCommunicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int device,
                   std::chrono::milliseconds timeout)
      : Communicator(rank, size), store_(store), device_(device), timeout_(timeout) {
    init("dssim/nccl_unique_id");
  }
  // A sub-group of `parent`: its first member publishes the unique id under the group's key.
  NcclCommunicator(const NcclCommunicator& parent, const SubgroupSpec& spec, bool blocking_stream)
      : Communicator(spec.rank, spec.global, parent),
        store_(parent.store_),
        device_(parent.device_),
        timeout_(parent.timeout_),
        blocking_stream_(blocking_stream) {
    init(spec.key + "/nccl_unique_id");
  }

  ~NcclCommunicator() override {
    stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
    ncclCommDestroy(comm_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "nccl"; }

  std::unique_ptr<Communicator> subgroup(const std::vector<int>& ranks, bool blocking_stream) override {
    SubgroupSpec spec = subgroup_spec(ranks, "dssim/nccl/g");
    if (spec.global.size() == 1) return self_group();
    return std::make_unique<NcclCommunicator>(*this, spec, blocking_stream);
  }

  std::shared_ptr<Work> send(const at::Tensor& t, int peer, int tag, Purpose p) override {
    (void)tag;
    check_peer(t, peer, "send");
    count(Op::Send, p, double(t.numel() * t.element_size()));
    return launch("send", [&](cudaStream_t s) {
      return ncclSend(t.data_ptr(), t.numel(), nccl_type(t), peer, comm_, s);
    }, t);
  }
  std::shared_ptr<Work> recv(at::Tensor& t, int peer, int tag, Purpose p) override {
    (void)tag;
    check_peer(t, peer, "recv");
    count(Op::Recv, p, double(t.numel() * t.element_size()));
    return launch("recv", [&](cudaStream_t s) {
      return ncclRecv(t.data_ptr(), t.numel(), nccl_type(t), peer, comm_, s);
    }, t);
  }

  std::shared_ptr<Work> allreduce(at::Tensor& t, Purpose p) override {
    count(Op::AllReduce, p, double(t.numel() * t.element_size()));
    return launch("all_reduce", [&](cudaStream_t s) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t), ncclSum, comm_, s);
    });
  }
  std::shared_ptr<Work> allreduce_max(at::Tensor& t, Purpose p) override {
    count(Op::AllReduce, p, double(t.numel() * t.element_size()));
    return launch("all_reduce_max", [&](cudaStream_t s) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t), ncclMax, comm_, s);
    });
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    TORCH_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: input must be size x output");
    count(Op::ReduceScatter, p, double(in.numel() * in.element_size()));
    return launch("reduce_scatter", [&](cudaStream_t s) {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(in), ncclSum, comm_, s);
    });
  }
  std::shared_ptr<Work> all_gather(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    TORCH_CHECK(out.numel() == in.numel() * size_, "all_gather: output must be size x input");
    count(Op::AllGather, p, double(out.numel() * out.element_size()));
    return launch("all_gather", [&](cudaStream_t s) {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in), comm_, s);
    });
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    TORCH_CHECK(out.numel() == in.numel() && in.numel() % size_ == 0,
                "all_to_all: input and output of the same size, a multiple of the group size");
    TORCH_CHECK(in.is_contiguous() && out.is_contiguous(), "all_to_all: contiguous tensors");
    count(Op::AllToAll, p, double(in.numel() * in.element_size()));
    // NCCL has no all-to-all: one grouped send and receive per peer (as c10d's ProcessGroupNCCL).
    return launch("all_to_all", [&](cudaStream_t s) {
      const int64_t chunk = in.numel() / size_, bytes = chunk * in.element_size();
      const char* src = static_cast<const char*>(in.data_ptr());
      char* dst = static_cast<char*>(out.data_ptr());
      ncclGroupStart();
      for (int r = 0; r < size_; ++r) {
        ncclSend(src + r * bytes, chunk, nccl_type(in), r, comm_, s);
        ncclRecv(dst + r * bytes, chunk, nccl_type(out), r, comm_, s);
      }
      return ncclGroupEnd();
    }, in);
  }
  std::shared_ptr<Work> reduce_to_owners(at::Tensor& buf, const std::vector<std::pair<int64_t, int64_t>>& owners,
                                         Purpose p) override {
    count(Op::ReduceScatter, p, double(buf.numel() * buf.element_size()));
    // DeepSpeed's average_tensor: one reduce per owner of a part of the bucket, grouped.
    return launch("reduce_to_owners", [&](cudaStream_t s) {
      ncclGroupStart();
      char* base = static_cast<char*>(buf.data_ptr());
      const int64_t esz = buf.element_size();
      for (int r = 0; r < int(owners.size()); ++r) {
        if (owners[r].second <= 0) continue;
        void* ptr = base + owners[r].first * esz;
        ncclReduce(ptr, ptr, owners[r].second, nccl_type(buf), ncclSum, r, comm_, s);
      }
      return ncclGroupEnd();
    });
  }
  std::shared_ptr<Work> broadcast(at::Tensor& t, int root, Purpose) override {
    return launch("broadcast", [&](cudaStream_t s) {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t), root, comm_, s);
    });
  }
  void barrier() override {
    auto t = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
    launch("barrier", [&](cudaStream_t s) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), 1, ncclFloat32, ncclSum, comm_, s);
    })->wait();
    // The host waits here; the watchdog ends the process if this never completes.
    check_cuda(cudaStreamSynchronize(op_stream()), "barrier");
  }

 private:
  void init(const std::string& key) {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id;
    if (rank_ == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      std::vector<uint8_t> bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof id);
      store_->set(key, bytes);
    } else {
      std::vector<uint8_t> bytes;
      try {
        bytes = store_->get(key);  // waits up to the store's timeout
      } catch (const c10::Error& e) {
        throw CommError("nccl: no unique id under " + key + " (the group's first member did not "
                        "create it): " + e.what_without_backtrace());
      }
      if (bytes.size() != sizeof id) throw CommError("nccl: bad unique id in the store");
      std::memcpy(&id, bytes.data(), sizeof id);
    }
    // Non-blocking init, so a rank that never arrives is a timeout and not a hang.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check_nccl(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), "ncclCommInitRankConfig");
    const auto deadline = Clock::now() + timeout_;
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) {
      check_nccl(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      if (state == ncclInProgress && Clock::now() > deadline) {
        ncclCommAbort(comm_);
        throw CommError("nccl: communicator initialisation did not complete within the timeout "
                        "(a rank did not join)");
      }
      if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    check_nccl(state, "ncclCommInitRankConfig");
    if (!blocking_stream_)
      check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    watchdog_ = std::thread([this] { watch(); });
  }

  void check_peer(const at::Tensor& t, int peer, const char* what) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw std::invalid_argument(std::string("nccl ") + what + ": bad peer " + std::to_string(peer) +
                                  " (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ")");
    TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "nccl ", what, ": contiguous CUDA tensors only");
  }

  // The stream this communicator's operations run on.
  cudaStream_t op_stream() const { return blocking_stream_ ? torch_current_stream(device_) : stream_; }

  // f(stream) issues the NCCL call(s); `keep` stays alive with the returned Work.
  template <class F>
  std::shared_ptr<Work> launch(const char* what, F&& f, at::Tensor keep = {}) {
    if (failed_) throw CommError(error_);
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const cudaStream_t s = op_stream();
    if (s != torch_current_stream(device_)) {
      // Ordered after what libtorch's stream has queued so far.
      cudaEvent_t ready;
      check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
      check_cuda(cudaEventRecord(ready, torch_current_stream(device_)), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(s, ready, 0), "cudaStreamWaitEvent");
      cudaEventDestroy(ready);
    }
    cudaEvent_t done;
    check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    check_nccl(f(s), what);
    check_cuda(cudaEventRecord(done, s), "cudaEventRecord");
    cudaEvent_t watched;
    check_cuda(cudaEventCreateWithFlags(&watched, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(watched, s), "cudaEventRecord");
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({watched, Clock::now(), what});
    }
    return std::make_shared<NcclWork>(done, device_, std::move(keep));
  }

  void watch() {
    cudaSetDevice(device_);
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::string timed_out;
      {
        std::lock_guard<std::mutex> lock(mu_);
        while (!pending_.empty() && cudaEventQuery(pending_.front().event) == cudaSuccess) {
          cudaEventDestroy(pending_.front().event);
          pending_.pop_front();
        }
        if (!pending_.empty() && Clock::now() - pending_.front().issued > timeout_)
          timed_out = pending_.front().what;
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        fail(std::string("NCCL error: ") + ncclGetErrorString(async));
      else if (!timed_out.empty())
        fail("NCCL " + timed_out + " did not complete within " +
             std::to_string(timeout_.count() / 1000.0) + " s (a peer rank died or hung)");
    }
  }

  [[noreturn]] void fail(const std::string& msg) {
    error_ = msg;
    failed_ = true;
    std::fprintf(stderr, "dssim run: rank %d: %s; aborting\n", rank_, msg.c_str());
    std::fflush(stderr);
    ncclCommAbort(comm_);
    std::_Exit(1);  // kernels waiting on the aborted communicator cannot be joined safely
  }

  struct Pending {
    cudaEvent_t event;
    Clock::time_point issued;
    const char* what;
  };
  c10::intrusive_ptr<c10d::Store> store_;  // the world's (sub-groups publish their ids in it)
  int device_;
  std::chrono::milliseconds timeout_;
  bool blocking_stream_ = false;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
  std::deque<Pending> pending_;
  std::thread watchdog_;
  std::atomic<bool> stop_{false}, failed_{false};
  std::string error_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size, int device,
                                                     std::chrono::milliseconds timeout) {
  return std::make_unique<NcclCommunicator>(store, rank, size, device, timeout);
}

}  // namespace dssim::tb

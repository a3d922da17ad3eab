// Communicators: one interface shaped like c10d's ProcessGroup (collectives return work handles),
// two implementations: gloo (c10d ProcessGroupGloo, CPU tensors) and nccl (NCCL called directly on
// the backend's own CUDA streams). Both count the bytes of every collective, by kind and purpose,
// the way the Program counts them (nccl-tests "size": all-reduce the buffer, reduce-scatter the
// input, all-gather the output).
#pragma once
#include <chrono>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include "core/program.hpp"

namespace dssim::tb {

// A collective that did not finish within the timeout, or failed because a peer went away.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;  // throws CommError on timeout or a failed peer
};

struct CommCounters {
  std::map<std::pair<Op, Purpose>, double> bytes;  // summed "size" bytes
  std::map<std::pair<Op, Purpose>, int64_t> calls;
};

class Communicator {
 public:
  Communicator(int rank, int size) : rank_(rank), size_(size) {}
  virtual ~Communicator() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string name() const = 0;

  // Sum over the group, in place.
  virtual std::shared_ptr<Work> allreduce(at::Tensor& t, Purpose p) = 0;
  // in: size() * out.numel() elements; out gets this rank's slice of the sum.
  virtual std::shared_ptr<Work> reduce_scatter(at::Tensor& out, const at::Tensor& in, Purpose p) = 0;
  // out: size() * in.numel() elements, rank r's input at slice r.
  virtual std::shared_ptr<Work> all_gather(at::Tensor& out, const at::Tensor& in, Purpose p) = 0;
  // Reduce-scatter with uneven slices: after it, buf[owners[r]] on rank r holds the sum (other
  // ranges unspecified). Counted as a reduce-scatter of buf.
  virtual std::shared_ptr<Work> reduce_to_owners(at::Tensor& buf,
                                                 const std::vector<std::pair<int64_t, int64_t>>& owners,
                                                 Purpose p) = 0;
  virtual std::shared_ptr<Work> broadcast(at::Tensor& t, int root, Purpose p) = 0;
  virtual void barrier() = 0;

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

 protected:
  void count(Op op, Purpose p, double bytes) {
    counters_.bytes[{op, p}] += bytes;
    counters_.calls[{op, p}] += 1;
  }
  int rank_, size_;
  CommCounters counters_;
};

// A communicator of one rank: every collective is the identity (still counted, as size bytes).
std::unique_ptr<Communicator> make_local_communicator();
#ifdef DSSIM_HAVE_GLOO
std::unique_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size,
                                                     std::chrono::milliseconds timeout);
#endif
#ifdef DSSIM_HAVE_NCCL
std::unique_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size, int device,
                                                     std::chrono::milliseconds timeout);
#endif

}  // namespace dssim::tb

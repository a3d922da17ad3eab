// Communicators: one interface shaped like c10d's ProcessGroup (collectives return work handles),
// two implementations: gloo (c10d ProcessGroupGloo, CPU tensors) and nccl (NCCL called directly on
// the backend's own CUDA streams). Both count the bytes of every collective, by kind and purpose,
// the way the Program counts them (nccl-tests "size": all-reduce the buffer, reduce-scatter the
// input, all-gather the output), and point-to-point messages by their bytes. Sub-group
// communicators (tensor / pipeline / data parallel groups) count into their parent's counters.
#pragma once
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
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
  // A world: members 0..size-1 (their world ranks too), fresh counters.
  Communicator(int rank, int size);
  virtual ~Communicator() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  // World ranks of the members, by rank of this communicator (0..size-1 for a world).
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  int global_rank() const { return global_ranks_[rank_]; }
  virtual std::string name() const = 0;

  // Maximum over the group, in place (the vocabulary-parallel cross-entropy's max logit).
  // Counted as an all-reduce.
  virtual std::shared_ptr<Work> allreduce_max(at::Tensor& t, Purpose p) {
    throw std::logic_error(name() + " communicator: allreduce_max is not implemented");
  }
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
  // All-to-all of equal chunks: in and out have the same numel, a multiple of size(); chunk r of
  // `in` goes to rank r, and out's chunk r comes from rank r (c10d all_to_all_single). Counted as
  // Op::AllToAll with in's bytes (what each rank sends, its own chunk included: nccl-tests' size).
  // Byte tensors (uint8) too: the 1-bit Adam sign exchange.
  virtual std::shared_ptr<Work> all_to_all(at::Tensor& out, const at::Tensor& in, Purpose p) {
    throw std::logic_error(name() + " communicator: all_to_all is not implemented");
  }
  virtual std::shared_ptr<Work> broadcast(at::Tensor& t, int root, Purpose p) = 0;
  virtual void barrier() = 0;

  // Point to point; `peer` is a rank of THIS communicator. Counted as Op::Send / Op::Recv with
  // purpose p and the message's bytes (numel * element_size), one call each. A send and its recv
  // match by (peer pair, tag) on gloo, by issue order on NCCL (which has no tags).
  // The send's Work keeps t alive until done.
  virtual std::shared_ptr<Work> send(const at::Tensor& t, int peer, int tag, Purpose p) = 0;
  // t is filled when wait() returns (CPU) / ordered before what follows on libtorch's current
  // stream (CUDA).
  virtual std::shared_ptr<Work> recv(at::Tensor& t, int peer, int tag, Purpose p) = 0;

  // A communicator over `ranks` (ranks of this communicator, ascending, this rank among them).
  // Called by exactly the members of that group, each member creating its groups in the same
  // order; a group of one rank is an identity communicator. Its collectives and messages count
  // into this communicator's counters (shared: counters() / reset_counters() of any of them cover
  // all). `blocking_stream` (NCCL only): run the group's operations on libtorch's current stream
  // instead of the communicator's own (Megatron runs TP collectives on the compute stream).
  virtual std::unique_ptr<Communicator> subgroup(const std::vector<int>& ranks,
                                                 bool blocking_stream = false) = 0;

  const CommCounters& counters() const { return *counters_; }
  void reset_counters() {
    std::lock_guard<std::mutex> lock(shared_->mu);
    *counters_ = {};
  }

 protected:
  // State shared by a world and all its sub-groups.
  struct Shared {
    std::mutex mu;                           // count() / reset_counters()
    std::map<std::string, int> created;      // sub-groups created, by member list
  };
  // A sub-group of `parent`: this rank's index among the members, their world ranks.
  Communicator(int rank, std::vector<int> global_ranks, const Communicator& parent);
  struct SubgroupSpec {
    int rank;                  // this rank in the group
    std::vector<int> global;   // world ranks of the members
    std::string key;           // "<prefix>/<w0>,<w1>,.../<n>": unique, identical on every member
  };
  // Checks `ranks` (ascending, distinct, in range, containing this rank) and names the group.
  SubgroupSpec subgroup_spec(const std::vector<int>& ranks, const std::string& prefix);
  // The identity communicator for a sub-group of this rank only.
  std::unique_ptr<Communicator> self_group() const;

  void count(Op op, Purpose p, double bytes) {
    std::lock_guard<std::mutex> lock(shared_->mu);
    counters_->bytes[{op, p}] += bytes;
    counters_->calls[{op, p}] += 1;
  }
  int rank_, size_;
  std::vector<int> global_ranks_;
  std::shared_ptr<CommCounters> counters_;
  std::shared_ptr<Shared> shared_;
};

// A communicator of one rank: every collective is the identity (still counted, as size bytes);
// send/recv throw std::logic_error (no peer); subgroup({0}) is another one sharing the counters.
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

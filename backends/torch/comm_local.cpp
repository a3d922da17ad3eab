// The Communicator base (world / sub-group bookkeeping) and the one-rank communicator.
#include <algorithm>
#include "backends/torch/comm.hpp"

namespace dssim::tb {

Communicator::Communicator(int rank, int size)
    : rank_(rank),
      size_(size),
      counters_(std::make_shared<CommCounters>()),
      shared_(std::make_shared<Shared>()) {
  global_ranks_.resize(size);
  for (int r = 0; r < size; ++r) global_ranks_[r] = r;
}

Communicator::Communicator(int rank, std::vector<int> global_ranks, const Communicator& parent)
    : rank_(rank),
      size_(int(global_ranks.size())),
      global_ranks_(std::move(global_ranks)),
      counters_(parent.counters_),
      shared_(parent.shared_) {}

Communicator::SubgroupSpec Communicator::subgroup_spec(const std::vector<int>& ranks,
                                                       const std::string& prefix) {
  if (ranks.empty()) throw std::invalid_argument("subgroup: no ranks");
  SubgroupSpec s{-1, {}, prefix + "/"};
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    if (r < 0 || r >= size_) throw std::invalid_argument("subgroup: rank " + std::to_string(r) + " out of range");
    if (i > 0 && r <= ranks[i - 1]) throw std::invalid_argument("subgroup: ranks must be ascending and distinct");
    if (r == rank_) s.rank = int(i);
    s.global.push_back(global_ranks_[r]);
    s.key += (i ? "," : "") + std::to_string(global_ranks_[r]);
  }
  if (s.rank < 0)
    throw std::invalid_argument("subgroup: created by rank " + std::to_string(rank_) + ", not a member");
  int n;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    n = shared_->created[s.key]++;
  }
  s.key += "/" + std::to_string(n);
  return s;
}

namespace {

class LocalWork final : public Work {
 public:
  void wait() override {}
};

// One rank: every collective is the identity.
class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator() : Communicator(0, 1) {}
  LocalCommunicator(int global_rank, const Communicator& parent)
      : Communicator(0, std::vector<int>{global_rank}, parent) {}
  std::string name() const override { return "local"; }
  std::shared_ptr<Work> allreduce(at::Tensor& t, Purpose p) override {
    count(Op::AllReduce, p, double(t.numel() * t.element_size()));
    return std::make_shared<LocalWork>();
  }
  std::shared_ptr<Work> allreduce_max(at::Tensor& t, Purpose p) override { return allreduce(t, p); }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    count(Op::ReduceScatter, p, double(in.numel() * in.element_size()));
    out.copy_(in.view(out.sizes()));
    return std::make_shared<LocalWork>();
  }
  std::shared_ptr<Work> all_gather(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    count(Op::AllGather, p, double(out.numel() * out.element_size()));
    out.copy_(in.view(out.sizes()));
    return std::make_shared<LocalWork>();
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    count(Op::AllToAll, p, double(in.numel() * in.element_size()));
    out.copy_(in.view(out.sizes()));
    return std::make_shared<LocalWork>();
  }
  std::shared_ptr<Work> reduce_to_owners(at::Tensor& buf, const std::vector<std::pair<int64_t, int64_t>>&,
                                         Purpose p) override {
    count(Op::ReduceScatter, p, double(buf.numel() * buf.element_size()));
    return std::make_shared<LocalWork>();
  }
  std::shared_ptr<Work> broadcast(at::Tensor&, int, Purpose) override { return std::make_shared<LocalWork>(); }
  void barrier() override {}
  std::shared_ptr<Work> send(const at::Tensor&, int, int, Purpose) override {
    throw std::logic_error("local communicator: send needs a peer (one rank only)");
  }
  std::shared_ptr<Work> recv(at::Tensor&, int, int, Purpose) override {
    throw std::logic_error("local communicator: recv needs a peer (one rank only)");
  }
  std::unique_ptr<Communicator> subgroup(const std::vector<int>& ranks, bool) override {
    subgroup_spec(ranks, "dssim/local");  // validates: {0}
    return self_group();
  }
};

}  // namespace

std::unique_ptr<Communicator> Communicator::self_group() const {
  return std::make_unique<LocalCommunicator>(global_rank(), *this);
}

std::unique_ptr<Communicator> make_local_communicator() { return std::make_unique<LocalCommunicator>(); }

}  // namespace dssim::tb

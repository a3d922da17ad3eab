// gloo: c10d's ProcessGroupGloo on CPU tensors. Debian's libtorch 1.13 Gloo has no reduce-scatter
// and no flat all-gather, so reduce-scatter runs as an all-reduce of the input keeping this rank's
// slice, and all-gather as the list form into views of the flat output; the counters still record
// the collective the Program asked for, with its size. Point-to-point messages are c10d's
// send/recv (gloo unbound buffers, matched by peer pair and tag); sub-groups are further
// ProcessGroupGloo over a PrefixStore of the world's store, named by their members' world ranks.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include "backends/torch/comm.hpp"

namespace dssim::tb {
namespace {

class GlooWork final : public Work {
 public:
  GlooWork(c10::intrusive_ptr<c10d::Work> w, std::function<void()> then, std::chrono::milliseconds t,
           std::string what = "collective")
      : work_(std::move(w)), then_(std::move(then)), timeout_(t), what_(std::move(what)) {}
  void wait() override {
    if (done_) return;
    try {
      if (!work_->wait(timeout_)) throw CommError("gloo " + what_ + " did not complete");
    } catch (const CommError&) {
      throw;
    } catch (const c10::Error& e) {
      throw CommError("gloo " + what_ + " failed (a peer rank died or timed out): " +
                      e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw CommError("gloo " + what_ + " failed (a peer rank died or timed out): " + e.what());
    }
    if (then_) then_();
    done_ = true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  bool done_ = false;
};

class GlooCommunicator final : public Communicator {
 public:
  // The world.
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::chrono::milliseconds timeout)
      : Communicator(rank, size),
        timeout_(timeout),
        store_(store),
        device_(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")) {
    init(store);
  }
  // A sub-group of `parent` (the members' world ranks in spec.global); shares its device.
  GlooCommunicator(const GlooCommunicator& parent, const SubgroupSpec& spec)
      : Communicator(spec.rank, spec.global, parent),
        timeout_(parent.timeout_),
        store_(parent.store_),
        device_(parent.device_) {
    init(c10::make_intrusive<c10d::PrefixStore>(spec.key, store_));
  }
  std::string name() const override { return "gloo"; }

  std::shared_ptr<Work> allreduce(at::Tensor& t, Purpose p) override {
    count(Op::AllReduce, p, double(t.numel() * t.element_size()));
    std::vector<at::Tensor> v{t};
    return wrap(issue([&] { return pg_->allreduce(v); }), nullptr);
  }
  std::shared_ptr<Work> allreduce_max(at::Tensor& t, Purpose p) override {
    count(Op::AllReduce, p, double(t.numel() * t.element_size()));
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    return wrap(issue([&] { return pg_->allreduce(v, o); }), nullptr);
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    TORCH_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: input must be size x output");
    count(Op::ReduceScatter, p, double(in.numel() * in.element_size()));
    auto tmp = in.contiguous().clone();
    std::vector<at::Tensor> v{tmp};
    at::Tensor o = out;
    const int64_t n = out.numel(), r = rank_;
    return wrap(issue([&] { return pg_->allreduce(v); }), [tmp, o, n, r]() mutable {
      o.view({-1}).copy_(tmp.view({-1}).narrow(0, r * n, n));
    });
  }
  std::shared_ptr<Work> all_gather(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    TORCH_CHECK(out.numel() == in.numel() * size_, "all_gather: output must be size x input");
    count(Op::AllGather, p, double(out.numel() * out.element_size()));
    std::vector<std::vector<at::Tensor>> outs(1);
    auto flat = out.view({-1});
    for (int r = 0; r < size_; ++r) outs[0].push_back(flat.narrow(0, r * in.numel(), in.numel()));
    std::vector<at::Tensor> ins{in.contiguous().view({-1})};
    return wrap(issue([&] { return pg_->allgather(outs, ins); }), nullptr);
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    TORCH_CHECK(out.numel() == in.numel() && in.numel() % size_ == 0,
                "all_to_all: input and output of the same size, a multiple of the group size");
    TORCH_CHECK(out.is_contiguous(), "all_to_all: contiguous output");
    count(Op::AllToAll, p, double(in.numel() * in.element_size()));
    at::Tensor src = in.contiguous().view({-1}), dst = out.view({-1});
    std::vector<int64_t> counts;  // empty: equal splits
    return wrap(issue([&] { return pg_->alltoall_base(dst, src, counts, counts); }), [src] {});
  }
  std::shared_ptr<Work> reduce_to_owners(at::Tensor& buf,
                                         const std::vector<std::pair<int64_t, int64_t>>& owners,
                                         Purpose p) override {
    count(Op::ReduceScatter, p, double(buf.numel() * buf.element_size()));
    std::vector<at::Tensor> v{buf};
    return wrap(issue([&] { return pg_->allreduce(v); }), nullptr);
  }
  std::shared_ptr<Work> broadcast(at::Tensor& t, int root, Purpose p) override {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return wrap(issue([&] { return pg_->broadcast(v, o); }), nullptr);
  }
  std::shared_ptr<Work> send(const at::Tensor& t, int peer, int tag, Purpose p) override {
    check_peer(t, peer, "send");
    count(Op::Send, p, double(t.numel() * t.element_size()));
    std::vector<at::Tensor> v{t.contiguous()};  // SendWork keeps it alive
    return wrap(issue([&] { return pg_->send(v, peer, tag); }, "send to rank " + std::to_string(peer)), nullptr,
                "send to rank " + std::to_string(peer));
  }
  std::shared_ptr<Work> recv(at::Tensor& t, int peer, int tag, Purpose p) override {
    check_peer(t, peer, "recv");
    count(Op::Recv, p, double(t.numel() * t.element_size()));
    const bool direct = t.is_contiguous();
    std::vector<at::Tensor> v{direct ? t : at::empty_like(t, at::MemoryFormat::Contiguous)};
    std::function<void()> then;
    if (!direct) then = [dst = t, tmp = v[0]]() mutable { dst.copy_(tmp); };
    return wrap(issue([&] { return pg_->recv(v, peer, tag); }, "recv from rank " + std::to_string(peer)), std::move(then),
                "recv from rank " + std::to_string(peer));
  }
  std::unique_ptr<Communicator> subgroup(const std::vector<int>& ranks, bool) override {
    SubgroupSpec spec = subgroup_spec(ranks, "dssim/g");
    if (spec.global.size() == 1) return self_group();
    return std::make_unique<GlooCommunicator>(*this, spec);
  }
  void barrier() override {
    try {
      if (!pg_->barrier()->wait(timeout_)) throw CommError("gloo barrier did not complete");
    } catch (const CommError&) {
      throw;
    } catch (const c10::Error& e) {
      throw CommError(std::string("gloo barrier failed (a peer rank died or timed out): ") +
                      e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw CommError(std::string("gloo barrier failed (a peer rank died or timed out): ") + e.what());
    }
  }

 private:
  void init(const c10::intrusive_ptr<c10d::Store>& store) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout_);
    opts->devices.push_back(device_);
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank_, size_, opts);
    } catch (const c10::Error& e) {
      throw CommError("gloo: group initialisation failed (a member did not join): " +
                      std::string(e.what_without_backtrace()));
    }
  }
  void check_peer(const at::Tensor& t, int peer, const char* what) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw std::invalid_argument(std::string("gloo ") + what + ": bad peer " + std::to_string(peer) +
                                  " (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ")");
    TORCH_CHECK(t.device().is_cpu(), "gloo ", what, ": CPU tensors only");
  }
  // Issuing can fail at once (a peer's connection already closed): the same CommError as a wait.
  template <class F>
  static c10::intrusive_ptr<c10d::Work> issue(F&& f, const std::string& what = "collective") {
    try {
      return f();
    } catch (const c10::Error& e) {
      throw CommError("gloo " + what + " failed (a peer rank died or timed out): " + e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw CommError("gloo " + what + " failed (a peer rank died or timed out): " + e.what());
    }
  }
  std::shared_ptr<Work> wrap(c10::intrusive_ptr<c10d::Work> w, std::function<void()> then,
                             std::string what = "collective") {
    return std::make_shared<GlooWork>(std::move(w), std::move(then), timeout_, std::move(what));
  }
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;  // the world's: sub-groups prefix it
  std::shared_ptr<::gloo::transport::Device> device_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size,
                                                     std::chrono::milliseconds timeout) {
  return std::make_unique<GlooCommunicator>(store, rank, size, timeout);
}

}  // namespace dssim::tb

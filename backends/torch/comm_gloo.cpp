// gloo: c10d's ProcessGroupGloo on CPU tensors. Debian's libtorch 1.13 Gloo has no reduce-scatter
// and no flat all-gather, so reduce-scatter runs as an all-reduce of the input keeping this rank's
// slice, and all-gather as the list form into views of the flat output; the counters still record
// the collective the Program asked for, with its size.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include "backends/torch/comm.hpp"

namespace dssim::tb {
namespace {

class GlooWork final : public Work {
 public:
  GlooWork(c10::intrusive_ptr<c10d::Work> w, std::function<void()> then, std::chrono::milliseconds t)
      : work_(std::move(w)), then_(std::move(then)), timeout_(t) {}
  void wait() override {
    if (done_) return;
    try {
      if (!work_->wait(timeout_)) throw CommError("gloo collective did not complete");
    } catch (const CommError&) {
      throw;
    } catch (const c10::Error& e) {
      throw CommError(std::string("gloo collective failed (a peer rank died or timed out): ") +
                      e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw CommError(std::string("gloo collective failed (a peer rank died or timed out): ") +
                      e.what());
    }
    if (then_) then_();
    done_ = true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;
  std::chrono::milliseconds timeout_;
  bool done_ = false;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::chrono::milliseconds timeout)
      : Communicator(rank, size), timeout_(timeout) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  }
  std::string name() const override { return "gloo"; }

  std::shared_ptr<Work> allreduce(at::Tensor& t, Purpose p) override {
    count(Op::AllReduce, p, double(t.numel() * t.element_size()));
    std::vector<at::Tensor> v{t};
    return wrap(pg_->allreduce(v), nullptr);
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& out, const at::Tensor& in, Purpose p) override {
    TORCH_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: input must be size x output");
    count(Op::ReduceScatter, p, double(in.numel() * in.element_size()));
    auto tmp = in.contiguous().clone();
    std::vector<at::Tensor> v{tmp};
    at::Tensor o = out;
    const int64_t n = out.numel(), r = rank_;
    return wrap(pg_->allreduce(v), [tmp, o, n, r]() mutable {
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
    return wrap(pg_->allgather(outs, ins), nullptr);
  }
  std::shared_ptr<Work> reduce_to_owners(at::Tensor& buf,
                                         const std::vector<std::pair<int64_t, int64_t>>& owners,
                                         Purpose p) override {
    count(Op::ReduceScatter, p, double(buf.numel() * buf.element_size()));
    std::vector<at::Tensor> v{buf};
    return wrap(pg_->allreduce(v), nullptr);
  }
  std::shared_ptr<Work> broadcast(at::Tensor& t, int root, Purpose p) override {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return wrap(pg_->broadcast(v, o), nullptr);
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
  std::shared_ptr<Work> wrap(c10::intrusive_ptr<c10d::Work> w, std::function<void()> then) {
    return std::make_shared<GlooWork>(std::move(w), std::move(then), timeout_);
  }
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size,
                                                     std::chrono::milliseconds timeout) {
  return std::make_unique<GlooCommunicator>(store, rank, size, timeout);
}

}  // namespace dssim::tb

// The gloo communicator as several real processes: point-to-point messages (pipeline-style),
// sub-group communicators (tensor / data parallel groups) and their shared counters, and a recv
// whose peer is gone failing with CommError instead of hanging. Each test case forks its ranks
// before any libtorch thread pool exists; a child reports failure by its exit status (and stderr).
#include <catch2/catch.hpp>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <functional>
#include <sstream>
#include <numeric>
#include <thread>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include "backends/torch/comm.hpp"
#include "backends/torch/onebit_adam.hpp"
#include "backends/torch/optimizer_kernels.hpp"

using namespace dssim;
using namespace dssim::tb;
using namespace std::chrono_literals;

namespace {

// A check inside a child: on failure, say where and end the child with status 1.
#define CHILD_CHECK(cond)                                                                    \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "rank %d: %s:%d: check failed: %s\n", g_rank, __FILE__, __LINE__, \
                   #cond);                                                                   \
      std::fflush(stderr);                                                                   \
      _exit(1);                                                                              \
    }                                                                                        \
  } while (0)

int g_rank = -1;

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

struct Rank {
  int rank, size;
  c10::intrusive_ptr<c10d::Store> store;
  std::unique_ptr<Communicator> comm;
};

// Forks `n` ranks running body over a gloo world (collective/p2p timeout `timeout`), waits for
// them (killing them all after `kill_after`), and returns each child's exit status (-1: killed
// or signalled).
std::vector<int> run_ranks(int n, const std::function<void(Rank&)>& body,
                           std::chrono::milliseconds timeout = 20000ms,
                           std::chrono::seconds kill_after = 60s) {
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      g_rank = r;
      try {
        at::set_num_threads(1);
        c10d::TCPStoreOptions o;
        o.port = uint16_t(port);
        o.isServer = r == 0;
        o.numWorkers = n;
        o.waitWorkers = false;
        o.timeout = 30s;
        Rank rk{r, n, c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o), nullptr};
        rk.comm = make_gloo_communicator(rk.store, r, n, timeout);
        body(rk);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: exception: %s\n", r, e.what());
        std::fflush(stderr);
        _exit(1);
      }
      _exit(0);
    }
    pids.push_back(pid);
  }
  std::vector<int> status(n, -2);
  const auto deadline = std::chrono::steady_clock::now() + kill_after;
  int left = n;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (status[r] != -2) continue;
      int st = 0;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < n; ++r)
        if (status[r] == -2) {
          kill(pids[r], SIGKILL);
          waitpid(pids[r], nullptr, 0);
          status[r] = -1;
        }
      break;
    }
    if (left > 0) std::this_thread::sleep_for(10ms);
  }
  return status;
}

void require_all_ok(const std::vector<int>& status) {
  for (size_t r = 0; r < status.size(); ++r) {
    INFO("rank " << r << " exit status " << status[r]);
    REQUIRE(status[r] == 0);
  }
}

double bytes_of(const Communicator& c, Op op, Purpose p) {
  auto it = c.counters().bytes.find({op, p});
  return it == c.counters().bytes.end() ? 0.0 : it->second;
}
int64_t calls_of(const Communicator& c, Op op, Purpose p) {
  auto it = c.counters().calls.find({op, p});
  return it == c.counters().calls.end() ? 0 : it->second;
}

const auto kF = at::TensorOptions().dtype(at::kFloat);
const auto kL = at::TensorOptions().dtype(at::kLong);

}  // namespace

TEST_CASE("gloo send/recv along a pipeline of 4 ranks", "[comm][gloo]") {
  require_all_ok(run_ranks(4, [](Rank& rk) {
    Communicator& c = *rk.comm;
    const int r = rk.rank, n = rk.size;
    CHILD_CHECK(c.global_ranks() == std::vector<int>({0, 1, 2, 3}) && c.global_rank() == r);
    const int64_t act = 1000, grad = 300;
    // Forward: activations (float, tag 1) and a token count (int64, tag 2) from r-1 to r; the
    // receiver takes tag 2 first, so only the tag pairs them.
    if (r > 0) {
      auto ids = at::empty({5}, kL);
      auto x = at::empty({act}, kF);
      auto wi = c.recv(ids, r - 1, 2, Purpose::PipelineActivation);
      auto wx = c.recv(x, r - 1, 1, Purpose::PipelineActivation);
      wi->wait();
      wx->wait();
      CHILD_CHECK(at::equal(ids, at::arange(5, kL) + 7 * (r - 1)));
      CHILD_CHECK(at::equal(x, at::arange(act, kF) + 100 * (r - 1)));
    }
    if (r < n - 1) {
      auto wx = c.send(at::arange(act, kF) + 100 * r, r + 1, 1, Purpose::PipelineActivation);
      auto wi = c.send(at::arange(5, kL) + 7 * r, r + 1, 2, Purpose::PipelineActivation);
      wx->wait();
      wi->wait();
    }
    // Backward: gradients from r+1 to r, received into a non-contiguous view (a transpose).
    if (r < n - 1) {
      auto buf = at::zeros({3, grad / 3}, kF);
      auto dst = buf.t();  // (100, 3), not contiguous
      CHILD_CHECK(!dst.is_contiguous());
      c.recv(dst, r + 1, 3, Purpose::PipelineGradient)->wait();
      CHILD_CHECK(at::equal(dst, at::arange(grad, kF).view({grad / 3, 3}) - (r + 1)));
    }
    if (r > 0) c.send(at::arange(grad, kF).view({grad / 3, 3}) - r, r - 1, 3, Purpose::PipelineGradient)->wait();
    // Counters: bytes and calls of every message, by direction and purpose.
    const double fwd = act * 4.0 + 5 * 8.0, bwd = grad * 4.0;
    CHILD_CHECK(bytes_of(c, Op::Send, Purpose::PipelineActivation) == (r < n - 1 ? fwd : 0));
    CHILD_CHECK(calls_of(c, Op::Send, Purpose::PipelineActivation) == (r < n - 1 ? 2 : 0));
    CHILD_CHECK(bytes_of(c, Op::Recv, Purpose::PipelineActivation) == (r > 0 ? fwd : 0));
    CHILD_CHECK(calls_of(c, Op::Recv, Purpose::PipelineActivation) == (r > 0 ? 2 : 0));
    CHILD_CHECK(bytes_of(c, Op::Send, Purpose::PipelineGradient) == (r > 0 ? bwd : 0));
    CHILD_CHECK(bytes_of(c, Op::Recv, Purpose::PipelineGradient) == (r < n - 1 ? bwd : 0));
    // A non-contiguous send: rank 0 sends a transposed view to rank 3, whose values arrive in
    // the view's logical order.
    if (r == 0) c.send(at::arange(12, kF).view({3, 4}).t(), 3, 9, Purpose::None)->wait();
    if (r == 3) {
      auto t = at::empty({4, 3}, kF);
      c.recv(t, 0, 9, Purpose::None)->wait();
      CHILD_CHECK(at::equal(t, at::arange(12, kF).view({3, 4}).t()));
    }
    // Bad peers are argument errors, not hangs.
    bool threw = false;
    try {
      c.send(at::zeros({1}, kF), r, 0, Purpose::None);
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    CHILD_CHECK(threw);
    c.barrier();
  }));
}

// Groups {0,1},{2,3} (tensor parallel) and {0,2},{1,3} (data parallel).
TEST_CASE("gloo sub-groups of 4 ranks: collectives, messages, shared counters", "[comm][gloo]") {
  require_all_ok(run_ranks(4, [](Rank& rk) {
    Communicator& w = *rk.comm;
    const int r = rk.rank;
    // Tensor-parallel pairs, then data-parallel pairs, in the same order on every rank.
    auto tp = w.subgroup(r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3});
    auto dp = w.subgroup(r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3});
    CHILD_CHECK(tp->size() == 2 && tp->rank() == r % 2);
    CHILD_CHECK(dp->size() == 2 && dp->rank() == r / 2);
    CHILD_CHECK(tp->global_ranks() == (r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    CHILD_CHECK(dp->global_ranks() == (r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3}));
    CHILD_CHECK(&tp->counters() == &w.counters() && &dp->counters() == &w.counters());
    const std::vector<int> tpm = tp->global_ranks(), dpm = dp->global_ranks();

    // All-reduce: sum of (world rank + 1) over the group.
    auto a = at::full({64}, float(r + 1), kF);
    tp->allreduce(a, Purpose::TensorParallel)->wait();
    CHILD_CHECK(at::equal(a, at::full({64}, float(tpm[0] + tpm[1] + 2), kF)));
    auto b = at::full({32}, float(r + 1), kF);
    dp->allreduce(b, Purpose::GradientReduce)->wait();
    CHILD_CHECK(at::equal(b, at::full({32}, float(dpm[0] + dpm[1] + 2), kF)));

    // Maximum (counted as an all-reduce).
    auto m = at::full({4}, float(r), kF);
    tp->allreduce_max(m, Purpose::TensorParallel)->wait();
    CHILD_CHECK(at::equal(m, at::full({4}, float(tpm[1]), kF)));

    // All-gather: member i's input at slice i.
    auto in = at::full({3}, float(10 * r), kF);
    auto out = at::empty({6}, kF);
    tp->all_gather(out, in, Purpose::TensorParallel)->wait();
    CHILD_CHECK(at::equal(out, at::cat({at::full({3}, float(10 * tpm[0]), kF), at::full({3}, float(10 * tpm[1]), kF)})));
    auto gin = at::full({4}, int64_t(r), kL);
    auto gout = at::empty({8}, kL);
    dp->all_gather(gout, gin, Purpose::ParamGather)->wait();
    CHILD_CHECK(at::equal(gout, at::cat({at::full({4}, int64_t(dpm[0]), kL), at::full({4}, int64_t(dpm[1]), kL)})));

    // Reduce-scatter: in[i] = 100 * world rank + i; this member gets its slice of the sum.
    auto rin = at::arange(8, kF) + 100 * r;
    auto rout = at::empty({4}, kF);
    dp->reduce_scatter(rout, rin, Purpose::GradientReduce)->wait();
    auto expect = (at::arange(8, kF) * 2 + 100 * (dpm[0] + dpm[1])).narrow(0, 4 * dp->rank(), 4);
    CHILD_CHECK(at::equal(rout, expect));

    // Messages inside a group use the group's ranks: dp rank 0 -> dp rank 1.
    if (dp->rank() == 0) dp->send(at::full({16}, float(r), kF), 1, 5, Purpose::PipelineActivation)->wait();
    else {
      auto t = at::empty({16}, kF);
      dp->recv(t, 0, 5, Purpose::PipelineActivation)->wait();
      CHILD_CHECK(at::equal(t, at::full({16}, float(dpm[0]), kF)));
    }

    // A second group over the same members (named apart by its creation count), a nested group
    // of one (the identity, still counted), and a nested group naming world ranks.
    auto tp2 = w.subgroup(tp->global_ranks());
    auto c = at::full({8}, float(r), kF);
    tp2->allreduce(c, Purpose::TensorParallel)->wait();
    CHILD_CHECK(at::equal(c, at::full({8}, float(tpm[0] + tpm[1]), kF)));
    auto self = dp->subgroup({dp->rank()});
    CHILD_CHECK(self->size() == 1 && self->global_ranks() == std::vector<int>{r});
    auto s = at::full({2}, 5.0f, kF);
    self->allreduce(s, Purpose::TensorParallel)->wait();
    CHILD_CHECK(at::equal(s, at::full({2}, 5.0f, kF)));
    auto nested = dp->subgroup({0, 1});
    CHILD_CHECK(nested->global_ranks() == dpm);
    auto d = at::full({4}, 1.0f, kF);
    nested->allreduce(d, Purpose::None)->wait();
    CHILD_CHECK(at::equal(d, at::full({4}, 2.0f, kF)));

    // Everything counted in the world's counters, by the collective's "size".
    CHILD_CHECK(bytes_of(w, Op::AllReduce, Purpose::TensorParallel) == 64 * 4 + 4 * 4 + 8 * 4 + 2 * 4);
    CHILD_CHECK(calls_of(w, Op::AllReduce, Purpose::TensorParallel) == 4);
    CHILD_CHECK(bytes_of(w, Op::AllReduce, Purpose::GradientReduce) == 32 * 4);
    CHILD_CHECK(bytes_of(w, Op::AllReduce, Purpose::None) == 4 * 4);
    CHILD_CHECK(bytes_of(w, Op::AllGather, Purpose::TensorParallel) == 6 * 4);
    CHILD_CHECK(bytes_of(w, Op::AllGather, Purpose::ParamGather) == 8 * 8);
    CHILD_CHECK(bytes_of(w, Op::ReduceScatter, Purpose::GradientReduce) == 8 * 4);
    CHILD_CHECK(bytes_of(w, Op::Send, Purpose::PipelineActivation) == (dp->rank() == 0 ? 64 : 0));
    CHILD_CHECK(bytes_of(w, Op::Recv, Purpose::PipelineActivation) == (dp->rank() == 1 ? 64 : 0));
    // Resetting from a sub-group clears the world's too.
    tp->reset_counters();
    CHILD_CHECK(w.counters().bytes.empty() && w.counters().calls.empty());
    w.barrier();
  }));
}

namespace {
// Whether a receive of 10 floats from rank 1 ends in a CommError (not a hang, not success).
bool recv_from_1_fails(Communicator& c) {
  auto t = at::empty({10}, kF);
  try {
    c.recv(t, 1, 0, Purpose::PipelineActivation)->wait();
  } catch (const CommError&) {
    return true;
  }
  return false;
}
}  // namespace

TEST_CASE("gloo recv from a peer that exited fails with CommError", "[comm][gloo]") {
  require_all_ok(run_ranks(2, [](Rank& rk) {
    Communicator& c = *rk.comm;
    c.barrier();
    if (rk.rank == 1) _exit(0);  // gone without sending
    CHILD_CHECK(recv_from_1_fails(c));
  }, 3000ms));
}

TEST_CASE("gloo recv from a live peer that never sends fails with CommError", "[comm][gloo]") {
  require_all_ok(run_ranks(2, [](Rank& rk) {
    Communicator& c = *rk.comm;
    c.barrier();
    if (rk.rank == 0) {
      const bool failed = recv_from_1_fails(c);
      rk.store->set("recv_done", {1});
      CHILD_CHECK(failed);
      rk.store->get("peer_done");  // rank 0 serves the store: stay until rank 1 has read
    } else {
      rk.store->get("recv_done");  // alive, never sending, until rank 0 gave up
      rk.store->set("peer_done", {1});
    }
  }, 3000ms));
}

TEST_CASE("local communicator: identity collectives and a sub-group of one", "[comm]") {
  // In-process, on tiny tensors that start no thread pool (a later fork stays safe).
  auto c = make_local_communicator();
  REQUIRE(c->size() == 1);
  REQUIRE(c->global_ranks() == std::vector<int>{0});
  auto g = c->subgroup({0});
  REQUIRE(g->size() == 1);
  REQUIRE(&g->counters() == &c->counters());
  auto t = at::ones({4}, kF);
  g->allreduce(t, Purpose::TensorParallel)->wait();
  REQUIRE(bytes_of(*c, Op::AllReduce, Purpose::TensorParallel) == 16);
  REQUIRE_THROWS_AS(c->send(t, 0, 0, Purpose::None), std::logic_error);
  REQUIRE_THROWS_AS(c->recv(t, 0, 0, Purpose::None), std::logic_error);
  REQUIRE_THROWS_AS(c->subgroup({1}), std::invalid_argument);
}

// ---- all-to-all and 1-bit Adam --------------------------------------------------------------

TEST_CASE("gloo all-to-all of byte tensors and all-gather of bytes, 2 and 4 ranks", "[comm][gloo][onebit]") {
  for (int n : {2, 4}) {
    INFO(n << " ranks");
    require_all_ok(run_ranks(n, [](Rank& rk) {
      Communicator& c = *rk.comm;
      const int r = rk.rank, n = rk.size;
      const int64_t chunk = 5;
      // Rank r sends byte 10 * r + d + k (k the index in the chunk) to rank d.
      auto in = at::empty({n * chunk}, at::kByte);
      for (int d = 0; d < n; ++d)
        for (int k = 0; k < chunk; ++k) in[d * chunk + k] = 10 * r + d + k;
      auto out = at::zeros({n * chunk}, at::kByte);
      c.all_to_all(out, in, Purpose::OneBitSigns)->wait();
      for (int s = 0; s < n; ++s)
        for (int k = 0; k < chunk; ++k) CHILD_CHECK(out[s * chunk + k].item<int>() == 10 * s + r + k);
      CHILD_CHECK(bytes_of(c, Op::AllToAll, Purpose::OneBitSigns) == double(n * chunk));
      auto mine = at::full({3}, 200 + r, at::kByte);
      auto all = at::empty({3 * n}, at::kByte);
      c.all_gather(all, mine, Purpose::OneBitServer)->wait();
      for (int s = 0; s < n; ++s) CHILD_CHECK(all[3 * s].item<int>() == 200 + s);
      CHILD_CHECK(bytes_of(c, Op::AllGather, Purpose::OneBitServer) == double(3 * n));
    }));
  }
}

TEST_CASE("1-bit sign packing: 8 signs a byte, first element in the most significant bit", "[onebit]") {
  auto x = at::tensor({1.f, -1.f, 0.f, -0.5f, 2.f, 3.f, -4.f, 5.f, -1.f, -1.f, -1.f, -1.f, -1.f, -1.f, -1.f, 0.f});
  auto p = dssim::tb::pack_signs(x);
  REQUIRE(p.scalar_type() == at::kByte);
  REQUIRE(p.numel() == 2);
  CHECK(p[0].item<int>() == 0b10101101);  // zero counts as + (DeepSpeed's sign().add_(1).bool())
  CHECK(p[1].item<int>() == 0b00000001);
  auto u = dssim::tb::unpack_signs(p);
  REQUIRE(u.numel() == 16);
  for (int i = 0; i < 16; ++i) CHECK(u[i].item<float>() == (x[i].item<float>() >= 0 ? 1.f : -1.f));
  CHECK(dssim::tb::onebit_padded_numel(1, 2) == 16);
  CHECK(dssim::tb::onebit_padded_numel(17, 2) == 32);
  CHECK(dssim::tb::onebit_padded_numel(1, 3) == 72);  // 3 * lcm(3, 8)
  CHECK(dssim::tb::onebit_padded_numel(33, 4) == 64);
}

namespace {

// Deterministic per-(rank, step) gradients, different on every rank.
at::Tensor test_grad(int64_t numel, int rank, int step) {
  at::Generator g = at::detail::createCPUGenerator(uint64_t(1000 * step + rank + 7));
  return at::randn({numel}, g, kF).mul_(0.1 * (1 + rank));
}

// The algorithm in one process over all `n` ranks, written from Tang et al. (2021) Algorithm 1 /
// DeepSpeed's OnebitAdam + compressed_allreduce without any communication or bit packing:
// warm-up: AdamW on the averaged gradient; then per rank m_r = b1 m_r + (1 - b1) g_r, the
// error-compensated two-level 1-bit average of the m_r, the update with the frozen variance.
// Returns every rank's parameters.
std::vector<at::Tensor> onebit_reference(int n, int64_t numel, int steps, int64_t freeze, const AdamWHyper& h) {
  const int64_t divider = std::lcm(int64_t(n), int64_t(8)), unit = n * divider;
  const int64_t padded = (numel + unit - 1) / unit * unit, chunk = padded / n;
  at::Tensor p = at::linspace(-1, 1, numel, kF);
  std::vector<at::Tensor> ps(n), ms(n), werr(n), serr(n);
  at::Tensor m = at::zeros({numel}, kF), v = at::zeros({numel}, kF);
  for (int r = 0; r < n; ++r) {
    werr[r] = at::zeros({padded}, kF);
    serr[r] = at::zeros({chunk}, kF);
  }
  auto sgn = [](const at::Tensor& x) { return at::where(x >= 0, at::ones_like(x), -at::ones_like(x)); };
  for (int t = 0; t < steps; ++t) {
    const double bc1 = 1 - std::pow(h.beta1, t + 1);
    if (t < freeze) {
      at::Tensor g = at::zeros({numel}, kF);
      for (int r = 0; r < n; ++r) g += test_grad(numel, r, t);
      g /= n;
      m = m * h.beta1 + g * (1 - h.beta1);
      v = v * h.beta2 + g * g * (1 - h.beta2);
      const double bc2 = 1 - std::pow(h.beta2, t + 1);
      p = p * (1 - h.lr * h.weight_decay) - (h.lr / bc1) * m / (v.sqrt() / std::sqrt(bc2) + h.eps);
      if (t + 1 == freeze)
        for (int r = 0; r < n; ++r) ms[r] = m.clone();
      continue;
    }
    // Worker side.
    std::vector<at::Tensor> q(n);
    for (int r = 0; r < n; ++r) {
      ms[r] = ms[r] * h.beta1 + test_grad(numel, r, t) * (1 - h.beta1);
      at::Tensor x = at::cat({ms[r], at::zeros({padded - numel}, kF)}) + werr[r];
      const at::Tensor scale = at::norm(x) / std::sqrt(double(padded));
      q[r] = scale * sgn(x);
      werr[r] = x - q[r];
    }
    // Server side: rank j owns elements [j chunk, (j + 1) chunk).
    at::Tensor avg = at::zeros({padded}, kF);
    for (int j = 0; j < n; ++j) {
      at::Tensor y = at::zeros({chunk}, kF);
      for (int r = 0; r < n; ++r) y += q[r].narrow(0, j * chunk, chunk) / double(n);
      y += serr[j];
      const at::Tensor scale = at::norm(y) / std::sqrt(double(chunk));
      const at::Tensor c = scale * sgn(y);
      serr[j] = y - c;
      avg.narrow(0, j * chunk, chunk).copy_(c);
    }
    const double bc2 = 1 - std::pow(h.beta2, double(freeze));
    for (int r = 0; r < n; ++r) ms[r] = avg.narrow(0, 0, numel).clone();
    p = p * (1 - h.lr * h.weight_decay) - (h.lr / bc1) * ms[0] / (v.sqrt() / std::sqrt(bc2) + h.eps);
  }
  for (int r = 0; r < n; ++r) ps[r] = p.clone();
  return ps;
}

}  // namespace

TEST_CASE("1-bit Adam over gloo equals a one-process reference, 2 and 4 ranks", "[onebit][gloo]") {
  for (int n : {2, 4}) {
    INFO(n << " ranks");
    require_all_ok(run_ranks(n, [](Rank& rk) {
      Communicator& c = *rk.comm;
      const int r = rk.rank, n = rk.size;
      const int64_t numel = 1001, freeze = 3;
      const int steps = 10;
      const AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.01};
      at::Tensor p = at::linspace(-1, 1, numel, kF), m = at::zeros({numel}, kF), v = at::zeros({numel}, kF);
      dssim::tb::OnebitAdam ob(numel, &c, freeze, kF);
      const int64_t padded = ob.padded_numel();
      for (int t = 0; t < steps; ++t) {
        at::Tensor g = test_grad(numel, r, t);
        if (!ob.compressing(t)) {  // the engine's warm-up: averaged gradient, AdamW
          c.allreduce(g, Purpose::GradientReduce)->wait();
          g.mul_(1.0 / n);
          adamw_step(p, g, m, v, t + 1, h);
          continue;
        }
        c.reset_counters();
        ob.update_momentum(m, g, h.beta1);
        ob.compressed_allreduce(m);
        CHILD_CHECK(ob.momentum_ready());
        ob.step(p, m, v, t + 1, h);
        // Bytes as the Program counts them (core/program_builder.cpp).
        CHILD_CHECK(bytes_of(c, Op::AllToAll, Purpose::OneBitSigns) == double(padded) / 8);
        CHILD_CHECK(bytes_of(c, Op::AllGather, Purpose::OneBitServer) == double(padded) / 8);
        CHILD_CHECK(bytes_of(c, Op::AllGather, Purpose::OneBitScales) == 2 * 4.0 * n);
        CHILD_CHECK(calls_of(c, Op::AllGather, Purpose::OneBitScales) == 2);
      }
      const auto ref = onebit_reference(n, numel, steps, freeze, h);
      const double rel = (p - ref[r]).norm().item<double>() / ref[r].norm().item<double>();
      std::fprintf(stderr, "rank %d of %d: ||p - reference|| / ||reference|| = %.3g\n", r, n, rel);
      CHILD_CHECK(rel <= 1e-6);
      // The compression did something: the parameters are not those of uncompressed Adam.
      at::Tensor err = ob.worker_error();
      CHILD_CHECK(err.abs().sum().item<double>() > 0);
      // Every rank ends with the same parameters.
      auto all = at::empty({n * numel}, kF);
      c.all_gather(all, p, Purpose::None)->wait();
      for (int s = 0; s < n; ++s) CHILD_CHECK(at::equal(all.narrow(0, s * numel, numel), p));
    }));
  }
}

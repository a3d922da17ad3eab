// Rendezvous, local rank spawning, and the measured Report.
#include "backends/torch/run.hpp"
#include <algorithm>
#include <arpa/inet.h>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include "backends/torch/comm.hpp"
#include "backends/torch/engine.hpp"
#include "backends/torch/env.hpp"
#include "backends/torch/fused_cross_entropy.hpp"
#include "backends/torch/gemm_epilogues.hpp"
#include "backends/torch/loss_scaler.hpp"
#include "backends/torch/torch_compat.hpp"
#include "core/program_builder.hpp"
#include "core/report.hpp"
#include "core/scenario_loader.hpp"

namespace dssim::tb {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Report make_report(const Scenario& sc, const Program& program, const EngineResult& res,
                   const RunOptions& o, const std::string& comm_name) {
  Report r;
  r.backend = o.backend;
  r.iteration_seconds = median(res.step_seconds);
  fill_throughput(sc, r);
  r.losses = res.losses;
  r.wire_bytes_per_rank = wire_bytes_by_purpose(program, 0);
  const double n = std::max(1, res.measured_steps);
  // The breakdown is the mean over measured steps, scaled to the median iteration it explains.
  double mean_step = 0;
  for (double t : res.step_seconds) mean_step += t / n;
  const double to_median = mean_step > 0 ? r.iteration_seconds / mean_step : 1.0;
  auto sec = [&](const char* k) {
    auto it = res.seconds_by_op.find(k);
    return it == res.seconds_by_op.end() ? 0.0 : it->second / n * to_median;
  };
  r.time.forward = sec("forward");
  r.time.backward = sec("backward");
  r.time.recompute = sec("recompute");
  r.time.optimizer = sec("optimizer_step") + sec("host_optimizer_step");
  r.time.exposed_offload = sec("copy_h2d") + sec("copy_d2h");
  // Exposed communication: issuing the collectives plus waiting for them where their results are
  // consumed (dp_comm_wait). Tensor-parallel collectives run inside the compute, blocking it (as
  // Megatron's do); the rest of the collectives' time is data-parallel (and the embedding sync).
  r.time.exposed_tp = res.tp_comm_seconds / n * to_median;
  r.time.exposed_ep = res.ep_comm_seconds / n * to_median;  // MoE all-to-alls, blocking the compute
  r.time.exposed_dp = std::max(0.0, sec("all_reduce") + sec("reduce_scatter") + sec("all_gather") +
                                        sec("dp_comm_wait") - r.time.exposed_tp);
  // Pipeline: issuing the sends, and the compute's waits for a receive, which are the bubble
  // (waiting for the neighbour stage to produce) plus whatever of the transfer was not hidden.
  r.time.exposed_pp = sec("send");
  r.time.bubble = sec("recv");
  auto mem = [&](const char* k) {
    auto it = res.memory_bytes.find(k);
    return it == res.memory_bytes.end() ? 0.0 : it->second;
  };
  r.memory.params = mem("params");
  r.memory.grads = mem("grads");
  r.memory.optimizer = mem("optimizer");
  r.memory.host = mem("host_optimizer");
  r.memory.activations = mem("activations_and_temporaries");
  nlohmann::json measured;
  nlohmann::json bytes = nlohmann::json::object(), calls = nlohmann::json::object();
  for (const auto& [k, v] : res.comm.bytes) bytes[counter_key(k.first, k.second)] = v / n;
  for (const auto& [k, v] : res.comm.calls) calls[counter_key(k.first, k.second)] = double(v) / n;
  nlohmann::json expected = nlohmann::json::object();
  for (const auto& [k, v] : res.expected_bytes) expected[k] = v / n;
  nlohmann::json secs = nlohmann::json::object();
  for (const auto& [k, v] : res.seconds_by_op) secs[k] = v / n;
  measured["communicator"] = comm_name;
  measured["bytes_per_iteration"] = bytes;             // size bytes per collective kind / purpose
  measured["calls_per_iteration"] = calls;
  measured["expected_bytes_per_iteration"] = expected;  // the Program's, same keys
  measured["seconds_per_iteration_by_instruction"] = secs;
  measured["step_seconds"] = res.step_seconds;
  measured["measured_steps"] = res.measured_steps;
  measured["warmup_steps"] = res.warmup_steps;
  measured["first_step"] = res.first_step;
  measured["loss_scales"] = res.loss_scales;
  std::vector<int> skipped;
  for (size_t i = 0; i < res.skipped.size(); ++i)
    if (res.skipped[i]) skipped.push_back(int(res.first_step + i));
  measured["skipped_steps"] = skipped;
  measured["memory_bytes"] = res.memory_bytes;
  if (!res.moe.empty()) measured["moe"] = res.moe;
  if (!res.host_offload.empty()) {
    nlohmann::json h = nlohmann::json::object();
    for (const auto& [k, v] : res.host_offload) h[k] = v / n;
    measured["host_offload_per_iteration"] = h;
  }
  if (!res.memory_timeline.empty()) {
    nlohmann::json tl = nlohmann::json::array();
    for (const auto& p : res.memory_timeline)
      tl.push_back({{"op", p.op}, {"micro_batch", p.micro_batch}, {"layer_begin", p.layer_begin},
                    {"allocated", p.allocated}, {"peak", p.peak}});
    measured["memory_timeline"] = tl;  // first measured step, per instruction (bytes)
  }
  // ZeRO-3: what the run did with the layers' gradients (what the model prices is
  // core/memory.hpp zero3_backward_into_partition; DSSIM_ZERO3_FOLD=1 departs from it).
  if (res.zero3_backward_into_partition) measured["zero3_backward_into_partition"] = *res.zero3_backward_into_partition;
  measured["flash_attention"] = flash_attention_available();
  // How seconds_per_iteration_by_instruction was timed: host syncs at each change of kind, or CUDA
  // events (the default on one GPU and one rank; DSSIM_TIMING=sync turns them off).
  measured["instruction_timing"] = res.event_timing ? "events" : "syncs";
  // The fused GPU paths the run took (gemm_epilogues.hpp, cross_entropy_cuda.hpp): what a record
  // of this run was measured with.
  if (o.backend == "cuda") {
    const std::string epilogues = gemm_epilogues_mode();
    measured["gemm_epilogues"] = epilogues.empty() ? "none" : epilogues;
    measured["gemm_epilogue_fallbacks"] = gemm_epilogue_fallbacks();
    measured["cross_entropy_kernel"] = cross_entropy_kernel_enabled();
    measured["device"] = cuda_device_name();  // what a record names as its GPU
  }
  measured["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  r.extras["measured"] = measured;
  return r;
}

std::string text_extras(const Report& r) {
  const auto& m = r.extras["measured"];
  std::ostringstream s;
  char buf[256];
  s << "\nmeasured (" << m["communicator"].get<std::string>() << ", " << m["measured_steps"].get<int>()
    << " steps after " << m["warmup_steps"].get<int>() << " warm-up):\n";
  s << "  time per instruction kind (s/iteration):\n";
  for (auto it = m["seconds_per_iteration_by_instruction"].begin(); it != m["seconds_per_iteration_by_instruction"].end(); ++it) {
    std::snprintf(buf, sizeof buf, "    %-22s %10.4f\n", it.key().c_str(), it.value().get<double>());
    s << buf;
  }
  s << "  bytes per collective (size bytes/iteration, measured vs Program):\n";
  std::set<std::string> keys;
  for (auto it = m["bytes_per_iteration"].begin(); it != m["bytes_per_iteration"].end(); ++it) keys.insert(it.key());
  for (auto it = m["expected_bytes_per_iteration"].begin(); it != m["expected_bytes_per_iteration"].end(); ++it) keys.insert(it.key());
  for (const auto& k : keys) {
    const double a = m["bytes_per_iteration"].value(k, 0.0), e = m["expected_bytes_per_iteration"].value(k, 0.0);
    std::snprintf(buf, sizeof buf, "    %-36s %14.0f %14.0f%s\n", k.c_str(), a, e,
                  k.find("/none") != std::string::npos ? "  (control: norm / loss)" : "");
    s << buf;
  }
  if (m.contains("gemm_epilogues"))
    s << "  fused GPU kernels: GEMM epilogues " << m["gemm_epilogues"].get<std::string>() << " ("
      << m["gemm_epilogue_fallbacks"].get<int64_t>() << " fallbacks), cross-entropy kernel "
      << (m["cross_entropy_kernel"].get<bool>() ? "on" : "off") << "\n";
  s << "  memory (bytes): ";
  for (auto it = m["memory_bytes"].begin(); it != m["memory_bytes"].end(); ++it)
    s << it.key() << "=" << std::llround(it.value().get<double>()) << " ";
  s << "\n  loss curve:";
  const auto first = m["first_step"].get<int64_t>();
  for (size_t i = 0; i < r.losses.size(); ++i) {
    std::snprintf(buf, sizeof buf, " %lld:%.4f", (long long)(first + int64_t(i)), r.losses[i]);
    s << buf;
  }
  s << "\n";
  return s.str();
}

}  // namespace

int env_world_size() { return env_int("WORLD_SIZE", 1); }
bool env_has_rank() { return std::getenv("RANK") != nullptr; }

int run_rank(const Scenario& sc, const RunOptions& o) {
  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 1);
  const int local_rank = env_int("LOCAL_RANK", rank), local_world = env_int("LOCAL_WORLD_SIZE", world);
  try {
    torch::Device device(torch::kCPU);
    if (o.backend == "cuda") {
      if (!torch_has_cuda()) {
        std::fprintf(stderr, "dssim run: --backend cuda: this dssim was built against a libtorch without CUDA "
                             "(build it against pip torch with -DDSSIM_WITH_CUDA=ON, see scripts/gpu_bench.sh); "
                             "use --backend cpu\n");
        return 1;
      }
      if (!torch::cuda::is_available() || int(torch::cuda::device_count()) <= local_rank) {
        std::fprintf(stderr, "dssim run: --backend cuda: no CUDA GPU for local rank %d (%d visible)\n",
                     local_rank, int(torch::cuda::is_available() ? torch::cuda::device_count() : 0));
        return 1;
      }
      device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
      set_cuda_device(local_rank);
    } else if (o.backend != "cpu") {
      std::fprintf(stderr, "dssim run: --backend must be cuda or cpu (got '%s')\n", o.backend.c_str());
      return 2;
    } else {
      const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
      at::set_num_threads(std::max(1, hw / std::max(1, local_world)));
      if (const char* t = std::getenv("DSSIM_CPU_THREADS")) at::set_num_threads(std::max(1, std::atoi(t)));
    }
    const auto timeout = std::chrono::milliseconds(int64_t(o.timeout_seconds * 1000));
    std::unique_ptr<Communicator> comm;
    c10::intrusive_ptr<c10d::Store> store;
    if (world > 1) {
      c10d::TCPStoreOptions so;
      so.port = uint16_t(env_int("MASTER_PORT", 29500));
      so.isServer = rank == 0;
      so.numWorkers = world;
      so.timeout = timeout;
      store = c10::make_intrusive<c10d::TCPStore>(env_str("MASTER_ADDR", "127.0.0.1"), so);
      if (device.is_cuda()) {
#ifdef DSSIM_HAVE_NCCL
        comm = make_nccl_communicator(store, rank, world, local_rank, timeout);
#else
        throw std::runtime_error("several CUDA ranks need the NCCL communicator (DSSIM_WITH_CUDA=ON)");
#endif
      } else {
#ifdef DSSIM_HAVE_GLOO
        comm = make_gloo_communicator(store, rank, world, timeout);
#else
        throw std::runtime_error("several CPU ranks need the gloo communicator (libgloo-dev headers)");
#endif
      }
    } else {
      comm = make_local_communicator();
    }
    const Program program = build_program(sc);
    const EngineResult res = train(sc, program, *comm, o.engine, device);
    if (rank == 0) {
      const Report r = make_report(sc, program, res, o, comm->name());
      if (o.json) std::cout << report_json(sc, r).dump(2) << std::endl;
      else std::cout << report_text(sc, r, o.verbose) << text_extras(r) << std::flush;
    }
    comm->barrier();
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "dssim run: rank %d: %s\n", rank, e.what());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "dssim run: rank %d: %s\n", rank, e.what());
    return 2;
  } catch (const LossScaleAtMinimum& e) {
    std::fprintf(stderr, "dssim run: rank %d: %s\n", rank, e.what());
    return 1;
  } catch (const CommError& e) {
    std::fprintf(stderr, "dssim run: rank %d: %s\n", rank, e.what());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "dssim run: rank %d: %s\n", rank, e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dssim run: rank %d: %s\n", rank, e.what());
    return 1;
  }
}

int spawn_local_ranks(int nproc, double timeout_seconds) {
  std::vector<std::string> args;
  {
    std::ifstream in("/proc/self/cmdline", std::ios::binary);
    std::string a;
    while (std::getline(in, a, '\0')) args.push_back(a);
  }
  std::vector<std::string> kept;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc") { ++i; continue; }
    if (args[i].rfind("--nproc=", 0) == 0) continue;
    kept.push_back(args[i]);
  }
  // A free port for the TCPStore.
  int port = 29500;
  {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
    if (fd >= 0) ::close(fd);
  }
  std::vector<char*> argv;
  for (auto& s : kept) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(nproc, -1);
  for (int r = 0; r < nproc; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("dssim run: fork");
      for (pid_t p : pids) if (p > 0) ::kill(p, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::execv("/proc/self/exe", argv.data());
      std::perror("dssim run: exec");
      ::_exit(1);
    }
    pids[r] = pid;
  }
  using Clock = std::chrono::steady_clock;
  int worst = 0, alive = nproc;
  bool deadline_set = false;
  Clock::time_point deadline;
  while (alive > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      const int r = int(std::find(pids.begin(), pids.end(), pid) - pids.begin());
      if (r >= nproc) continue;
      pids[r] = -1;
      --alive;
      int code = 0;
      if (WIFEXITED(status)) code = WEXITSTATUS(status);
      else if (WIFSIGNALED(status)) {
        std::fprintf(stderr, "dssim run: rank %d was killed by signal %d\n", r, WTERMSIG(status));
        code = 1;
      }
      if (code != 0) {
        if (code == 2 || worst == 0) worst = std::max(worst, code);
        if (!deadline_set) {
          deadline_set = true;
          deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_seconds * 1000) + 5000);
        }
      }
      continue;
    }
    if (deadline_set && Clock::now() > deadline) {
      for (int r = 0; r < nproc; ++r)
        if (pids[r] > 0) {
          std::fprintf(stderr, "dssim run: rank %d did not exit within the timeout after a rank failed; killing it\n", r);
          ::kill(pids[r], SIGKILL);
        }
      worst = std::max(worst, 1);
      deadline_set = false;
      deadline = Clock::now() + std::chrono::hours(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return worst;
}

}  // namespace dssim::tb

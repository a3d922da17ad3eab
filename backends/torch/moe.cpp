#include "backends/torch/moe.hpp"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>
#include "backends/torch/torch_compat.hpp"

namespace dssim::tb {

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

double size_bytes(const at::Tensor& t) { return double(t.numel()) * double(t.element_size()); }

// DeepSpeed's gumbel_rsample: -log(-log(U)), U uniform in (0, 1).
at::Tensor gumbel(const at::Tensor& like, at::Generator& gen) {
  auto u = at::empty(like.sizes(), like.options().dtype(at::kFloat));
  u.uniform_(0.0, 1.0, gen);
  u.clamp_(std::numeric_limits<float>::min(), 1.0 - std::numeric_limits<float>::epsilon());
  return -at::log(-at::log(u));
}

// Place of each assignment in its expert's buffer: the running count of the expert's assignments
// in token order (cumsum of the one-hot mask, minus one).
at::Tensor locations(const at::Tensor& mask) { return at::cumsum(mask, 0) - 1; }

// The all-to-all as an autograd function: its backward is the all-to-all of the gradient (the
// same purpose: the Program lists a dispatch and a combine in both passes).
struct AllToAllFn : torch::autograd::Function<AllToAllFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t ep_ptr, int64_t purpose) {
    ctx->saved_data["ep"] = ep_ptr;
    ctx->saved_data["p"] = purpose;
    return reinterpret_cast<ExpertParallel*>(intptr_t(ep_ptr))->all_to_all(x, Purpose(purpose));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto* ep = reinterpret_cast<ExpertParallel*>(intptr_t(ctx->saved_data["ep"].toInt()));
    return {ep->all_to_all(g[0], Purpose(ctx->saved_data["p"].toInt())), at::Tensor(), at::Tensor()};
  }
};

at::Tensor exchange(ExpertParallel& ep, const at::Tensor& x, Purpose p) {
  if (!ep.comm) return x;  // ep = 1: every expert is local
  return AllToAllFn::apply(x, int64_t(intptr_t(&ep)), int64_t(p));
}

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

int64_t expert_numel(const ModelSpec& m) {
  const int64_t h = m.hidden, f = m.ffn_hidden > 0 ? m.ffn_hidden : 4 * int64_t(m.hidden);
  return 2 * h * f + f + h;
}

Routing top_k_gating(const at::Tensor& logits, const ModelSpec& m, at::Generator& gen,
                     const std::function<int64_t(int64_t)>& max_over_group) {
  if (logits.dim() != 2 || logits.scalar_type() != at::kFloat)
    throw std::invalid_argument("top_k_gating: fp32 logits [tokens, experts]");
  if (m.top_k != 1 && m.top_k != 2)
    throw std::invalid_argument("model.top_k = " + std::to_string(m.top_k) +
                                ": the torch backend gates top-1 and top-2 (DeepSpeed's TopKGate); set model.top_k: 1 or 2");
  const int64_t T = logits.size(0), E = logits.size(1);
  const auto lopt = logits.options().dtype(at::kLong);
  Routing r;
  auto gates = at::softmax(logits, 1);
  const auto me = gates.mean(0);
  const auto capacity_for = [&](const at::Tensor& counts) {
    if (m.drop_tokens) return m.expert_capacity(T);
    const int64_t busiest = counts.max().item<int64_t>();
    return max_over_group ? max_over_group(busiest) : busiest;
  };
  if (m.top_k == 1) {
    const at::Tensor choose = m.noisy_gate_policy == ModelSpec::NoisyGate::rsample
                                  ? logits.detach() + gumbel(logits, gen)
                                  : gates.detach();
    const auto idx1 = choose.argmax(1);
    const auto mask1 = at::one_hot(idx1, E).to(at::kLong);
    r.exp_counts = mask1.sum(0);
    r.capacity = capacity_for(r.exp_counts);
    r.l_aux = (me * mask1.to(at::kFloat).mean(0)).sum() * double(E);
    at::Tensor keep;
    if (m.use_rts) {
      // Random Token Selection: each expert keeps the `capacity` of its tokens with the largest
      // uniform draws (torch.topk over mask * U along the tokens).
      auto u = at::empty({T, E}, logits.options());
      u.uniform_(0.0, 1.0, gen);
      const int64_t c = std::min<int64_t>(r.capacity, T);
      const auto top = std::get<1>(at::topk(mask1.to(at::kFloat) * u, c, 0));
      keep = at::zeros_like(mask1).scatter_(0, top, 1) * mask1;
    } else {
      keep = mask1 * at::lt(locations(mask1), r.capacity).to(at::kLong);  // the first ones
    }
    const auto kept = keep.sum(1) > 0;
    r.expert = idx1.unsqueeze(1);
    r.slot = at::where(kept, (locations(keep) * keep).sum(1), at::full({}, -1, lopt)).unsqueeze(1);
    r.weight = (gates * keep.to(at::kFloat)).sum(1).unsqueeze(1);
    r.dropped = T - kept.sum();
    return r;
  }
  // Top-2: the first choice by the gates, the second by the Gumbel-noised logits among the others
  // (DeepSpeed's top2_2nd_expert_sampling); first choices fill the buffers before second ones.
  const auto idx1 = gates.detach().argmax(1);
  auto mask1 = at::one_hot(idx1, E).to(at::kLong);
  const auto noisy = (logits.detach() + gumbel(logits, gen)).masked_fill(mask1.to(at::kBool),
                                                                          -std::numeric_limits<float>::infinity());
  const auto idx2 = noisy.argmax(1);
  auto mask2 = at::one_hot(idx2, E).to(at::kLong);
  const auto loc1 = locations(mask1);
  const auto loc2 = locations(mask2) + mask1.sum(0, true);
  r.exp_counts = (mask1 + mask2).sum(0);
  r.l_aux = (me * mask1.to(at::kFloat).mean(0)).mean() * double(E) * double(E);
  r.capacity = capacity_for(r.exp_counts);
  mask1 = mask1 * at::lt(loc1, r.capacity).to(at::kLong);
  mask2 = mask2 * at::lt(loc2, r.capacity).to(at::kLong);
  auto g1 = (gates * mask1.to(at::kFloat)).sum(1);
  auto g2 = (gates * mask2.to(at::kFloat)).sum(1);
  const auto denom = at::clamp_min(g1 + g2, std::numeric_limits<float>::epsilon());
  g1 = g1 / denom;
  g2 = g2 / denom;
  const auto kept1 = mask1.sum(1) > 0, kept2 = mask2.sum(1) > 0;
  const auto none = at::full({}, -1, lopt);
  r.expert = at::stack({idx1, idx2}, 1);
  r.slot = at::stack({at::where(kept1, (loc1 * mask1).sum(1), none), at::where(kept2, (loc2 * mask2).sum(1), none)}, 1);
  r.weight = at::stack({g1, g2}, 1);
  r.dropped = 2 * T - kept1.sum() - kept2.sum();
  return r;
}

void ExpertParallel::expect(Purpose p, double bytes, int repeat) {
  if (!comm) throw std::runtime_error("Program error: a MoE all-to-all with parallel.ep = 1");
  for (int r = 0; r < std::max(1, repeat); ++r) expected.push_back({p, bytes});
}

void ExpertParallel::check(const std::string& where) {
  if (expected.empty() && ledger.empty()) return;
  std::map<std::pair<int, long long>, int> diff;
  for (const auto& [p, b] : ledger) diff[{int(p), check_bytes ? std::llround(b) : 0}] += 1;
  for (const auto& [p, b] : expected) diff[{int(p), check_bytes ? std::llround(b) : 0}] -= 1;
  for (const auto& [k, n] : diff)
    if (n != 0)
      throw std::runtime_error("Program/engine mismatch: the engine issued " + std::to_string(std::abs(n)) + " " +
                               (n > 0 ? "more" : "fewer") + " expert-parallel all-to-alls (" +
                               to_string(Purpose(k.first)) + ", " + std::to_string(k.second) +
                               " bytes) than the Program lists (" + where + ")");
  ledger.clear();
  expected.clear();
}

at::Tensor ExpertParallel::all_to_all(const at::Tensor& x, Purpose p) {
  const auto t0 = std::chrono::steady_clock::now();
  if (timing && sync) sync();
  at::Tensor in = x.to(wire_dtype).contiguous();
  at::Tensor out = at::empty_like(in);
  ledger.push_back({p, size_bytes(in)});
  comm->all_to_all(out, in, p)->wait();
  if (timing) {
    if (sync) sync();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return out.to(x.scalar_type());
}

namespace {
// Each assignment's row in the dispatch buffer: expert x capacity + slot, dropped ones the spare
// row past the end ([T x k]).
at::Tensor dispatch_rows(const Routing& r, int64_t experts) {
  const int64_t C = r.capacity;
  return at::where(r.slot >= 0, r.expert * C + r.slot, at::full({}, experts * C, r.slot.options())).reshape({-1});
}
}  // namespace

Routing moe_gate(const at::Tensor& tokens, const at::Tensor& gate_w, const ModelSpec& m, at::Generator& gen,
                 const std::function<int64_t(int64_t)>& max_over_group) {
  at::Tensor gin = tokens.to(at::kFloat);
  if (m.noisy_gate_policy == ModelSpec::NoisyGate::jitter) {  // multiplicative_jitter, epsilon 1e-2
    auto j = at::empty_like(gin);
    j.uniform_(1.0 - 1e-2, 1.0 + 1e-2, gen);
    gin = gin * j;
  }
  return top_k_gating(at::linear(gin, gate_w.to(at::kFloat)), m, gen, max_over_group);
}

namespace {
// out[dest[i]] = tokens[i / k] into E C + 1 zero rows (the last one the dropped tokens' spare). As
// one autograd function the backward keeps the indices only: autograd's index_select + index_copy
// kept the gathered rows, top_k of them a token, for index_copy's source gradient. Backward: each
// token's gradient is the sum over its k slots' rows, the same sums index_select's backward formed.
struct DispatchFunction : torch::autograd::Function<DispatchFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& dest,
                            int64_t k, int64_t rows) {
    const int64_t T = tokens.size(0), h = tokens.size(1);
    const auto token = at::div(at::arange(T * k, dest.options()), k, "floor");
    auto out = at::zeros({rows, h}, tokens.options());
    out.index_copy_(0, dest, tokens.index_select(0, token));
    ctx->save_for_backward({dest});
    ctx->saved_data["k"] = k;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto dest = ctx->get_saved_variables()[0];
    const int64_t k = ctx->saved_data["k"].toInt(), h = grad_out[0].size(1);
    const auto rows = grad_out[0].index_select(0, dest);  // [T k, h]
    return {rows.view({-1, k, h}).sum(1), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor moe_dispatch(const at::Tensor& tokens, const Routing& r, int64_t experts) {
  const int64_t k = r.expert.size(1), C = r.capacity;
  const auto dest = dispatch_rows(r, experts);
  return DispatchFunction::apply(tokens, dest, k, experts * C + 1).narrow(0, 0, experts * C);
}

at::Tensor moe_combine(const at::Tensor& expert_out, const Routing& r) {
  const int64_t T = r.expert.size(0), k = r.expert.size(1), h = expert_out.size(1);
  const int64_t experts = expert_out.size(0) / r.capacity;
  const auto dest = dispatch_rows(r, experts);
  const auto padded = at::cat({expert_out, at::zeros({1, h}, expert_out.options())});  // the spare row: zero
  const auto w = r.weight.to(expert_out.scalar_type()).unsqueeze(2);  // [T, k, 1]
  return (padded.index_select(0, dest).view({T, k, h}) * w).sum(1);
}

at::Tensor moe_mlp_forward(MoeLayer& L, const at::Tensor& gate_w, const at::Tensor& x) {
  const ModelSpec& m = *L.model;
  const int64_t B = x.size(0), S = x.size(1), h = x.size(2), T = B * S, E = m.experts, k = m.top_k;
  const int64_t ep = L.ep->size, local = E / ep;
  if (int64_t(L.experts.size()) != local) throw std::logic_error("moe: local expert count");
  static TensorParallel no_tp;
  TensorParallel& tp = L.tp ? *L.tp : no_tp;
  auto tokens = x.reshape({T, h});
  at::Generator gen = seeded_generator(x.device(), L.seed);
  const auto max_over_group = [&](int64_t v) {
    if (L.ep->comm) {
      auto t = at::full({1}, double(v), at::TensorOptions().dtype(at::kFloat).device(x.device()));
      L.ep->comm->allreduce_max(t, Purpose::None)->wait();
      v = int64_t(std::llround(t.item<double>()));
    }
    // Non-TP experts under tensor parallelism: padded to a multiple of tp for the drop below
    // (sharded_moe.py top1gating / top2gating, drop_tokens false).
    if (tp.active()) v = (v + tp.size - 1) / tp.size * tp.size;
    return v;
  };
  Routing r = moe_gate(tokens, gate_w, m, gen, max_over_group);
  const int64_t C = r.capacity;
  if (C % tp.size != 0)  // refused at set-up (engine.cpp setup_moe); padded above without dropping
    throw std::logic_error("moe: capacity " + std::to_string(C) + " not divisible by tp " + std::to_string(tp.size));
  const int64_t Ct = C / tp.size;  // the capacity slots this TP rank dispatches
  // MOELayer.forward: drop_tokens(dispatched_input, dim=1) before the dispatch all-to-all.
  auto dispatched = drop_tokens(tp, moe_dispatch(tokens, r, E).view({E, C, h})).reshape({E * Ct, h});
  // Rank j receives experts [j local, (j + 1) local) of every rank: [source rank, local expert, Ct, h].
  auto received = exchange(*L.ep, dispatched, Purpose::MoEDispatch).view({ep, local, Ct, h});
  // One view per local expert by unbind, whose backward stacks the experts' input gradients in one
  // pass; a select per expert would build a zero-filled gradient of all of `received` for each and
  // add them up (2 local experts: 2 x 3 passes over the slot buffer, 8: 8 x 3).
  const std::vector<at::Tensor> per_expert = received.unbind(1);
  std::vector<at::Tensor> outs;
  for (int64_t e = 0; e < local; ++e) {
    const auto& p = L.experts[e];
    auto in = per_expert[e].reshape({ep * Ct, h});
    if (in.scalar_type() != p[0].scalar_type()) in = in.to(p[0].scalar_type());
    auto y = at::linear(at::gelu(at::linear(in, p[0], p[1]), "tanh"), p[2], p[3]);
    outs.push_back(y.to(x.scalar_type()).view({ep, Ct, h}));
  }
  auto expert_out = at::stack(outs, 1).reshape({E * Ct, h});
  auto back = exchange(*L.ep, expert_out, Purpose::MoECombine);  // [E, Ct, h] for this rank's tokens
  // MOELayer.forward: gather_tokens(expert_output, dim=1) after the combine all-to-all.
  auto out = moe_combine(gather_tokens(tp, back.view({E, Ct, h})).reshape({E * C, h}), r);
  L.l_aux = r.l_aux;
  L.tokens = T;
  L.assignments = T * k;
  L.dropped = r.dropped;
  L.capacity = C;
  return out.view({B, S, h});
}

uint64_t moe_layer_seed(uint64_t seed, int64_t step, uint64_t global_micro_batch, int layer) {
  uint64_t h = 0x243F6A8885A308D3ull;
  for (uint64_t p : {seed, uint64_t(step), global_micro_batch, uint64_t(layer)}) {
    h ^= p + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  return h;
}

void MoeStats::add(const MoeLayer& m) {
  tokens_ += double(m.tokens);
  assignments_ += double(m.assignments);
  dropped_ = dropped_.defined() ? dropped_ + m.dropped : m.dropped.clone();
  capacity_ = std::max(capacity_, double(m.capacity));
  aux_ = aux_.defined() ? aux_ + m.l_aux.detach() : m.l_aux.detach().clone();
  runs_ += 1;
}

std::map<std::string, double> MoeStats::over_world(Communicator& world, const torch::Device& dev) const {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  auto t = at::tensor({tokens_, assignments_, dropped_.defined() ? dropped_.item<double>() : 0.0, runs_,
                       aux_.defined() ? aux_.item<double>() : 0.0}, f64).to(dev);
  auto c = at::tensor({capacity_}, f64).to(dev);
  world.allreduce(t, Purpose::None)->wait();
  world.allreduce_max(c, Purpose::None)->wait();
  const auto v = t.to(at::kCPU);
  std::map<std::string, double> out;
  const double runs = v[3].item<double>();
  if (runs <= 0) return out;
  out["aux_loss_mean"] = v[4].item<double>() / runs;
  out["dropped_fraction"] = v[2].item<double>() / v[1].item<double>();
  out["tokens_per_layer_run"] = v[0].item<double>() / runs;
  out["capacity"] = c.to(at::kCPU).item<double>();
  return out;
}

// ---- ExpertStore ----------------------------------------------------------------------------

ExpertStore::ExpertStore(const ModelSpec& m, const std::vector<int>& moe_layers, Communicator* edp, const Options& o)
    : m_(m), o_(o), edp_(edp), local_(m.experts / std::max(1, o.ep)), layers_(moe_layers) {
  if (o.stage < 0 || o.stage > 2) throw std::invalid_argument("ExpertStore: ZeRO stage 0..2");
  const int64_t h = m.hidden, f = m.ffn_hidden > 0 ? m.ffn_hidden : 4 * int64_t(m.hidden);
  const std::vector<std::vector<int64_t>> shapes = {{f, h}, {f}, {h, f}, {h}};
  ZeroPartitionSpec spec;
  for (int l : layers_)
    for (int e = 0; e < local_; ++e)
      for (const auto& s : shapes) {
        int64_t n = 1;
        for (auto d : s) n *= d;
        spec.numel.push_back(n);
        spec.layer.push_back(l);
      }
  const int edp_size = edp_ ? edp_->size() : 1;
  spec.dp = o.stage == 0 ? 1 : edp_size;
  spec.alignment = o.stage == 0 ? 1 : 2;
  spec.reduce_bucket_size = std::max<int64_t>(1, o.reduce_bucket_size);
  spec.allgather_bucket_size = std::max<int64_t>(1, o.allgather_bucket_size);
  part_ = make_zero_partition(spec);
  at::NoGradGuard ng;
  const auto o16 = at::TensorOptions().dtype(o.dtype).device(o.device);
  const auto o32 = at::TensorOptions().dtype(at::kFloat).device(o.device);
  flat16_ = at::zeros({part_.padded_numel}, o16);
  grad16_ = at::zeros({part_.padded_numel}, o16);
  // The fp32 master (this rank's shard at stages 1-2), the moments and the accumulator first; each
  // tensor is then drawn in fp32 on its own and copied into the 16-bit copy and the master, so
  // set-up never holds more than the steady state and one tensor (a whole fp32 buffer drawn first
  // and sharded after would hold 4 bytes an expert parameter more while the moments allocate).
  const Range mine = o.stage == 0 ? Range{0, part_.padded_numel} : part_.shard(o.edp_rank);
  master_ = at::zeros({o.stage == 0 ? part_.padded_numel : part_.shard_numel}, o32);
  exp_avg_ = at::zeros_like(master_);
  exp_avg_sq_ = at::zeros_like(master_);
  grad_acc_ = at::zeros_like(master_);
  // Each expert initialised from (seed, layer, global expert): the same weights at any ep.
  const double scaled = 0.02 / std::sqrt(2.0 * m.layers);
  int64_t off = 0;
  leaves_.resize(layers_.size());
  for (size_t li = 0; li < layers_.size(); ++li) {
    for (int e = 0; e < local_; ++e) {
      const uint64_t global = uint64_t(o.ep_rank) * uint64_t(local_) + uint64_t(e);
      auto gen = seeded_generator(o.device, splitmix(o.seed ^ splitmix(uint64_t(layers_[li]) * 1000003ull + global + 0x5eed)));
      std::vector<at::Tensor> ps;
      for (size_t i = 0; i < shapes.size(); ++i) {
        int64_t n = 1;
        for (auto d : shapes[i]) n *= d;
        if (i == 0 || i == 2) {  // weights drawn in fp32; biases stay zero
          auto w = at::empty({n}, o32);
          w.normal_(0.0, i == 0 ? 0.02 : scaled, gen);
          flat16_.narrow(0, off, n).copy_(w);
          const int64_t b = std::max(off, mine.begin), end = std::min(off + n, mine.end());
          if (end > b) master_.narrow(0, b - mine.begin, end - b).copy_(w.narrow(0, b - off, end - b));
        }
        ps.push_back(flat16_.narrow(0, off, n).view(shapes[i]).detach().requires_grad_(true));
        ps.back().mutable_grad() = grad16_.narrow(0, off, n).view(shapes[i]);
        off += n;
      }
      leaves_[li].push_back(ps);
    }
  }
  reduced_.assign(part_.grad_buckets.size(), false);
}

bool ExpertStore::holds(int layer) const { return std::find(layers_.begin(), layers_.end(), layer) != layers_.end(); }

const std::vector<std::vector<at::Tensor>>& ExpertStore::leaves(int layer) const {
  const auto it = std::find(layers_.begin(), layers_.end(), layer);
  if (it == layers_.end()) throw std::logic_error("ExpertStore: layer " + std::to_string(layer) + " is not a MoE layer of this stage");
  return leaves_[size_t(it - layers_.begin())];
}

void ExpertStore::check_bucket_bytes(const Instruction& in, double bytes) const {
  const double program = in.bytes * std::max(1, in.repeat);
  if (in.bytes > 0 && std::abs(program - bytes) > 0.5)
    throw std::runtime_error("Program/engine mismatch: expert " + std::string(to_string(in.op)) + " bucket " +
                             std::to_string(in.bucket) + " is " + std::to_string(program) + " bytes in the Program, " +
                             std::to_string(bytes) + " in the engine's expert partition");
}

// Summed gradients of range r (the whole bucket, or this rank's part of it) into the accumulator,
// averaged over the whole data-parallel size.
void ExpertStore::fold(const Range& r, const at::Tensor& summed) {
  const int64_t base = o_.stage == 0 ? 0 : part_.shard(o_.edp_rank).begin;
  grad_acc_.narrow(0, r.begin - base, r.count).add_(summed, 1.0 / double(o_.dp));
}

void ExpertStore::reduce(const Instruction& in) {
  const int k = in.bucket;
  if (k < 0 || k >= int(part_.grad_buckets.size()))
    throw std::runtime_error("Program error: expert gradient bucket " + std::to_string(k) + " does not exist");
  const GradBucket& b = part_.grad_buckets[k];
  const double elt = double(at::elementSize(o_.dtype));
  check_bucket_bytes(in, double(b.range.count) * elt);
  at::NoGradGuard ng;
  at::Tensor buf = grad16_.narrow(0, b.range.begin, b.range.count);
  if (o_.stage == 0) {
    edp_->allreduce(buf, in.purpose)->wait();
    fold(b.range, buf);
  } else {
    std::vector<std::pair<int64_t, int64_t>> owners;
    for (const Range& r : b.sub_shards) owners.push_back({r.begin - b.range.begin, r.count});
    edp_->reduce_to_owners(buf, owners, in.purpose)->wait();
    const Range mine = b.sub_shards[o_.edp_rank];
    if (mine.count > 0) fold(mine, buf.narrow(0, mine.begin - b.range.begin, mine.count));
  }
  buf.zero_();
  reduced_[k] = true;
}

void ExpertStore::gather(const Instruction& in) {
  const int k = in.bucket;
  if (o_.stage == 0 || k < 0 || k >= int(part_.allgather_buckets.size()))
    throw std::runtime_error("Program error: expert all-gather bucket " + std::to_string(k));
  const auto& b = part_.allgather_buckets[k];
  const int n = edp_->size();
  check_bucket_bytes(in, double(b.count_per_rank) * n * double(at::elementSize(o_.dtype)));
  at::NoGradGuard ng;
  auto mine = flat16_.narrow(0, part_.shard(o_.edp_rank).begin + b.shard_offset, b.count_per_rank).clone();
  auto out = at::empty({b.count_per_rank * n}, mine.options());
  edp_->all_gather(out, mine, in.purpose)->wait();
  auto rows = out.view({n, b.count_per_rank});
  for (int r = 0; r < n; ++r) flat16_.narrow(0, part_.shard(r).begin + b.shard_offset, b.count_per_rank).copy_(rows[r]);
}

at::Tensor ExpertStore::step_gradient() {
  at::NoGradGuard ng;
  const int edp_size = edp_ ? edp_->size() : 1;
  if (edp_size == 1) {  // no reductions in the Program: the local gradients are the group's sum
    fold(Range{0, part_.padded_numel}, grad16_);
    grad16_.zero_();
  } else {
    for (size_t k = 0; k < reduced_.size(); ++k)
      if (!reduced_[k])
        throw std::runtime_error("Program error: expert gradient bucket " + std::to_string(k) + " left unreduced");
  }
  std::fill(reduced_.begin(), reduced_.end(), false);
  return grad_acc_;
}

double ExpertStore::counted_sum_of_squares(const at::Tensor& g) const {
  if (o_.stage == 0 && o_.edp_rank != 0) return 0.0;  // replicated over the expert-data-parallel group
  return at::norm(g).square().item<double>();
}

void ExpertStore::zero_gradient() { grad_acc_.zero_(); }

void ExpertStore::publish() {
  at::NoGradGuard ng;
  if (o_.stage == 0) flat16_.copy_(master_);
  else flat16_.narrow(0, part_.shard(o_.edp_rank).begin, part_.shard_numel).copy_(master_);
}

void ExpertStore::after_load() {
  publish();
  const int n = edp_ ? edp_->size() : 1;
  if (o_.stage >= 1 && n > 1) {
    at::NoGradGuard ng;
    auto mine = flat16_.narrow(0, part_.shard(o_.edp_rank).begin, part_.shard_numel).clone();
    edp_->all_gather(flat16_, mine, Purpose::None)->wait();
  }
}

at::Tensor ExpertStore::full_master() {
  at::NoGradGuard ng;
  const int n = edp_ ? edp_->size() : 1;
  if (o_.stage == 0 || n == 1) return master_.narrow(0, 0, part_.numel).contiguous();
  auto full = at::empty({part_.padded_numel}, master_.options());
  auto mine = master_.contiguous();
  edp_->all_gather(full, mine, Purpose::None)->wait();
  return full.narrow(0, 0, part_.numel).contiguous();
}

namespace {
double bytes_of(const at::Tensor& t) { return t.defined() ? size_bytes(t) : 0; }
}  // namespace
double ExpertStore::parameter_bytes() const { return bytes_of(flat16_); }
double ExpertStore::gradient_bytes() const { return bytes_of(grad16_) + bytes_of(grad_acc_); }
double ExpertStore::optimizer_bytes() const { return bytes_of(master_) + bytes_of(exp_avg_) + bytes_of(exp_avg_sq_); }

}  // namespace dssim::tb

// The parameter dump's assembly across ranks (param_dump.hpp).
#include "backends/torch/param_dump.hpp"

#include <fstream>
#include <map>
#include <utility>
#include "backends/torch/moe.hpp"
#include "backends/torch/pipeline.hpp"

namespace dssim::tb {

at::Tensor assemble_whole_model(const DumpWorld& w, const at::Tensor& mine) {
  constexpr int kTag = 1 << 30;
  const ParallelSpec& par = w.sc.parallel;
  if (w.coord.dp == 0 && w.rank != 0) w.world.send(mine, 0, kTag, Purpose::None)->wait();
  if (w.rank != 0) return {};
  std::map<std::pair<int, int>, std::vector<at::Tensor>> pieces;  // (unit, parameter) -> by TP rank
  for (int s = 0; s < par.pp; ++s)
    for (int t = 0; t < par.tp; ++t) {
      const int r = w.grid.rank_of(0, s, t);
      const StageLayout lay = stage_layout(w.cfg, w.program.ranks.at(r), par.pp);
      int64_t n = 0;
      for (int u : lay.units) n += unit_numel(w.cfg, u);
      at::Tensor flat = mine;
      if (r != 0) {
        flat = at::empty({n}, mine.options());
        w.world.recv(flat, r, kTag, Purpose::None)->wait();
      }
      int64_t off = 0;
      for (int u : lay.units) {
        auto views = unit_views(w.cfg, u, flat.narrow(0, off, unit_numel(w.cfg, u)));
        for (size_t i = 0; i < views.size(); ++i) {
          auto& v = pieces[{u, int(i)}];
          v.resize(par.tp);
          v[t] = views[i];
        }
        off += unit_numel(w.cfg, u);
      }
    }
  std::vector<at::Tensor> out;
  for (int u = 0; u <= w.cfg.final_unit(); ++u)
    for (int i = 0; i < int(unit_params(w.cfg, u).size()); ++i)
      out.push_back(tp_unslice(w.cfg, u, i, pieces.at({u, i})).reshape({-1}));
  return at::cat(out);
}

at::Tensor assemble_experts(const DumpWorld& w, const at::Tensor& mine, int local) {
  constexpr int kTag = (1 << 30) + 1;
  const ParallelSpec& par = w.sc.parallel;
  if (w.rank != 0) {
    if (w.coord.edp == 0) w.world.send(mine, 0, kTag, Purpose::None)->wait();
    return {};
  }
  const int64_t per = expert_numel(w.sc.model);
  std::map<std::pair<int, int>, at::Tensor> pieces;  // (layer, global expert)
  for (int s = 0; s < par.pp; ++s)
    for (int j = 0; j < par.ep; ++j) {
      const int r = w.grid.group_of(GroupKind::EP, w.grid.rank_of(0, s, 0)).at(j);
      std::vector<int> layers;
      for (int u : stage_layout(w.cfg, w.program.ranks.at(r), par.pp).units)
        if (u >= 1 && u <= w.cfg.layers && w.cfg.moe_layer(u - 1)) layers.push_back(u - 1);
      at::Tensor flat = mine;
      if (r != 0) {
        flat = at::empty({int64_t(layers.size()) * local * per}, mine.options());
        w.world.recv(flat, r, kTag, Purpose::None)->wait();
      }
      for (size_t li = 0; li < layers.size(); ++li)
        for (int e = 0; e < local; ++e)
          pieces[{layers[li], j * local + e}] = flat.narrow(0, (int64_t(li) * local + e) * per, per);
    }
  std::vector<at::Tensor> out;
  for (auto& [k, t] : pieces) out.push_back(t);
  return at::cat(out);
}

void write_fp32(const std::string& path, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(c.data_ptr()), c.numel() * 4);
}

}  // namespace dssim::tb

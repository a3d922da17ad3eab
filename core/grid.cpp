#include "core/grid.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dssim {

int expert_data_parallel_size(const ParallelSpec& p) {
  return std::max(1, std::max(1, p.tp) * std::max(1, p.dp) / std::max(1, p.ep));
}

ProcessGrid::ProcessGrid(const ParallelSpec& p) : tp_(p.tp), dp_(p.dp), pp_(p.pp), ep_(p.ep) {
  if (tp_ < 1 || dp_ < 1 || pp_ < 1 || ep_ < 1)
    throw std::invalid_argument("parallel: tp, dp, pp and ep must be >= 1");
  if (dp_ % ep_ != 0)
    throw std::invalid_argument("parallel: ep (" + std::to_string(ep_) +
                                ") must divide dp (" + std::to_string(dp_) +
                                "): expert parallelism is carved out of data parallelism");
}

RankCoord ProcessGrid::coord(int rank) const {
  RankCoord c;
  c.tp = rank % tp_;
  c.dp = (rank / tp_) % dp_;
  c.pp = rank / (tp_ * dp_);
  const int q = c.tp + tp_ * c.dp;  // place in the pipeline stage (DeepSpeed's legacy expert groups)
  c.ep = q % ep_;
  c.edp = q / ep_;
  return c;
}

int ProcessGrid::group_count(GroupKind kind) const {
  switch (kind) {
    case GroupKind::TP: return dp_ * pp_;
    case GroupKind::DP: return tp_ * pp_;
    case GroupKind::PP: return tp_ * dp_;
    case GroupKind::EP: return pp_ * expert_dp();
    case GroupKind::ExpertDP: return pp_ * ep_;
    case GroupKind::Embedding: return tp_ * dp_;
    case GroupKind::World: return 1;
    case GroupKind::DPIntra:
    case GroupKind::DPInter: return 0;  // ZeRO++ sub-groups: made by the program builder
  }
  return 0;
}

int ProcessGrid::group_index(GroupKind kind, int rank) const {
  const RankCoord c = coord(rank);
  const int dp_group = c.tp + tp_ * c.pp;  // Megatron's DP group order: stage-major, then tp
  switch (kind) {
    case GroupKind::TP: return rank / tp_;
    case GroupKind::DP: return dp_group;
    case GroupKind::PP: return rank % (tp_ * dp_);
    case GroupKind::EP: return c.pp * expert_dp() + c.edp;
    case GroupKind::ExpertDP: return c.pp * ep_ + c.ep;
    case GroupKind::Embedding:
      return (c.pp == 0 || c.pp == pp_ - 1) ? rank % (tp_ * dp_) : -1;
    case GroupKind::World: return 0;
    case GroupKind::DPIntra:
    case GroupKind::DPInter: return -1;
  }
  return -1;
}

std::vector<int> ProcessGrid::group_of(GroupKind kind, int rank) const {
  const RankCoord c = coord(rank);
  std::vector<int> g;
  switch (kind) {
    case GroupKind::TP:
      for (int t = 0; t < tp_; ++t) g.push_back(rank_of(c.dp, c.pp, t));
      break;
    case GroupKind::DP:
      for (int d = 0; d < dp_; ++d) g.push_back(rank_of(d, c.pp, c.tp));
      break;
    case GroupKind::PP:
      for (int s = 0; s < pp_; ++s) g.push_back(rank_of(c.dp, s, c.tp));
      break;
    case GroupKind::EP:  // stage ranks [edp E, (edp + 1) E)
      for (int e = 0; e < ep_; ++e) g.push_back(c.pp * tp_ * dp_ + c.edp * ep_ + e);
      break;
    case GroupKind::ExpertDP:  // stage ranks ep, ep + E, ep + 2E, ...
      for (int k = 0; k < expert_dp(); ++k) g.push_back(c.pp * tp_ * dp_ + k * ep_ + c.ep);
      break;
    case GroupKind::Embedding:
      if (pp_ == 1) {
        g.push_back(rank);
      } else if (c.pp == 0 || c.pp == pp_ - 1) {
        g.push_back(rank_of(c.dp, 0, c.tp));
        g.push_back(rank_of(c.dp, pp_ - 1, c.tp));
      }
      break;
    case GroupKind::World:
      for (int r = 0; r < world(); ++r) g.push_back(r);
      break;
    case GroupKind::DPIntra:
    case GroupKind::DPInter:
      break;
  }
  return g;
}

std::vector<std::vector<int>> ProcessGrid::groups(GroupKind kind) const {
  std::vector<std::vector<int>> all(group_count(kind));
  for (int r = 0; r < world(); ++r) {
    const int i = group_index(kind, r);
    if (i >= 0 && all[i].empty()) all[i] = group_of(kind, r);
  }
  return all;
}

}  // namespace dssim

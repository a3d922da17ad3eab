// Pipeline parallelism in the torch engine: which units of the GPT a stage owns, and the
// point-to-point messages of the schedule. The schedule itself (DeepSpeed's TrainSchedule, or
// Megatron's interleaved 1F1B) is not here: it is the order of the Program's Forward / Backward /
// Send / Recv instructions (core/schedule, core/program_builder), which the engine follows.
#pragma once
#include <map>
#include <memory>
#include <tuple>
#include <vector>
#include <torch/torch.h>
#include "backends/torch/comm.hpp"
#include "backends/torch/gpt.hpp"
#include "core/program.hpp"

namespace dssim::tb {

// The model chunks (virtual pipeline stages) of one rank, read off its Program: a chunk's layers
// are those its Forward instructions cover.
struct StageLayout {
  struct Chunk {
    int layer_begin = 0, layer_count = 0;
    bool first = false, last = false;  // holds the embedding / the final norm, LM head and loss
    int layer_end() const { return layer_begin + layer_count; }
  };
  std::vector<Chunk> chunks;  // by chunk index
  // The units this rank holds, in the order of its flat buffers (the Program's tensor order):
  // per chunk the embedding (first chunk), the blocks, the final norm and, with pp > 1, the copy of
  // the tied word embedding (last chunk).
  std::vector<int> units;
  int chunk_of_layer(int layer) const;
  bool owns(int unit) const;
};
// Throws std::runtime_error when the Program's chunks do not tile [0, layers) across the pipeline
// as a stage's contiguous ranges.
StageLayout stage_layout(const GptConfig& c, const RankProgram& rp, int pp);

// The activations (forward) and activation gradients (backward) sent between stages: a Send is
// issued at once and completes in the background (the message is kept alive until then); a Recv is
// posted where the Program puts it and waited for where its tensor is first used. Bytes are the
// Program's (checked), in the run's 16-bit (or fp32) dtype.
class PipeMessages {
 public:
  explicit PipeMessages(Communicator& world) : world_(world) {}
  void send(const Instruction& in, const at::Tensor& t);
  void post_recv(const Instruction& in, at::Tensor buffer);
  bool pending(Purpose p, int chunk, int mb) const { return recvs_.count({p, chunk, mb}) > 0; }
  // Waits for the receive of (purpose, chunk, micro-batch); the seconds waited are added to
  // `waited`. Throws when the Program never posted it.
  at::Tensor take(Purpose p, int chunk, int mb, double* waited);
  void finish_sends();  // waits for every send issued so far

 private:
  struct Pending {
    at::Tensor buffer;
    std::shared_ptr<Work> work;
  };
  Communicator& world_;
  std::map<std::tuple<Purpose, int, int>, Pending> recvs_;
  std::vector<std::shared_ptr<Work>> sends_;
};

}  // namespace dssim::tb

// Stage planning: how the model's layers are split into pipeline stages, compute segments and
// gradient buckets. It is the program builder's first step (core/program_builder.cpp emits each
// rank's instructions from it); everything here is the same for all ranks of a pipeline stage, so
// it is planned once per stage (StagePlan):
//  - chunks: the stage's virtual stages (chunk * pp + stage; one chunk without
//    parallel.interleave), each a contiguous range of layers (parallel.partition, or the layers
//    spread evenly); virtual stage 0 holds the embedding, the last one the head;
//  - ZeRO partitions: the chunks' parameter tensors in flat buffers, dense (data-parallel group)
//    and expert (expert-data-parallel group), with their shards, gradient buckets and ZeRO-3
//    per-layer gather groups (core/zero_partition.hpp);
//  - buckets: the gradient buckets in reduction order, each closed by the backward of the lowest
//    layer it holds;
//  - segments: the runs of layers one Forward / Backward instruction computes. A chunk's forward
//    is one segment; its backward is split where a bucket closes (so that bucket's reduction can
//    start); ZeRO-3 has one segment per layer. Each segment indexes a kernel list
//    (Program::op_lists), made once per kind of segment (the op-list cache: whether it holds the
//    embedding, each layer dense or MoE, whether it holds the head).
// A search (dssim plan) keeps the plans across its Programs (StagePlanCache,
// core/program_builder.hpp).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <vector>
#include "core/grid.hpp"
#include "core/model.hpp"
#include "core/pipeline_engine.hpp"
#include "core/program.hpp"
#include "core/program_builder.hpp"
#include "core/scenario.hpp"
#include "core/zero_partition.hpp"

namespace dssim {

// A contiguous run of layers computed by one Forward / Backward instruction.
struct Segment {
  int layer_begin = 0, layer_count = 0;
  bool embedding = false, head = false;
  int dense_layers = 0, moe_layers = 0;
  int ops = -1;
  OpsCost fwd, bwd, rec;
};

struct Chunk {
  int vs = 0;  // virtual stage: chunk * pp + stage
  int layer_begin = 0, layer_count = 0;
  bool first = false, last = false;  // holds the embedding / the head
  std::vector<Segment> fwd;          // forward segments (stage 3: one per layer); also the backward's
                                     // when no bucket needs an earlier start
  std::vector<Segment> bwd_split;    // backward segments split where gradient buckets close
};

// One reduction bucket, closed by the backward of `layer` (the lowest model-order layer it holds).
struct BucketRef {
  int bucket;
  bool expert;
  int chunk, layer;
};

// Per gradient bucket / stage-3 layer group of a ZeroPartition (same indices).
struct BucketFlags {
  std::vector<int64_t> sp_elems;     // [grad bucket] SP-replicated elements inside it
  std::vector<char> tied;            // [grad bucket] holds the word embedding or its tied copy
  std::vector<int64_t> s3_sp_elems;  // [stage-3 group] SP-replicated elements
};

struct StagePlan {
  int stage = 0;
  std::vector<Chunk> chunks;
  ZeroPartition dense, expert;
  BucketFlags dense_flags, expert_flags;
  bool has_expert = false;
  std::vector<BucketRef> buckets;  // reduction order
  // Stage 3: gather groups per global layer (index into dense/expert.stage3_groups, -1 none).
  std::map<int, int> s3_dense, s3_expert;
  // Stage 3: all-gather calls the engine issues for each group (core/zero3_placement.hpp).
  std::vector<int> s3_dense_calls, s3_expert_calls;
  std::vector<int> s3_dense_reduces, s3_expert_reduces;  // reduce-scatter calls per group
};

// Every stage's plan (indexed by stage), the kernel lists its segments index appended to
// prog.op_lists; or, when `cache` (BuildOptions::stage_plans, may be null) holds them for this
// scenario, its plans, with prog sharing their kernel lists. Throws std::invalid_argument when
// parallel.partition does not fit the model.
std::shared_ptr<const std::vector<StagePlan>> plan_stages(const Scenario& sc, const ProcessGrid& grid,
                                                          const PipelineEngineModel& engine, Program& prog,
                                                          StagePlanCache* cache);

}  // namespace dssim

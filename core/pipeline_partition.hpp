// Pipeline partitions: how many transformer layers each pipeline stage holds, for any layer count
// on any pp (parallel.partition_method, docs/scenario-format.md). The method is resolved once,
// when the scenario is loaded, into ParallelSpec::partition, which every consumer reads (Program
// builder, memory model, estimator, simulator, torch backend).
//
// Methods:
//   uniform     DeepSpeed's partition_uniform over the transformer layers: layers / pp each, the
//               first (layers % pp) stages one more.
//   parameters  DeepSpeed's PipelineModule default: partition_balanced over the parameter counts of
//               the layer list the PipelineModule would hold (embedding, the layers, final norm,
//               LM head; the tied embedding counted on both ends), so the first / last stage
//               give up layers for the embedding / head.
//   type:REGEX  DeepSpeed's `type:`: partition_balanced over weights 1 for the list entries whose
//               class name REGEX finds (case-insensitive), 0 for the rest ("type:transformer",
//               BLOOM's "type:transformer|embedding").
//   megatron    Megatron-LM: uniform middle stages, the first / last stage holding the rest
//               (--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers).
//
// Sources: deepspeed/runtime/pipe/module.py (_partition_layers, _count_layer_params,
// _find_layer_type) and deepspeed/runtime/utils.py (partition_uniform, partition_balanced) at
// DeepSpeed edaa722; megatron/core/transformer/transformer_block.py (get_num_layers_to_build)
// at Megatron-LM d98e8a6.
#pragma once
#include <string>
#include <vector>
#include "core/scenario.hpp"
#include "core/validate.hpp"

namespace dssim {

// DeepSpeed's partition_uniform: num_parts + 1 boundaries over num_items items; the first
// (num_items % num_parts) parts take one more. With num_items <= num_parts, part p holds item p
// (the later parts are empty).
std::vector<int> partition_uniform(int num_items, int num_parts);

// DeepSpeed's partition_balanced (the dynamic programme of DeepSpeed PR #4312): num_parts + 1
// boundaries, every part non-empty, minimising (heaviest part - lightest part); on equal cost the
// last split point tried wins, as in the Python (`if dp_cost[i, j] >= cost`). Falls back to
// partition_uniform when there are no more items than parts.
std::vector<int> partition_balanced(const std::vector<double>& weights, int num_parts);

// One entry of the layer list DeepSpeed's PipelineModule holds for dssim's model, named as
// Megatron-DeepSpeed's GPTModelPipe names them (what `type:` regexes match):
//   EmbeddingPipe, ParallelTransformerLayerPipe x layers, LayerNorm | RMSNorm (final norm),
//   EmbeddingPipe (tied head: the embedding again, counted in full) | LMHeadPipe (untied).
struct PipelineModuleLayer {
  std::string name;
  double parameters = 0;     // trainable elements the layer builds (before the TP split, which
                             // divides every matrix alike); MoE layers: this rank's ceil(E / ep) experts
  bool transformer = false;  // a transformer layer (what ParallelSpec::partition counts)
};
std::vector<PipelineModuleLayer> pipeline_module_layers(const Scenario& sc);

// Megatron-LM's split of `layers` over `pp` stages: the middle stages ceil(layers / pp) each (fewer
// when that leaves the ends under one layer each), the first and last stage what is left, the
// first taking the smaller half.
std::vector<int> megatron_partition(int layers, int pp);

// parallel.partition_method, or when it is not given: megatron with interleaving (only Megatron's
// schedule interleaves); uniform when pp divides the layers (dssim's behaviour before the key
// existed); else DeepSpeed's default, `parameters`. (A ds_config with a pipeline section, i.e.
// DeepSpeed's pipeline engine, makes the loader set `parameters`, PipelineModule's default.)
std::string default_partition_method(const Scenario& sc);

// Transformer layers per pipeline stage under `method` (one of the methods above). Throws
// ConfigError naming parallel.partition_method (and its fix) for an unknown method, a `type:` regex
// that matches no layer or does not compile, a stage left with no transformer layer, or counts the
// interleaved schedule cannot split.
std::vector<int> partition_layers(const Scenario& sc, const std::string& method, const KeyLocator& where = {});

// Fills sc.parallel.partition from sc.parallel.partition_method (or the default) when no explicit
// partition was given and the result is not uniform (then partition_method names the method used,
// the default included); an explicit parallel.partition wins.
// Whoever changes pp or the layers of a loaded Scenario clears the partition and calls this again.
void resolve_pipeline_partition(Scenario& sc, const KeyLocator& where = {});

// True when every stage holds the same number of layers (ParallelSpec::partition empty or equal).
bool uniform_partition(const Scenario& sc);
// Layers per stage as the consumers see them: ParallelSpec::partition, else layers / pp each.
std::vector<int> layers_per_stage(const Scenario& sc);

}  // namespace dssim

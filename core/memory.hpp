// Memory model: model states per ZeRO stage (Rajbhandari et al. 2020, arXiv:1910.02054),
// activations per layer (Korthikanti et al. 2022, arXiv:2205.05198), buffers and temporaries.
#pragma once
#include <string>
#include <vector>
#include "core/scenario.hpp"

namespace dssim {

// ZeRO paper section 3 / Table 1: bytes of model states per GPU for psi parameters over n data-
// parallel ranks, K bytes of optimizer state per parameter (12 for mixed-precision Adam).
// stage 0: (2+2+K) psi; 1: 4 psi + K psi/n; 2: 2 psi + (2+K) psi/n; 3: (2+2+K) psi/n.
double zero_model_state_bytes(double psi, int stage, int n, double k = 12);

// Korthikanti et al. activation bytes per layer per micro-batch of b sequences, 16-bit:
// none: s b h (34 + 5 a s / h); TP t: s b h (10 + 24/t + 5 a s/(h t));
// TP + SP: s b h (34/t + 5 a s/(h t)); selective recompute drops the 5as/h term; full recompute
// keeps only the layer input, 2 s b h (divided by t with SP).
double activation_bytes_per_layer(double s, double b, double h, double a, int t,
                                  bool sequence_parallel, Recompute r);

struct MemoryBreakdown {
  double params = 0;        // 16-bit (or fp32) compute copy of parameters resident on the GPU
  double grads = 0;         // gradients resident on the GPU
  double optimizer = 0;     // fp32 master params + Adam moments resident on the GPU
  double activations = 0;   // activations kept for backward at the peak (1F1B in-flight micro-batches)
  double comm_buffers = 0;  // ZeRO buckets, stage-3 gathered params, p2p buffers
  double temporaries = 0;   // largest transient: logits + loss, recompute working set, workspace
  double host = 0;          // host (CPU) memory when offloading, per GPU
  double total() const { return params + grads + optimizer + activations + comm_buffers + temporaries; }
};

// Peak per-GPU memory of the most loaded GPU of the scenario (pipeline stage 0 unless the
// partition says otherwise), by category.
MemoryBreakdown peak_memory(const Scenario& sc);
// Same for a given pipeline stage.
MemoryBreakdown stage_memory(const Scenario& sc, int stage);

}  // namespace dssim

#!/usr/bin/env bash
# The tests that skip on CI for want of a GPU, run on a GPU machine in one call: builds the test
# programs whose cases use CUDA (DSSIM_GPU_TESTS=ON, against the pip torch installed here, as
# gpu_bench.sh) and runs them: dssim's CUDA kernels and cuBLASLt epilogues against references
# (gemm_epilogues, layer_norm_residual, optimizer_kernels, fused_ce) and the tiny model trained on
# the GPU like on the CPU (dssim_torch_tests "[.gpu]"). Prints one line a program and the failures'
# output; exits 1 when one fails.
#
#   scripts/gpu_tests.sh [PROGRAM...]   (default: all five, e.g. dssim_layer_norm_residual_tests)
#
# Environment: OUT (default build-gpu/out; each program's output in OUT/tests_<program>.txt),
# DSSIM_DEPS (default .deps: Catch2, yaml-cpp, nlohmann-json for a machine that lacks them).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ALL=(dssim_gemm_epilogues_tests dssim_layer_norm_residual_tests dssim_optimizer_kernels_tests dssim_fused_ce_tests
     dssim_torch_tests)
PROGRAMS=("$@")
[[ ${#PROGRAMS[@]} -gt 0 ]] || PROGRAMS=("${ALL[@]}")
for p in "${PROGRAMS[@]}"; do
  [[ " ${ALL[*]} " == *" $p "* ]] || { echo "gpu_tests.sh: no GPU test program $p (one of: ${ALL[*]})" >&2; exit 2; }
done
nvidia-smi --query-gpu=name --format=csv,noheader >/dev/null 2>&1 \
  || { echo "gpu_tests.sh: nvidia-smi finds no GPU here; run it on a machine with an NVIDIA GPU" >&2; exit 2; }

export DSSIM_GPU_TESTS=ON
source "$ROOT/scripts/gpu_common.sh"
gpu_build "${PROGRAMS[@]}" dssim_torch_run

failed=0
for p in "${PROGRAMS[@]}"; do
  exe=$(find "$BUILD/tests" -name "$p" -type f -perm -u+x | head -1)
  args=()
  [[ $p == dssim_torch_tests ]] && args=("[.gpu]")
  if "$exe" "${args[@]}" > "$OUT/tests_$p.txt" 2>&1; then
    echo "PASS $p: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests_$p.txt" | tail -1)"
  else
    echo "FAIL $p"; tail -40 "$OUT/tests_$p.txt"; failed=1
  fi
  # A GPU case that skipped (no CUDA device or no kernel in the build) says so: shown, not hidden.
  # Catch wraps a warning over lines: each warning joined into one line first.
  awk -v p="$p" '/ warning:$/ {w = ""; on = 1; next}
                 on && NF == 0 {if (w ~ /is skipped/) print "  " p ":" w; on = 0; next}
                 on {sub(/^ +/, ""); w = w " " $0}' "$OUT/tests_$p.txt"
done
exit $failed

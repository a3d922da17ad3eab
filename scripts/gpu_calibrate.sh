#!/usr/bin/env bash
# Calibration on a GPU machine: builds `dssim calibrate` (the dssim_calibrate_run driver) against
# the pip torch installed there (simulator off, NCCL on), measures the GPU with
# `dssim calibrate --backend cuda --out $OUT/h200.yaml`, and prints the profile's table last.
#
#   scripts/gpu_calibrate.sh [calibrate options, e.g. --quick or --dtype bf16,fp16]
#
# Dependencies the GPU image lacks (yaml-cpp, nlohmann-json, a Boost stub) come from .deps, made on
# a Debian machine the same way scripts/gpu_bench.sh does it:
#   scripts/gpu_bench.sh --make-deps .deps      # then carry .deps to the GPU machine
# Environment: OUT (default build-gpu/out), DSSIM_DEPS (default .deps), DSSIM_GPU_BUILD (build dir,
# default /tmp/dssim-build-gpu, shared with gpu_bench.sh), PROFILE_NAME (default h200.yaml).
# Afterwards: copy $OUT/h200.yaml to profiles/h200.yaml and commit it (it records date and tool).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/build-gpu/out}
BUILD=${DSSIM_GPU_BUILD:-/tmp/dssim-build-gpu}
DEPS=${DSSIM_DEPS:-$ROOT/.deps}
NAME=${PROFILE_NAME:-h200.yaml}
mkdir -p "$OUT" "$BUILD"
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/calibrate_gpu.txt"
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
python3 -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' \
  | tee -a "$OUT/calibrate_gpu.txt"
PREFIX="$TORCH_PREFIX"
if [[ -d "$DEPS" ]]; then
  PREFIX="$PREFIX;$DEPS"
elif ! python3 - <<'EOF' 2>/dev/null
import os, sys
sys.exit(0 if os.path.exists("/usr/include/nlohmann/json.hpp") and os.path.exists("/usr/include/yaml-cpp/yaml.h") else 1)
EOF
then
  echo "gpu_calibrate.sh: yaml-cpp / nlohmann-json are missing here and $DEPS does not exist;" >&2
  echo "  make it on a Debian machine with: scripts/gpu_bench.sh --make-deps .deps (and carry .deps)" >&2
  exit 2
fi
if [[ -d "$DEPS/boost-stub" ]] && ! ls /usr/lib/*/cmake/Boost-* /usr/lib/cmake/Boost-* /usr/local/lib/cmake/Boost-* >/dev/null 2>&1; then
  PREFIX="$PREFIX;$DEPS/boost-stub"   # the calibrate driver needs no Boost; the full `dssim` would
fi
NCCL_ROOT=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)

t0=$(date +%s)
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSSIM_WITH_SIMGRID=OFF -DDSSIM_WITH_CUDA=ON \
  -DDSSIM_BUILD_TESTS=OFF -DCMAKE_PREFIX_PATH="$PREFIX" ${NCCL_ROOT:+-DNCCL_ROOT=$NCCL_ROOT} \
  -DCMAKE_CXX_COMPILER=g++ > "$OUT/calibrate_cmake.log" 2>&1 || { tail -40 "$OUT/calibrate_cmake.log"; exit 1; }
grep -E "dssim_torch" "$OUT/calibrate_cmake.log" || true
cmake --build "$BUILD" --target dssim_calibrate_run -j"$(nproc)" > "$OUT/calibrate_build.log" 2>&1 \
  || { grep -E "error|Error" "$OUT/calibrate_build.log" | head -30; tail -20 "$OUT/calibrate_build.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"

t1=$(date +%s)
"$BUILD/dssim_calibrate_run" --backend cuda --out "$OUT/$NAME" "$@" > "$OUT/calibrate.txt" \
  2> >(tee "$OUT/calibrate.stderr" >&2) || { rc=$?; cat "$OUT/calibrate.txt"; echo "dssim calibrate failed (exit $rc)"; exit $rc; }
echo "calibrated in $(( $(date +%s) - t1 )) s; profile: $OUT/$NAME ($(grep -c '^  - ' "$OUT/$NAME") rows)"
echo
cat "$OUT/calibrate.txt"

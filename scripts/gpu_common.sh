# shellcheck shell=bash
# Sourced by the scripts that build dssim on a GPU machine (gpu_bench.sh, gpu_validate.sh):
# the environment and the build, once. Expects ROOT; sets OUT, BUILD, DEPS.
#   gpu_build TARGET...   configures (simulator off, CUDA + NCCL on, pip torch's libtorch) and builds
#   (DSSIM_GPU_TESTS=ON configures the test programs too, e.g. dssim_gemm_epilogues_tests)
#   gpu_card              sets CARD (nvidia-smi's name), CLUSTER (its preset) and CARD_TAG (h100, ...)
#   gpu_scenario ...      writes the benchmarks' one-GPU GPT scenario (gpu_bench.sh, gpu_ab.sh)
OUT=${OUT:-$ROOT/build-gpu/out}
BUILD=${DSSIM_GPU_BUILD:-/tmp/dssim-build-gpu}
DEPS=${DSSIM_DEPS:-$ROOT/.deps}
mkdir -p "$OUT" "$BUILD"
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpu_build() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  local torch_prefix prefix nccl_root t0
  torch_prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  python3 -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
  prefix="$torch_prefix"
  [[ -d "$DEPS" ]] && prefix="$prefix;$DEPS"
  # The GPU image has no Boost: the stub lets the configure step pass; the drivers built here
  # (dssim_torch_run, dssim_calibrate_run) do not use it.
  if [[ -d "$DEPS/boost-stub" ]] && ! ls /usr/lib/*/cmake/Boost-* /usr/lib/cmake/Boost-* /usr/local/lib/cmake/Boost-* >/dev/null 2>&1; then
    prefix="$prefix;$DEPS/boost-stub"
  fi
  nccl_root=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
  t0=$(date +%s)
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSSIM_WITH_SIMGRID=OFF -DDSSIM_WITH_CUDA=ON \
    -DDSSIM_BUILD_TESTS=${DSSIM_GPU_TESTS:-OFF} -DCMAKE_PREFIX_PATH="$prefix" ${nccl_root:+-DNCCL_ROOT=$nccl_root} \
    -DCMAKE_CXX_COMPILER=g++ > "$OUT/cmake.log" 2>&1 || { tail -40 "$OUT/cmake.log"; return 1; }
  cmake --build "$BUILD" --target "$@" -j"$(nproc)" > "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" "$OUT/build.log" | head -30; tail -20 "$OUT/build.log"; return 1; }
  echo "built $* in $(( $(date +%s) - t0 )) s"
}

# shellcheck disable=SC2034  # CARD, CLUSTER and CARD_TAG are the caller's
gpu_card() {
  CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) || true
  [[ -n $CARD ]] || { echo "nvidia-smi finds no GPU here; run it on a machine with an NVIDIA GPU" >&2; return 1; }
  case "$CARD" in
    *H100*) CLUSTER=dgx-h100-ndr CARD_TAG=h100 ;;
    *H200*) CLUSTER=hgx-h200-ndr CARD_TAG=h200 ;;
    *A100*40GB*) CLUSTER=dgx-a100-40gb-hdr CARD_TAG=a100 ;;
    *A100*) CLUSTER=dgx-a100-hdr CARD_TAG=a100 ;;
    *) echo "no cluster preset in scenarios/clusters/ for the card '$CARD' (its peak gives the MFU column);" \
            "add one and a case in scripts/gpu_common.sh gpu_card" >&2
       return 1 ;;
  esac
}

# gpu_scenario PRESET STAGE MB GA LOSS CLUSTER [LAYERS] > FILE: the model preset (LAYERS: its width
# with that many layers) on one GPU of CLUSTER, bf16, ZeRO-STAGE, micro-batch MB, accumulation GA,
# model.cross_entropy LOSS, seed 1234.
gpu_scenario() {
  local preset=$1 stage=$2 mb=$3 ga=$4 loss=$5 cluster=$6 layers=${7:-}
  cat <<EOF
# $preset${layers:+ with $layers layers} on one GPU, bf16, ZeRO-$stage (scripts/gpu_common.sh gpu_scenario).
name: ${preset}_zero${stage}
model:
  preset: $preset${layers:+
  layers: $layers}
  cross_entropy: $loss
training:
  global_batch: $((mb * ga))
  micro_batch: $mb
  seed: 1234
parallel: {tp: 1, pp: 1, dp: 1}
zero:
  stage: $stage
precision: bf16
optimizer: {type: adamw, lr: 1e-4}
cluster:
  preset: $cluster
  nodes: 1
  gpus_per_node: 1
EOF
}

# Sourced by the scripts that build dssim on a GPU machine (gpu_bench.sh, gpu_validate.sh):
# the environment and the build, once. Expects ROOT; sets OUT, BUILD, DEPS.
#   gpu_build TARGET...   configures (simulator off, CUDA + NCCL on, pip torch's libtorch) and builds
#   (DSSIM_GPU_TESTS=ON configures the test programs too, e.g. dssim_gemm_epilogues_tests)
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

#!/usr/bin/env bash
# The torch backend on one GPU: builds dssim's backend against the pip torch installed here (the
# simulator off), trains GPT 1.3B (24 layers, h=2048, s=2048, bf16, ZeRO-1, 1 GPU) with
# `dssim run --backend cuda`, trains the same model with plain PyTorch (scripts/plain_pytorch_gpt.py)
# on the same GPU, and prints a table last: tokens/s and MFU of both.
#
#   scripts/gpu_bench.sh [--steps N] [--configs "8x4 16x2"]   (micro-batch x accumulation)
#   scripts/gpu_bench.sh --make-deps DIR   # on a Debian/Ubuntu machine with libyaml-cpp-dev and
#                                          # nlohmann-json3-dev: packs them (and a Boost stub) into
#                                          # DIR for a GPU machine that lacks them; put DIR at .deps
#
# Environment: OUT (where logs and JSON go; default build-gpu/out), DSSIM_DEPS (default .deps).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [[ "${1:-}" == "--make-deps" ]]; then
  D=${2:?--make-deps DIR}
  mkdir -p "$D/include" "$D/lib/cmake/yaml-cpp" "$D/lib/cmake/nlohmann_json" "$D/boost-stub"
  cp -r /usr/include/yaml-cpp /usr/include/nlohmann "$D/include/"
  cp /usr/lib/x86_64-linux-gnu/libyaml-cpp.a "$D/lib/"
  cat > "$D/lib/cmake/yaml-cpp/yaml-cpp-config.cmake" <<'EOF'
get_filename_component(_p "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET yaml-cpp)
  add_library(yaml-cpp STATIC IMPORTED)
  set_target_properties(yaml-cpp PROPERTIES IMPORTED_LOCATION "${_p}/lib/libyaml-cpp.a"
                        INTERFACE_INCLUDE_DIRECTORIES "${_p}/include")
endif()
set(yaml-cpp_FOUND TRUE)
EOF
  cat > "$D/lib/cmake/nlohmann_json/nlohmann_jsonConfig.cmake" <<'EOF'
get_filename_component(_p "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET nlohmann_json::nlohmann_json)
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
  set_target_properties(nlohmann_json::nlohmann_json PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_p}/include")
endif()
set(nlohmann_json_FOUND TRUE)
EOF
  # The CLI's other verbs need Boost.ProgramOptions; dssim_torch_run does not. Used only when the
  # GPU machine has no Boost: the full `dssim` target then does not build, dssim_torch_run does.
  cat > "$D/boost-stub/BoostConfig.cmake" <<'EOF'
if(NOT TARGET Boost::program_options)
  add_library(Boost::program_options INTERFACE IMPORTED)
endif()
set(Boost_FOUND TRUE)
set(Boost_program_options_FOUND TRUE)
set(Boost_VERSION 1.74.0)
EOF
  echo "packed into $D"
  exit 0
fi

STEPS=10 CONFIGS="8x4"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --configs) CONFIGS=$2; shift 2 ;;   # "MBxGA ...": micro-batch x accumulation, first is the headline
    *) echo "gpu_bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
source "$ROOT/scripts/gpu_common.sh"
rm -f "$OUT/summary.txt"
gpu_build dssim_torch_run

# Smoke runs of the tiny model on the GPU: the code paths the 1.3B ZeRO-1 run does not take
# (ZeRO-3 storage release / refill, fp16 with the loss scaler, offload with pinned host memory).
TINY="$ROOT/scenarios/tiny/tiny_dp2.yaml"
for extra in "--set zero.stage=0 --set precision.dtype=fp32" \
             "--set zero.stage=3 --set precision.dtype=bf16" \
             "--set zero.stage=2 --set precision.dtype=fp16 --set precision.loss_scale.initial_scale_power=8" \
             "--set zero.stage=2 --set precision.dtype=bf16 --set zero.offload_optimizer=true" \
             "--set zero.stage=3 --set precision.dtype=bf16 --set zero.offload_optimizer=true --set zero.offload_param=true"; do
  # shellcheck disable=SC2086
  if "$BUILD/dssim_torch_run" "$TINY" --backend cuda --nproc 1 --steps 6 --quiet --json $extra > "$OUT/tiny.json" 2> "$OUT/tiny.err"; then
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("tiny cuda ok:", sys.argv[2], "losses", [round(x, 4) for x in d["losses"]])' "$OUT/tiny.json" "$extra"
  else
    echo "tiny cuda FAILED: $extra"; tail -5 "$OUT/tiny.err"
  fi
done

for CFG in $CONFIGS; do
MB=${CFG%x*} GA=${CFG#*x}
TAG="mb${MB}_ga${GA}"
cat > "$BUILD/gpt13b_h200_zero1_$TAG.yaml" <<EOF
# GPT 1.3B on one H200, bf16, ZeRO-1 (scripts/gpu_bench.sh).
name: gpt13b_h200_zero1
model:
  preset: gpt-1.3b
training:
  global_batch: $((MB * GA))
  micro_batch: $MB
  seed: 1234
parallel: {tp: 1, pp: 1, dp: 1}
zero:
  stage: 1
precision: bf16
optimizer: {type: adamw, lr: 1e-4}
cluster:
  preset: hgx-h200-ndr
  nodes: 1
  gpus_per_node: 1
EOF

echo "== dssim run (torch backend, C++)"
"$BUILD/dssim_torch_run" "$BUILD/gpt13b_h200_zero1_$TAG.yaml" --backend cuda --nproc 1 --steps $((STEPS + 2)) --warmup 2 \
  --json > "$OUT/dssim_$TAG.json" 2> >(tee "$OUT/dssim_$TAG.stderr" >&2) || { echo "dssim run failed"; exit 1; }
python3 - "$OUT/dssim_$TAG.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
m = d["extras"]["measured"]
print("time per instruction kind (s/iteration):", {k: round(v, 4) for k, v in m["seconds_per_iteration_by_instruction"].items()})
print("memory (GiB):", {k: round(v / 2**30, 2) for k, v in m["memory_bytes"].items()})
print("bytes per collective:", m["bytes_per_iteration"], "Program:", m["expected_bytes_per_iteration"])
print("throughput:", d["throughput"])
EOF

echo "== plain PyTorch (Python)"
PYTHONUNBUFFERED=1 python3 "$ROOT/scripts/plain_pytorch_gpt.py" --micro-batch $MB --grad-accum $GA --steps $STEPS --warmup 2 \
  | tee "$OUT/plain_$TAG.txt"

python3 - "$OUT/dssim_$TAG.json" "$OUT/plain_$TAG.txt" >> "$OUT/summary.txt" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
t = d["throughput"]
plain = json.loads([l for l in open(sys.argv[2]) if l.startswith("PLAIN_JSON ")][-1][len("PLAIN_JSON "):])
c = d["config"]
print("%-7s %-34s %10.0f %8.3f %6.1f%%" % ("%dx%d" % (c["micro_batch"], c["grad_accum"]), "dssim run --backend cuda (ZeRO-1)",
      t["tokens_per_second"], t["iteration_seconds"], 100 * t["mfu"]))
print("%-7s %-34s %10.0f %8.3f %6.1f%%   dssim/plain %.3f" % ("", "plain PyTorch (autocast, fused)", plain["tokens_per_second"],
      plain["iteration_seconds"], 100 * plain["mfu"], t["tokens_per_second"] / plain["tokens_per_second"]))
EOF
done

echo
echo "GPT 1.3B (24 x 2048, 16 heads, s 2048, V 51200), bf16, 1 GPU ($(sed -n 2p "$OUT/gpu.txt" | cut -d, -f1)); MFU against 989.5 TFLOP/s"
printf "%-7s %-34s %10s %8s %7s\n" "mb x ga" "" "tokens/s" "iter s" "MFU"
cat "$OUT/summary.txt"

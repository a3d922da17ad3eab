#!/usr/bin/env bash
# The torch backend on one GPU: builds dssim's backend against the pip torch installed here (the
# simulator off), trains GPT 1.3B (24 layers, h=2048, s=2048, bf16, ZeRO-1, 1 GPU) with
# `dssim run --backend cuda`, trains the same model with plain PyTorch (scripts/plain_pytorch_gpt.py)
# on the same GPU, and prints a table last: tokens/s and MFU of both.
#
#   scripts/gpu_bench.sh [--steps N] [--configs "8x4 16x2"]   (micro-batch x accumulation)
#                        [--losses "unfused fused_linear"]   (model.cross_entropy of each dssim run)
#                        [--model 1.3b|7b]   (7b: GPT 7B, 32 x 4096, ZeRO-3, no offload; default 1.3b, ZeRO-1)
#                        [--layers N]   (the model's width with N layers, both sides: 7B's width at 16
#                                        layers fits an 80 GB card, where the 32-layer model does not)
#                        [--plain "eager compile"]   (the plain PyTorch runs)
#                        [--no-tiny]   (skip the tiny model's smoke runs)
#   scripts/gpu_bench.sh --make-deps DIR   # on a Debian/Ubuntu machine with libyaml-cpp-dev and
#                                          # nlohmann-json3-dev (and catch2 for the GPU tests):
#                                          # packs them (and a Boost stub) into
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
  # Catch2 (header-only, v2) for the GPU test programs (DSSIM_GPU_TESTS=ON), where installed here.
  # Its CMake targets name the static Catch2WithMain library beside them (dssim links its own main).
  if [[ -f /usr/include/catch2/catch.hpp && -d /usr/lib/cmake/Catch2 ]]; then
    cp -r /usr/include/catch2 "$D/include/"
    cp -r /usr/lib/cmake/Catch2 "$D/lib/cmake/"
    [[ -f /usr/lib/libCatch2WithMain.a ]] && cp /usr/lib/libCatch2WithMain.a "$D/lib/"
  fi
  echo "packed into $D"
  exit 0
fi

STEPS=10 CONFIGS="8x4" LOSSES="unfused fused_linear" MODEL=1.3b PLAINS="eager compile" TINY_RUNS=1 LAYERS=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --losses) LOSSES=$2; shift 2 ;;     # model.cross_entropy of each dssim run
    --configs) CONFIGS=$2; shift 2 ;;   # "MBxGA ...": micro-batch x accumulation, first is the headline
    --model) MODEL=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2
              [[ $LAYERS =~ ^[1-9][0-9]*$ ]] || { echo "gpu_bench.sh: --layers takes a positive layer count, not $LAYERS" >&2; exit 2; } ;;
    --plain) PLAINS=$2; shift 2
             for m in $PLAINS; do [[ $m == eager || $m == compile ]] || { echo "gpu_bench.sh: --plain takes eager and / or compile, not $m" >&2; exit 2; }; done ;;
    --no-tiny) TINY_RUNS=0; shift ;;
    *) echo "gpu_bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$MODEL" in
  # The same model on both sides: dssim's preset and plain_pytorch_gpt.py's dimensions.
  1.3b) PRESET=gpt-1.3b STAGE=1 DIMS="--layers 24 --hidden 2048 --heads 16"
        SHAPE="GPT 1.3B (24 x 2048, 16 heads, s 2048, V 51200)" ;;
  7b)   PRESET=gpt-7b STAGE=3 DIMS="--layers 32 --hidden 4096 --heads 32"
        SHAPE="GPT 7B (32 x 4096, 32 heads, s 2048, V 51200)" ;;
  *) echo "gpu_bench.sh: --model takes 1.3b or 7b, not $MODEL" >&2; exit 2 ;;
esac
if [[ -n $LAYERS ]]; then
  DIMS="--layers $LAYERS ${DIMS#--layers * }"
  SHAPE="$SHAPE with $LAYERS layers"
fi
source "$ROOT/scripts/gpu_common.sh"
# The scenario names the card it runs on (its preset's GPU gives the MFU's peak).
gpu_card || { echo "gpu_bench.sh: stopped" >&2; exit 2; }
rm -f "$OUT/summary.txt"
gpu_build dssim_torch_run

# Smoke runs of the tiny model on the GPU: the code paths the 1.3B ZeRO-1 run does not take
# (ZeRO-3 storage release / refill, fp16 with the loss scaler, offload with pinned host memory).
TINY="$ROOT/scenarios/tiny/tiny_dp2.yaml"
for extra in "--set zero.stage=0 --set precision.dtype=fp32" \
             "--set zero.stage=3 --set precision.dtype=bf16" \
             "--set zero.stage=2 --set precision.dtype=fp16 --set precision.loss_scale.initial_scale_power=8" \
             "--set zero.stage=2 --set precision.dtype=bf16 --set zero.offload_optimizer=true" \
             "--set zero.stage=3 --set precision.dtype=bf16 --set zero.offload_optimizer=true --set zero.offload_param=true" \
             "--set zero.stage=1 --set precision.dtype=bf16 --set model.cross_entropy=fused_linear" \
             "--set zero.stage=2 --set precision.dtype=fp16 --set precision.loss_scale.initial_scale_power=8 --set model.cross_entropy=fused_linear" \
             "--set zero.stage=3 --set precision.dtype=fp32 --set model.cross_entropy=fused_linear"; do
  [[ $TINY_RUNS == 1 ]] || break
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
for LOSS in $LOSSES; do
SCEN="$BUILD/${PRESET}_${CARD_TAG}_zero${STAGE}_${TAG}_$LOSS.yaml"
gpu_scenario "$PRESET" "$STAGE" "$MB" "$GA" "$LOSS" "$CLUSTER" "$LAYERS" > "$SCEN"

RUN="${TAG}_${LOSS}"
echo "== dssim run (torch backend, C++), model.cross_entropy: $LOSS"
"$BUILD/dssim_torch_run" "$SCEN" --backend cuda --nproc 1 --steps $((STEPS + 2)) --warmup 2 \
  --json > "$OUT/dssim_$RUN.json" 2> >(tee "$OUT/dssim_$RUN.stderr" >&2) || { echo "dssim run failed"; exit 1; }
python3 - "$OUT/dssim_$RUN.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
m = d["extras"]["measured"]
print("time per instruction kind (s/iteration):", {k: round(v, 4) for k, v in m["seconds_per_iteration_by_instruction"].items()})
print("memory (GiB):", {k: round(v / 2**30, 2) for k, v in m["memory_bytes"].items()})
print("bytes per collective:", m["bytes_per_iteration"], "Program:", m["expected_bytes_per_iteration"])
print("losses:", [round(x, 4) for x in d.get("losses", [])])
print("throughput:", d["throughput"])
EOF
done

for MODE in $PLAINS; do
  echo "== plain PyTorch ($MODE)"
  FLAG=""; [[ $MODE == compile ]] && FLAG="--compile"
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 "$ROOT/scripts/plain_pytorch_gpt.py" $DIMS --micro-batch $MB --grad-accum $GA --steps $STEPS --warmup 2 $FLAG \
    | tee "$OUT/plain_${MODE}_$TAG.txt" || echo "plain PyTorch ($MODE) failed"
done

STAGE=$STAGE TAG=$TAG PLAINS=$PLAINS python3 - "$OUT" >> "$OUT/summary.txt" <<'EOF'
import glob, json, os, sys
out, tag = sys.argv[1], os.environ["TAG"]
plain = {}
for mode in os.environ["PLAINS"].split():
    label = "plain PyTorch " + ("torch.compile" if mode == "compile" else "eager (autocast)")
    try:
        path = os.path.join(out, "plain_%s_%s.txt" % (mode, tag))
        plain[label] = json.loads([l for l in open(path) if l.startswith("PLAIN_JSON ")][-1][len("PLAIN_JSON "):])
    except (OSError, IndexError):
        plain[label] = None
compiled = plain.get("plain PyTorch torch.compile")
first = True
for path in sorted(glob.glob(os.path.join(out, "dssim_%s_*.json" % tag))):
    d = json.load(open(path))
    t, c = d["throughput"], d["config"]
    loss = "fused_linear" if path.endswith("_fused_linear.json") else "unfused"
    peak = d["extras"]["measured"]["memory_bytes"]["peak"] / 2**30
    ratio = "   / compile %.3f" % (t["tokens_per_second"] / compiled["tokens_per_second"]) if compiled else ""
    print("%-7s %-34s %10.0f %8.3f %6.1f%% %8.2f%s" % ("%dx%d" % (c["micro_batch"], c["grad_accum"]) if first else "",
          "dssim ZeRO-%s, loss %s" % (os.environ["STAGE"], loss), t["tokens_per_second"],
          t["iteration_seconds"], 100 * t["mfu"], peak, ratio))
    first = False
for label, p in plain.items():
    if p is None:
        print("%-7s %-34s failed" % ("", label)); continue
    print("%-7s %-34s %10.0f %8.3f %6.1f%% %8.2f" % ("", label, p["tokens_per_second"], p["iteration_seconds"],
          100 * p["mfu"], p["peak_memory_bytes"] / 2**30))
EOF
done

echo
echo "$SHAPE, bf16, 1 GPU ($(sed -n 2p "$OUT/gpu.txt" | cut -d, -f1)); MFU against 989.5 TFLOP/s"
printf "%-7s %-34s %10s %8s %7s %8s\n" "mb x ga" "" "tokens/s" "iter s" "MFU" "peak GiB"
cat "$OUT/summary.txt"

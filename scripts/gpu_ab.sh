#!/usr/bin/env bash
# An A/B of one of the torch engine's environment switches on one GPU, the runs alternated (A, B,
# A, B, ...) so a drift of the card's clocks or temperature falls on both sides. Builds dssim's
# backend against the pip torch installed here (as gpu_bench.sh), trains the GPT model with
# `dssim run --backend cuda` once per value and round, and prints a table last: each run's tokens/s,
# iteration, forward / backward / optimizer-step seconds and peak memory, each value's mean, and
# the other values' difference from the first.
#
#   scripts/gpu_ab.sh VAR=A,B[,C...] [--configs "8x1 8x4"]   (micro-batch x accumulation)
#                     [--model 1.3b|7b] [--layers N] [--loss unfused|fused_linear]
#                     [--rounds N] [--steps N] [--trace]
#   e.g. scripts/gpu_ab.sh DSSIM_WGRAD=in_place,bgradb --configs "8x1 8x4"
#        scripts/gpu_ab.sh DSSIM_NORM_RESIDUAL=fused,separate --trace
#
# --trace: a kineto trace of one more step of each value (DSSIM_KERNEL_TRACE) at the first config,
# summarised kernel by kernel by bench/kernel_trace_summary.py into $OUT/kernels_<value>.txt.
# Environment: OUT (default build-gpu/out), DSSIM_DEPS (default .deps), as gpu_bench.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

SWITCH="" CONFIGS="8x1" MODEL=1.3b LAYERS="" LOSS=fused_linear ROUNDS=2 STEPS=8 TRACE=0
usage() { sed -n 9,12p "$0" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --configs) CONFIGS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2
              [[ $LAYERS =~ ^[1-9][0-9]*$ ]] || { echo "gpu_ab.sh: --layers takes a positive layer count, not $LAYERS" >&2; exit 2; } ;;
    --loss) LOSS=$2; shift 2
            [[ $LOSS == unfused || $LOSS == fused_linear ]] || { echo "gpu_ab.sh: --loss takes unfused or fused_linear, not $LOSS" >&2; exit 2; } ;;
    --rounds) ROUNDS=$2; shift 2
              [[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "gpu_ab.sh: --rounds takes a positive count, not $ROUNDS" >&2; exit 2; } ;;
    --steps) STEPS=$2; shift 2
             [[ $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "gpu_ab.sh: --steps takes a positive count, not $STEPS" >&2; exit 2; } ;;
    --trace) TRACE=1; shift ;;
    -h|--help) usage ;;
    -*) echo "gpu_ab.sh: unknown option $1" >&2; usage ;;
    *) [[ -z $SWITCH ]] || { echo "gpu_ab.sh: one switch per call (got $SWITCH and $1)" >&2; exit 2; }
       SWITCH=$1; shift ;;
  esac
done
[[ $SWITCH =~ ^[A-Za-z_][A-Za-z0-9_]*=[^,]+(,[^,]+)+$ ]] \
  || { echo "gpu_ab.sh: the switch is VAR=A,B[,...] (an environment variable and two values or more), got '${SWITCH}'" >&2; exit 2; }
VAR=${SWITCH%%=*}
IFS=, read -ra VALUES <<< "${SWITCH#*=}"
for cfg in $CONFIGS; do
  [[ $cfg =~ ^[1-9][0-9]*x[1-9][0-9]*$ ]] || { echo "gpu_ab.sh: --configs takes MBxGA (e.g. 8x4), not $cfg" >&2; exit 2; }
done
case "$MODEL" in
  1.3b) PRESET=gpt-1.3b STAGE=1 ;;
  7b)   PRESET=gpt-7b STAGE=3 ;;
  *) echo "gpu_ab.sh: --model takes 1.3b or 7b, not $MODEL" >&2; exit 2 ;;
esac

source "$ROOT/scripts/gpu_common.sh"
gpu_card || { echo "gpu_ab.sh: stopped" >&2; exit 2; }
gpu_build dssim_torch_run
rm -f "$OUT"/ab_*.json "$OUT/ab_summary.txt"

# One run: config, value, round (or "trace"); its JSON in $OUT.
run_one() {
  local cfg=$1 value=$2 round=$3 scen="$BUILD/ab_$1.yaml" tag="ab_${1}_${2}_${3}"
  local -a env=("$VAR=$value")
  [[ $round == trace ]] && env+=("DSSIM_KERNEL_TRACE=$OUT/trace_$value.json")
  echo "== $VAR=$value, $cfg, round $round"
  env "${env[@]}" "$BUILD/dssim_torch_run" "$scen" --backend cuda --nproc 1 --steps $((STEPS + 2)) --warmup 2 --quiet \
    --json > "$OUT/$tag.json" 2> "$OUT/$tag.stderr" || { echo "run failed:"; tail -5 "$OUT/$tag.stderr"; rm -f "$OUT/$tag.json"; }
}
for cfg in $CONFIGS; do
  gpu_scenario "$PRESET" "$STAGE" "${cfg%x*}" "${cfg#*x}" "$LOSS" "$CLUSTER" "$LAYERS" > "$BUILD/ab_$cfg.yaml"
  for ((r = 1; r <= ROUNDS; r++)); do
    for v in "${VALUES[@]}"; do run_one "$cfg" "$v" "$r"; done
  done
done
if [[ $TRACE == 1 ]]; then
  first=${CONFIGS%% *}
  for v in "${VALUES[@]}"; do
    run_one "$first" "$v" trace
    [[ -f "$OUT/trace_$v.json" ]] && python3 "$ROOT/bench/kernel_trace_summary.py" "$OUT/trace_$v.json" --top 40 \
      > "$OUT/kernels_$v.txt" 2>&1 && rm -f "$OUT/ab_${first}_${v}_trace.json"
  done
fi

VAR=$VAR VALUES="${VALUES[*]}" CONFIGS=$CONFIGS CARD=$CARD python3 - "$OUT" > "$OUT/ab_summary.txt" <<'EOF'
import glob, json, os, sys
out, var, values = sys.argv[1], os.environ["VAR"], os.environ["VALUES"].split()
print("%s A/B on one %s, runs alternated; seconds a step" % (var, os.environ["CARD"]))
print("%-6s %-14s %5s %10s %9s %9s %9s %8s %9s" % ("config", var[:14], "round", "tokens/s", "iter s", "forward", "backward",
                                                   "step", "peak GiB"))
for cfg in os.environ["CONFIGS"].split():
    means = {}
    for v in values:
        rows = []
        for path in sorted(glob.glob(os.path.join(out, "ab_%s_%s_[0-9]*.json" % (cfg, v)))):
            d = json.load(open(path))
            t, m = d["throughput"], d["extras"]["measured"]
            by = m["seconds_per_iteration_by_instruction"]
            rows.append(t["tokens_per_second"])
            print("%-6s %-14s %5s %10.0f %9.4f %9.4f %9.4f %8.4f %9.2f" % (
                cfg, v[:14], path.rsplit("_", 1)[1][:-5], t["tokens_per_second"], t["iteration_seconds"],
                by.get("forward", 0), by.get("backward", 0), by.get("optimizer_step", 0),
                m["memory_bytes"]["peak"] / 2**30))
        if rows:
            means[v] = sum(rows) / len(rows)
    base = means.get(values[0])
    for v, mean in means.items():
        diff = "" if v == values[0] or not base else "  %+.2f %% against %s" % (100 * (mean / base - 1), values[0])
        print("%-6s %-14s %5s %10.0f%s" % (cfg, v[:14], "mean", mean, diff))
EOF
echo
cat "$OUT/ab_summary.txt"

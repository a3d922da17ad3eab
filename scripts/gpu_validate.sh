#!/usr/bin/env bash
# Issue 4 on a GPU machine, in one call: builds the trainer and the calibrator against the pip torch
# there (simulator off), measures the GPU into a device profile (`dssim calibrate`: h200.yaml on an
# H200, h100.yaml on an H100), trains that card's scenarios of validation/measured/scenarios/
# (h200_*, h100_*) with `dssim run --backend cuda --json`, and prints a table last. Back on the
# development machine, scripts/import_measurements.sh turns $OUT into profiles/<card>.yaml and the
# measurement records validation/measured/*.json.
#
#   scripts/gpu_validate.sh [--steps N] [--only NAME[,NAME...]] [--skip-calibrate | --calibrate-only] [-- calibrate options]
#
# Dependencies the GPU image lacks come from .deps (scripts/gpu_bench.sh --make-deps .deps).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STEPS=8 ONLY="" CALIBRATE=1 MEASURE=1 CAL_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --skip-calibrate) CALIBRATE=0; shift ;;
    --calibrate-only) MEASURE=0; shift ;;
    --) shift; CAL_ARGS=("$@"); break ;;
    *) echo "gpu_validate.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
source "$ROOT/scripts/gpu_common.sh"
gpu_build dssim_torch_run dssim_calibrate_run
# The card decides the profile's name and which scenarios are its own (h200_*, h100_*).
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$CARD" in
  *H200*) PREFIX=h200 ;;
  *H100*) PREFIX=h100 ;;
  *) PREFIX=gpu ;;
esac
PROFILE_NAME=${PROFILE_NAME:-$PREFIX.yaml}
# The host the offloaded scenario's optimizer runs on: CPU, NUMA nodes, transparent huge pages.
{ lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA)" || true
  echo "THP enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null), defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null)"
  free -g | head -2; } >> "$OUT/gpu.txt"


# The device returns at most 8 files from $OUT: one JSON per scenario, the profile, and one log
# (the build's logs, every stderr and the calibration's output, in order).
LOG="$OUT/log.txt"
: > "$LOG"
for f in gpu.txt cmake.log build.log; do
  [[ -f "$OUT/$f" ]] && { echo "== $f"; cat "$OUT/$f"; } >> "$LOG" && rm -f "$OUT/$f"
done
# The calibration first: a hung or killed scenario must not cost the profile.
if [[ $CALIBRATE == 1 ]]; then
  t1=$(date +%s)
  echo "== dssim calibrate" >> "$LOG"
  "$BUILD/dssim_calibrate_run" --backend cuda --out "$OUT/$PROFILE_NAME" "${CAL_ARGS[@]}" \
      > "$OUT/calibrate.txt" 2> "$OUT/stderr.tmp" \
    || { echo "dssim calibrate failed"; tail -20 "$OUT/stderr.tmp"; }
  echo "calibrated in $(( $(date +%s) - t1 )) s"
  cat "$OUT/stderr.tmp" >> "$LOG"; rm -f "$OUT/stderr.tmp"
fi

for f in "$ROOT"/validation/measured/scenarios/*.yaml; do
  [[ $MEASURE == 1 ]] || break
  name=$(basename "$f" .yaml)
  [[ "$name" == "$PREFIX"_* ]] || continue  # another card's scenario
  if [[ -n "$ONLY" ]]; then  # comma-separated name fragments
    keep=0; IFS=, read -ra parts <<< "$ONLY"
    for part in "${parts[@]}"; do [[ "$name" == *"$part"* ]] && keep=1; done
    [[ $keep == 1 ]] || continue
  fi
  steps=$STEPS warm=2
  # A step of the offloaded 7B scenario runs AdamW over 6.7 B parameters on the host: fewer steps
  # (about 4 s each; its steps vary by +-4 % on the host, so the median of 4).
  [[ "$name" == *offload* ]] && steps=$(( STEPS < 6 ? STEPS : 6 )) warm=2
  t1=$(date +%s)
  echo "== $name (--steps $steps --warmup $warm)" >> "$LOG"
  # A limit per scenario (seconds): the offloaded 7B one initialises 6.7 B parameters on the host.
  if timeout "${SCENARIO_TIMEOUT:-300}" "$BUILD/dssim_torch_run" "$f" --backend cuda --nproc 1 --steps "$steps" --warmup "$warm" --json \
       > "$OUT/$name.json" 2> "$OUT/stderr.tmp"; then
    echo "$name: measured in $(( $(date +%s) - t1 )) s"
  else
    echo "$name: FAILED ($(tail -1 "$OUT/stderr.tmp"))"; rm -f "$OUT/$name.json"
  fi
  cat "$OUT/stderr.tmp" >> "$LOG"; rm -f "$OUT/stderr.tmp"
done


echo
if [[ -f "$OUT/calibrate.txt" ]]; then
  tail -25 "$OUT/calibrate.txt"; { echo "== calibrate summary"; cat "$OUT/calibrate.txt"; } >> "$LOG"; rm -f "$OUT/calibrate.txt"
fi
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("%-28s %10s %10s %7s %9s %9s" % ("scenario", "iter (s)", "tokens/s", "MFU", "peak GiB", "host GiB"))
for f in sorted(glob.glob(os.path.join(sys.argv[1], "h[0-9]*_*.json"))):
    d = json.load(open(f)); t = d["throughput"]; m = d["extras"]["measured"]["memory_bytes"]
    print("%-28s %10.3f %10.0f %6.1f%% %9.2f %9.2f" % (os.path.basename(f)[:-5], t["iteration_seconds"],
          t["tokens_per_second"], 100 * t["mfu"], m.get("peak", 0) / 2**30, m.get("host_peak", 0) / 2**30))
PY

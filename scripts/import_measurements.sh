#!/usr/bin/env bash
# After scripts/gpu_validate.sh ran on a GPU machine: DIR holds its $OUT (a device profile such as
# h200.yaml or h100.yaml, and one `dssim run --json` per scenario of validation/measured/scenarios).
# Installs each profile under profiles/ and writes one measurement record per scenario measured
# into validation/measured/ (scenarios without a run in DIR are left alone).
#   scripts/import_measurements.sh DIR [GPU-NAME]   (GPU-NAME: default the run's own, else the scenario's)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:?usage: import_measurements.sh DIR [GPU-NAME]}
GPU=${2:-}
DSSIM=${DSSIM:-$ROOT/build/dssim}
mkdir -p "$ROOT/profiles"
for p in "$DIR"/*.yaml; do
  [[ -f "$p" ]] && cp "$p" "$ROOT/profiles/$(basename "$p")" && echo "profile: profiles/$(basename "$p")"
done
for f in "$ROOT"/validation/measured/scenarios/*.yaml; do
  name=$(basename "$f" .yaml)
  [[ -f "$DIR/$name.json" ]] || continue
  "$DSSIM" compare "$f" --run-json "$DIR/$name.json" ${GPU:+--gpu-name "$GPU"} --record "$ROOT/validation/measured/$name.json"
done

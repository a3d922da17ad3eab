#!/usr/bin/env bash
# After scripts/gpu_validate.sh ran on a GPU machine: DIR holds its $OUT (h200.yaml and one
# `dssim run --json` per scenario of validation/measured/scenarios). Installs the profile as
# profiles/h200.yaml and writes one measurement record per scenario into validation/measured/.
#   scripts/import_measurements.sh DIR [GPU-NAME]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:?usage: import_measurements.sh DIR [GPU-NAME]}
GPU=${2:-NVIDIA H200}
DSSIM=${DSSIM:-$ROOT/build/dssim}
if [[ -f "$DIR/h200.yaml" ]]; then mkdir -p "$ROOT/profiles"; cp "$DIR/h200.yaml" "$ROOT/profiles/h200.yaml"; fi
for f in "$ROOT"/validation/measured/scenarios/*.yaml; do
  name=$(basename "$f" .yaml)
  [[ -f "$DIR/$name.json" ]] || { echo "no measurement of $name in $DIR"; continue; }
  "$DSSIM" compare "$f" --run-json "$DIR/$name.json" --gpu-name "$GPU" --record "$ROOT/validation/measured/$name.json"
done

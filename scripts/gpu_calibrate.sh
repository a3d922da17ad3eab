#!/usr/bin/env bash
# Calibration alone on a GPU machine: builds the calibrator against the pip torch there and runs
# `dssim calibrate --backend cuda --out $OUT/h200.yaml` (arguments go to dssim calibrate, e.g.
# --quick). The build and set-up are scripts/gpu_validate.sh's; copy $OUT/h200.yaml to
# profiles/h200.yaml afterwards (scripts/import_measurements.sh does).
exec "$(dirname "$0")/gpu_validate.sh" --calibrate-only -- "$@"

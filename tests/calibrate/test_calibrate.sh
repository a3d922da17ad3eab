#!/usr/bin/env bash
# test_calibrate.sh DSSIM CHECK_PROFILE CASE (run from the repo root).
set -u
DSSIM=$1 CHECK=$2 CASE=$3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL [$CASE]: $*"; echo "--- stdout"; cat "$TMP/out" 2>/dev/null; echo "--- stderr"; cat "$TMP/err" 2>/dev/null; exit 1; }
run() { "$@" >"$TMP/out" 2>"$TMP/err"; echo $? >"$TMP/rc"; }
expect_rc() { [ "$(cat "$TMP/rc")" = "$1" ] || fail "exit code $(cat "$TMP/rc"), expected $1"; }
expect_err() { grep -qiE -- "$1" "$TMP/err" || fail "stderr lacks /$1/"; }
iteration_seconds() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["throughput"]["iteration_seconds"])' "$1"; }

case "$CASE" in
  quick_cpu_profile_used)
    cd "$TMP"
    run "$DSSIM" calibrate --backend cpu --quick --out tmp.yaml
    expect_rc 0
    [ -f tmp.yaml ] || fail "no tmp.yaml"
    ls | grep -q '\.tmp\.' && fail "temporary file left behind"
    grep -q "wrote tmp.yaml" out || fail "no 'wrote' line"
    grep -qE "^gemm fp32 +[0-9]+" out || fail "summary lacks the gemm row"
    for row in "gemm dgrad fp32" "gemm wgrad fp32" "optimizer_step bf16" "host_adamw fp32" \
               "layer_norm_backward fp32" "gelu_backward fp32" "bias_grad fp32" "cross_entropy fp32" \
               "cross_entropy_backward fp32" "embedding_backward fp32"; do
      grep -qE "^$row +[0-9]+" out || fail "summary lacks the '$row' row"
    done
    grep -qE "^calibrate: gemm fp32 backward .*dgrad.*wgrad" err || fail "no progress line for the backward gemms"
    grep -qE "^calibrate: optimizer step bf16 .*GB/s" err || fail "no progress line for the optimizer step"
    grep -qE "^calibrate: host adamw .*GB/s" err || fail "no progress line for the host adamw"
    grep -qE "pass: dgrad" tmp.yaml && grep -qE "pass: wgrad" tmp.yaml || fail "no dgrad / wgrad rows in the profile"
    grep -qE "op: optimizer_step" tmp.yaml && grep -qE "op: host_adamw" tmp.yaml || fail "no optimizer_step / host_adamw rows"
    grep -qE "^calibrate: elementwise fp32 backward kernels: layer_norm_backward .*embedding_backward [0-9]+ up to .*GB/s" err \
      || fail "no progress line for the backward kernels"
    grep -q "FAILED" err && fail "a calibration section failed"
    for op in layer_norm_backward gelu_backward bias_grad cross_entropy cross_entropy_backward embedding_backward; do
      grep -qE "op: $op, dtype: fp32" tmp.yaml || fail "no $op rows in the profile"
    done
    # flash_backward where the flash rows are measured (libtorch >= 2.0), nowhere else.
    if grep -qE "kernel: flash," tmp.yaml; then
      grep -qE "kernel: flash_backward," tmp.yaml || fail "flash rows but no flash_backward rows"
      grep -qE "^attention flash_backward fp32 +[0-9]+" out || fail "summary lacks the flash_backward row"
      grep -qE "^calibrate: attention fp32 flash_backward .*backward / forward time: median" err || fail "no progress line for flash_backward"
    else
      grep -qE "kernel: flash_backward" tmp.yaml && fail "flash_backward rows without flash rows"
    fi
    run "$CHECK" tmp.yaml --expect-backend cpu
    expect_rc 0
    # The tiny scenario (fp32) with and without the profile, through the analytic estimator.
    run "$DSSIM" scenario tiny/tiny_dp1 --backend analytic --json
    expect_rc 0
    cp out preset.json
    run "$DSSIM" scenario tiny/tiny_dp1 --backend analytic --json --set cluster.device_profile=tmp.yaml
    expect_rc 0
    cp out profiled.json
    a=$(iteration_seconds preset.json) b=$(iteration_seconds profiled.json)
    # The profile's measured rates replace the preset's roofline: the estimate differs. By how much
    # depends on how fast this machine ran the kernels while calibrating (a loaded CI box measured
    # 0.2 %), so only "differs" is asserted: the same figure means the profile was not used.
    python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); sys.exit(0 if b != a else 1)" "$a" "$b" \
      || fail "the profile did not change the estimate: preset $a s, profiled $b s"
    # A broken profile is a config error naming the file.
    echo "metadata: {gpu: x}" > broken.yaml
    run "$DSSIM" scenario tiny/tiny_dp1 --backend analytic --set cluster.device_profile=broken.yaml
    expect_rc 2
    expect_err "broken.yaml"
    ;;
  cuda_without_gpu)
    # On CI (CPU libtorch, no GPU) --backend cuda is a clear error, exit 2, no output file.
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo "GPU present: skipped"; exit 0; fi
    run "$DSSIM" calibrate --backend cuda --quick --out "$TMP/gpu.yaml"
    expect_rc 2
    expect_err "without CUDA|no CUDA GPU"
    [ -e "$TMP/gpu.yaml" ] && fail "output written"
    ;;
  bad_options)
    run "$DSSIM" calibrate --backend tpu
    expect_rc 2
    expect_err "--backend needs cuda or cpu"
    run "$DSSIM" calibrate --dtype int8
    expect_rc 2
    expect_err "--dtype"
    run "$DSSIM" calibrate --frobnicate
    expect_rc 2
    expect_err "unknown option"
    ;;
  unwritable_out)
    run "$DSSIM" calibrate --backend cpu --quick --quiet --out "$TMP/no/such/dir/p.yaml"
    expect_rc 1
    expect_err "cannot write"
    ;;
  *) fail "unknown case" ;;
esac
echo "ok [$CASE]"

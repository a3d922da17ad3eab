#!/usr/bin/env bash
# test_cli.sh DSSIM CASE: one end-to-end check of the dssim program (run from the repo root).
set -u
DSSIM=$1
CASE=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
DS=tests/data/ds_configs

fail() { echo "FAIL [$CASE]: $*"; echo "--- stdout"; cat "$TMP/out" 2>/dev/null; echo "--- stderr"; cat "$TMP/err" 2>/dev/null; exit 1; }
run() { "$DSSIM" "$@" >"$TMP/out" 2>"$TMP/err"; echo $? >"$TMP/rc"; }
rc() { cat "$TMP/rc"; }
expect_rc() { [ "$(rc)" = "$1" ] || fail "exit code $(rc), expected $1"; }
expect_err() { grep -qiE -- "$1" "$TMP/err" || fail "stderr lacks /$1/"; }
expect_out() { grep -qiE -- "$1" "$TMP/out" || fail "stdout lacks /$1/"; }
# A bad-input run: exit 2, a message matching $1, and no output file left behind.
expect_refused() {
  expect_rc 2
  expect_err "$1"
  [ -z "$(ls -A "$TMP/outdir" 2>/dev/null)" ] || fail "partial output left: $(ls "$TMP/outdir")"
}
yaml() { cat >"$TMP/s.yaml"; }
mkdir -p "$TMP/outdir"

case "$CASE" in
  gpt175b_report)
    run scenario scenarios/gpt175b.yaml
    expect_rc 0
    expect_out "174\.[0-9]+ B parameters"
    expect_out "TP 8 \| PP 8 \| DP 16"
    expect_out "iteration time"
    expect_out "MFU"
    expect_out "pipeline bubble"
    expect_out "fits|DOES NOT FIT"
    ;;
  gpt175b_json_valid)
    run scenario scenarios/gpt175b.yaml --json
    expect_rc 0
    python3 - "$TMP/out" <<'PY' || fail "JSON check failed"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["schema"] == "dssim.report/1"
t = j["throughput"]["iteration_seconds"]
assert t > 0
parts = sum(j["time_seconds"].values())
assert abs(parts - t) <= 1e-6 * t, (parts, t)
assert j["config"]["tp"] == 8 and j["config"]["pp"] == 8 and j["config"]["dp"] == 16
assert 0 < j["throughput"]["mfu"] < 1
for k in ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries", "total", "gpu_capacity"):
    assert k in j["memory_bytes"], k
PY
    ;;
  output_written_atomically)
    run scenario scenarios/gpt175b.yaml --output "$TMP/outdir/r.json"
    expect_rc 0
    python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$TMP/outdir/r.json" || fail "bad JSON file"
    [ "$(ls "$TMP/outdir")" = "r.json" ] || fail "stray files: $(ls "$TMP/outdir")"
    ;;
  every_shipped_scenario)
    n=0
    for f in scenarios/*.yaml scenarios/tiny/*.yaml; do
      [ -f "$f" ] || continue
      run scenario "$f" --json
      expect_rc 0
      n=$((n+1))
    done
    [ "$n" -ge 6 ] || fail "only $n shipped scenarios"
    ;;
  plan_ranked)
    run plan scenarios/gpt13b_zero2.yaml --top 5 --vary tp,pp,micro_batch,zero,recompute
    expect_rc 0
    expect_out "^dssim plan gpt13b_zero2: 64 x A100-40GB, global batch 512"
    expect_out "configurations on 64 GPUs: [0-9]+ refused by validation, [0-9]+ over GPU or host memory, [0-9]+ fit"
    expect_out "^ +1 +TP"
    expect_out "the scenario's own configuration .* ranks [0-9]+ of [0-9]+"
    expect_out "^Why: .* beats the best"
    # each part is named with its side: "OTHER's pipeline bubble takes ... against WINNER's ..."
    python3 - "$(grep '^Why: ' "$TMP/out")" <<'PY' || fail "the why sentence does not name both sides"
import re, sys
why = sys.argv[1]
m = re.match(r"Why: (.+?) \([0-9.]+ s per iteration\) beats the best (.+?) \(", why)
assert m, why
winner, other = m.group(1), m.group(2)
assert winner != other, why
assert f": {other}'s " in why and f" against {winner}'s " in why, why
assert " its " not in why, why
PY
    [ "$(grep -cE '^ +[0-9]+[ *] +TP' "$TMP/out")" -ge 5 ] || fail "fewer than 5 ranked rows"
    ;;
  plan_json)
    run plan scenarios/gpt13b_zero2.yaml --json --top 3 --vary tp,pp,micro_batch,zero
    expect_rc 0
    python3 - "$TMP/out" <<'PY' || fail "JSON check failed"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["schema"] == "dssim.plan/1"
p = j["plans"][0]
assert p["gpus"] == 64 and p["global_batch"] == 512
c = p["counts"]
assert c["enumerated"] == c["invalid"] + c["too_big"] + c["scored"], c
r = p["ranked"]
assert len(r) == 3 and [e["rank"] for e in r] == [1, 2, 3]
assert r[0]["tokens_per_second"] >= r[1]["tokens_per_second"] >= r[2]["tokens_per_second"]
e = r[0]
assert e["config"]["tp"] * e["config"]["pp"] * e["config"]["dp"] == 64
assert e["memory_bytes"]["peak"] <= e["memory_bytes"]["capacity"]
assert abs(sum(e["time_seconds"].values()) - e["iteration_seconds"]) <= 1e-6 * e["iteration_seconds"]
assert p["scenario_config"]["rank"] >= 1
PY
    ;;
  plan_sweep)
    # --gpus 16..64: 16, 32 and 64 GPUs, one table row and one JSON plan each, the best marked
    run plan scenarios/gpt13b_zero2.yaml --gpus 16..64 --top 2 --vary tp,pp,micro_batch,zero
    expect_rc 0
    expect_out "^Best per GPU count"
    sed -n '/^Best per GPU count/,/^$/p' "$TMP/out" >"$TMP/sizes"
    [ "$(grep -cE '^ +[0-9]+[ *] +TP' "$TMP/sizes")" = 3 ] || fail "the table has not 3 rows"
    for n in 16 32 64; do
      grep -qE "^ +$n[ *] +TP[0-9]+ PP[0-9]+ DP[0-9]+ " "$TMP/sizes" || fail "no table row for $n GPUs"
    done
    [ "$(grep -cE '^ +[0-9]+\* +TP' "$TMP/sizes")" = 1 ] || fail "not exactly one best GPU count marked"
    run plan scenarios/gpt13b_zero2.yaml --gpus 16..64 --top 2 --vary tp,pp,micro_batch,zero --json
    expect_rc 0
    python3 - "$TMP/out" <<'PY' || fail "sweep JSON check failed"
import json, sys
j = json.load(open(sys.argv[1]))
plans = j["plans"]
assert [p["gpus"] for p in plans] == [16, 32, 64], [p["gpus"] for p in plans]
for p in plans:
    assert 1 <= len(p["ranked"]) <= 2, p["gpus"]
    e = p["ranked"][0]
    c = e["config"]
    assert c["tp"] * c["pp"] * c["dp"] == p["gpus"], (p["gpus"], c)
    assert p["counts"]["enumerated"] == p["counts"]["invalid"] + p["counts"]["too_big"] + p["counts"]["scored"]
b = j["best"]
best = plans[b["plan_index"]]
assert best["gpus"] == b["gpus"] and best["ranked"][0]["key"] == b["key"], b
# throughput: the best size has the most tokens/s of all best-per-size entries
assert best["ranked"][0]["tokens_per_second"] == max(p["ranked"][0]["tokens_per_second"] for p in plans)
PY
    ;;
  plan_infeasible)
    run plan scenarios/gpt175b.yaml --gpus 8
    expect_rc 3
    expect_err "no configuration of gpt175b fits 8 x A100-80GB"
    expect_err "smallest GPU count that fits is [0-9]+"
    ;;
  plan_bad_flags)
    run plan scenarios/gpt13b_zero2.yaml --vary tp,ppp
    expect_rc 2; expect_err "--vary: unknown dimension 'ppp'"
    run plan scenarios/gpt13b_zero2.yaml --fix parallel.tp=eight
    expect_rc 2; expect_err "--fix parallel.tp=eight: expected an integer"
    run plan scenarios/gpt13b_zero2.yaml --fix parallel.tp
    expect_rc 2; expect_err "--fix 'parallel.tp': expected key=value"
    run plan scenarios/gpt13b_zero2.yaml --gpus 64..8
    expect_rc 2; expect_err "--gpus 64..8: the range is empty"
    run plan scenarios/gpt13b_zero2.yaml --objective speed
    expect_rc 2; expect_err "--objective 'speed': use throughput, cost or time-to-train"
    run plan scenarios/gpt13b_zero2.yaml --top 0
    expect_rc 2; expect_err "--top 0: must be at least 1"
    run plan scenarios/gpt13b_zero2.yaml --fix parallel.tpp=2
    expect_rc 2; expect_err "parallel\.tpp.*parallel\.tp"
    ;;
  plan_emit_best)
    run plan scenarios/gpt13b_zero2.yaml --vary tp,pp,micro_batch,zero --emit-best "$TMP/outdir/best"
    expect_rc 0
    [ "$(ls "$TMP/outdir/best" | tr '\n' ' ')" = "ds_config.json megatron_args.txt scenario.yaml " ] || fail "files: $(ls "$TMP/outdir/best")"
    grep -q -- "--tensor-model-parallel-size" "$TMP/outdir/best/megatron_args.txt" || fail "no TP flag"
    run scenario "$TMP/outdir/best/scenario.yaml" --backend analytic --deepspeed_config "$TMP/outdir/best/ds_config.json" --json
    expect_rc 0
    ;;
  missing_file)
    run scenario "$TMP/nope.yaml" --output "$TMP/outdir/r.json"
    expect_refused "nope.yaml"
    ;;
  malformed_yaml)
    printf 'model:\n  preset: gpt-1.3b\n  layers: [1, 2\n' | yaml
    run scenario "$TMP/s.yaml" --output "$TMP/outdir/r.json"
    expect_refused "line [0-9]+"
    ;;
  unknown_key)
    run scenario scenarios/gpt175b.yaml --set parallel.tpp=4 --output "$TMP/outdir/r.json"
    expect_refused "parallel\.tpp.*parallel\.tp"
    ;;
  wrong_type)
    run scenario scenarios/gpt175b.yaml --set parallel.tp=eight --output "$TMP/outdir/r.json"
    expect_refused "parallel\.tp.*integer"
    ;;
  bad_batch_triple)
    run scenario scenarios/tiny/tiny_dp1.yaml --deepspeed_config $DS/bad_batch_triple.json --output "$TMP/outdir/r.json"
    expect_refused "8 != 2 \* 1 \* 1"
    ;;
  fp16_and_bf16)
    run scenario scenarios/tiny/tiny_dp1.yaml --deepspeed_config $DS/bad_fp16_and_bf16.json --output "$TMP/outdir/r.json"
    expect_refused "fp16.*bf16"
    ;;
  zero3_with_pp)
    run scenario scenarios/gpt175b.yaml --set zero.stage=3 --output "$TMP/outdir/r.json"
    expect_refused "pipeline"
    ;;
  onebit_with_zero)
    run scenario scenarios/onebit_adam.yaml --set zero.stage=1 --output "$TMP/outdir/r.json"
    expect_refused "1-bit|onebit"
    ;;
  heads_tp)
    run scenario scenarios/gpt175b.yaml --set model.heads=100 --output "$TMP/outdir/r.json"
    expect_refused "heads"
    ;;
  layers_pp)
    # 90 layers on pp 8 load (DeepSpeed's parameters balance); an unknown partition method is refused.
    run scenario scenarios/gpt175b.yaml --set model.layers=90 --set parallel.partition_method=bananas --output "$TMP/outdir/r.json"
    expect_refused "parallel.partition_method.*unknown pipeline partition method"
    ;;
  gpus_mismatch)
    run scenario scenarios/gpt175b.yaml --set parallel.dp=7 --output "$TMP/outdir/r.json"
    expect_refused "1024"
    ;;
  ds_config_template)
    run scenario scenarios/gpt13b_zero2.yaml --deepspeed_config tests/data/ds_configs/corpus/mds_ds_config_gpt_TEMPLATE.json --output "$TMP/outdir/r.json"
    expect_refused "train_batch_size: unexpanded template placeholder CONFIG_BATCH_SIZE"
    ;;
  ds_config_duplicate_key)
    run scenario scenarios/gpt13b_zero2.yaml --deepspeed_config tests/data/ds_configs/corpus/mds_duplicate_stage.json --output "$TMP/outdir/r.json"
    expect_refused "duplicate key 'zero_optimization.stage'"
    ;;
  ds_config_accelerate_auto)
    run scenario scenarios/gpt13b_zero2.yaml --deepspeed_config tests/data/ds_configs/corpus/lf_ds_z3_fp16_false_bf16_auto.json
    expect_rc 0
    expect_out "bf16 / full"
    expect_out "global 512 = micro-batch 2 x accumulation 4 x DP 64"
    ;;
  ds_config_warnings)
    run scenario scenarios/tiny/tiny_dp1.yaml --deepspeed_config $DS/cross_dc_comm.json
    expect_rc 0
    expect_out "nccl_socket_ifname"
    ;;
  does_not_fit_suggests)
    run scenario scenarios/gpt175b.yaml --set zero.stage=0 --set training.micro_batch=8 --set training.global_batch=1536 --set training.grad_accum=12
    expect_rc 3
    expect_out "DOES NOT FIT"
    expect_err "does not fit.*try --set"
    expect_out "Changes that would make it fit"
    ;;
  unknown_verb)
    run frobnicate
    expect_rc 2
    expect_err "unknown verb"
    ;;
  validate_published)
    # Every published row through the default backend, within the committed thresholds.
    run validate
    expect_rc 0
    expect_out "megatron_sc21_table1"
    expect_out "zero_sc20_table1"
    expect_out "PASS"
    ;;
  validate_json)
    run validate --backend analytic --json
    expect_rc 0
    python3 - "$TMP/out" <<'PY' || fail "JSON check failed"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["schema"] == "dssim.validate/1"
names = {t["name"]: t for t in j["tables"]}
meg = names["megatron_sc21_table1"]
assert len(meg["rows"]) == 10
assert meg["max_abs_error"] <= meg["allowed_max_abs_error"] and meg["mean_abs_error"] <= 0.05, meg["max_abs_error"]
for r in meg["rows"]:
    assert abs((r["predicted"] - r["published"]) / r["published"] - r["error"]) < 1e-9
assert len(names["zero_sc20_table1"]["rows"]) == 54
PY
    ;;
  validate_detects_regression)
    # A copy of the validation data with a tightened threshold must fail (exit 1), naming the table.
    mkdir -p "$TMP/v"
    cp -r validation/published "$TMP/v/"
    printf 'megatron_sc21_table1: {max_abs_error: 0.001, mean_abs_error: 0.001}\n' >"$TMP/v/thresholds.yaml"
    run validate --backend analytic --dir "$TMP/v"
    expect_rc 1
    expect_err "megatron_sc21_table1.*exceed.*mean \|error\| [0-9.]+% > 0.10%, max \|error\| [0-9.]+% > 0.10%"
    # Only the largest error over its threshold: the message names that one alone.
    printf 'megatron_sc21_table1: {max_abs_error: 0.001, mean_abs_error: 0.9}\n' >"$TMP/v/thresholds.yaml"
    run validate --backend analytic --dir "$TMP/v"
    expect_rc 1
    expect_err "exceed the committed thresholds \(max \|error\| [0-9.]+% > 0.10%\)"
    run validate --dir "$TMP/no_such_dir"
    expect_rc 2
    expect_err "--dir .*no_such_dir has no published/ directory"
    ;;
  compare_cpu_record)
    # Measure a tiny scenario on the CPU, record it, and compare again from the record: the
    # measured side must come back identical, the predicted side from the same Program.
    run compare scenarios/tiny/tiny_dp2.yaml --backend cpu --nproc 2 --steps 4 --record "$TMP/outdir/rec.json" --json
    expect_rc 0
    cp "$TMP/out" "$TMP/live.json"
    run compare --measured "$TMP/outdir/rec.json" --json
    expect_rc 0
    python3 - "$TMP/live.json" "$TMP/out" "$TMP/outdir/rec.json" <<'PY' || fail "compare check failed"
import json, sys
live, again, rec = (json.load(open(p)) for p in sys.argv[1:4])
assert live["schema"] == "dssim.compare/1"
assert rec["schema"] == "dssim.measurement/1" and "scenario_yaml" in rec
kinds = {k["kind"]: k for k in live["kinds"]}
for k in ("forward", "backward", "optimizer_step"):
    assert kinds[k]["measured_seconds"] > 0 and kinds[k]["simulated_seconds"] > 0, k
# 2 data-parallel ranks reduce their gradients: bytes, not the table (its rows under 0.1% of the
# measured iteration are left out, and a loaded machine stretches the iteration).
moved = rec["report"]["extras"]["measured"]["bytes_per_iteration"]
assert moved.get("all_reduce/gradient_reduce", 0) > 0, moved.keys()
assert again["iteration_seconds"]["measured"] == live["iteration_seconds"]["measured"]
assert abs(again["iteration_seconds"]["simulated"] - live["iteration_seconds"]["simulated"]) <= 1e-12 * live["iteration_seconds"]["simulated"]
m = rec["report"]["throughput"]["iteration_seconds"]
assert m == live["iteration_seconds"]["measured"] and m > 0
PY
    ;;
  compare_cpu_pipeline)
    # A 3-stage pipeline measured on the CPU: rows for the compute, the pipeline messages and the
    # bubble (the receive waits), each measured and predicted.
    export DSSIM_CPU_THREADS=1
    run compare scenarios/tiny/tiny_pp3.yaml --backend cpu --nproc 3 --steps 6 --record "$TMP/outdir/rec.json"
    expect_rc 0
    # The table leaves out kinds under 0.1% of the iteration on both sides, and a loaded machine
    # stretches the measured iteration: the messages' rows are checked in the record instead.
    for row in forward backward; do expect_out "^ +$row +[0-9.]+ s +[0-9.]+ s"; done
    run compare --measured "$TMP/outdir/rec.json" --json
    expect_rc 0
    python3 - "$TMP/out" "$TMP/outdir/rec.json" <<'PY' || fail "compare check failed"
import json, sys
kinds = {k["kind"]: k for k in json.load(open(sys.argv[1]))["kinds"]}
for k in ("forward", "backward"):
    assert kinds[k]["measured_seconds"] > 0 and kinds[k]["simulated_seconds"] > 0, (k, kinds.get(k))
rec = json.load(open(sys.argv[2]))["report"]
measured = rec["extras"]["measured"]["seconds_per_iteration_by_instruction"]
for k in ("send", "recv"):
    assert measured.get(k, 0) > 0, (k, measured)
assert rec["time_seconds"]["bubble"] > 0, rec["time_seconds"]
PY
    ;;
  compare_offload_record)
    # The committed 7B offload measurement: the copy rows compare like with like (the simulator's
    # copy stream against the engine's host worker), the exposed part has a row of its own.
    rec=validation/measured/h200_7b_zero3_offload.json
    run compare --measured "$rec" --json
    expect_rc 0
    python3 - "$TMP/out" "$rec" <<'PY' || fail "compare check failed"
import json, sys
c, rec = (json.load(open(p)) for p in sys.argv[1:3])
kinds = {k["kind"]: k for k in c["kinds"]}
busy = rec["report"]["extras"]["measured"]["host_offload_per_iteration"]["accumulate_seconds"]
assert kinds["copy_d2h"]["measured_seconds"] == busy, kinds["copy_d2h"]
assert kinds["exposed_offload"]["measured_seconds"] == rec["report"]["time_seconds"]["exposed_offload"]
for k in ("copy_d2h", "exposed_offload", "host_optimizer_step", "backward"):
    assert kinds[k]["simulated_seconds"] > 0, k
assert abs(c["iteration_seconds"]["error"]) < 0.05, c["iteration_seconds"]
PY
    ;;
  compare_record_gpu_name)
    # A record names the GPU the run reports (measured.device), else the scenario's GPU; the
    # run's fused kernels (measured.gemm_epilogues) price the prediction and land in the record's
    # scenario.
    rec=validation/measured/h100_350m_onebit.json
    sc=validation/measured/scenarios/h100_350m_onebit.yaml
    python3 - "$rec" "$TMP/with.json" "$TMP/without.json" <<'PY' || fail "could not write the runs"
import json, sys
run = json.load(open(sys.argv[1]))["report"]
run["extras"]["measured"]["device"] = "NVIDIA H100 80GB HBM3"
json.dump(run, open(sys.argv[2], "w"))
del run["extras"]["measured"]["device"]
json.dump(run, open(sys.argv[3], "w"))
PY
    run compare "$sc" --run-json "$TMP/with.json" --record "$TMP/outdir/with.json"
    expect_rc 0
    expect_out "GEMM epilogues on"
    run compare "$sc" --run-json "$TMP/without.json" --record "$TMP/outdir/without.json"
    expect_rc 0
    python3 - "$TMP/outdir/with.json" "$TMP/outdir/without.json" <<'PY' || fail "record check failed"
import json, sys
w, wo = (json.load(open(p)) for p in sys.argv[1:3])
assert w["gpu"] == "NVIDIA H100 80GB HBM3", w["gpu"]
assert wo["gpu"] == "H100-SXM", wo["gpu"]
assert "gemm_epilogues: true" in w["scenario_yaml"], w["scenario_yaml"]
PY
    ;;
  compare_unpriced_fold)
    # A ZeRO-3 run that folded its layer gradients (DSSIM_ZERO3_FOLD=1) where the model prices
    # backward into the partition: compare says so, and refuses to record it.
    rec=validation/measured/h100_7b16_zero3.json
    sc=validation/measured/scenarios/h100_7b16_zero3.yaml
    python3 - "$rec" "$TMP/fold.json" "$TMP/direct.json" <<'PY' || fail "could not write the runs"
import json, sys
run = json.load(open(sys.argv[1]))["report"]
run["extras"]["measured"]["zero3_backward_into_partition"] = True
json.dump(run, open(sys.argv[3], "w"))
run["extras"]["measured"]["zero3_backward_into_partition"] = False
json.dump(run, open(sys.argv[2], "w"))
PY
    run compare "$sc" --run-json "$TMP/fold.json" --json
    expect_rc 0
    expect_out "DSSIM_ZERO3_FOLD"
    run compare "$sc" --run-json "$TMP/fold.json" --record "$TMP/outdir/fold.json"
    expect_refused "not like for like"
    run compare "$sc" --run-json "$TMP/direct.json" --record "$TMP/outdir/direct.json"
    expect_rc 0
    expect_out "GEMM epilogues on"
    if grep -q "like for like" "$TMP/out"; then fail "like-for-like run flagged"; fi
    [ -f "$TMP/outdir/direct.json" ] || fail "no record written"
    ;;
  compare_bad_input)
    run compare scenarios/tiny/tiny_dp1.yaml
    expect_rc 2
    expect_err "give one of --backend"
    run compare scenarios/tiny/tiny_dp1.yaml --run-json tests/data/ds_configs/onebit_adam.json --record "$TMP/outdir/r.json"
    expect_refused "not a .dssim run --json. report"
    run compare --measured "$TMP/missing.json" --record "$TMP/outdir/r.json"
    expect_refused "cannot read"
    run compare scenarios/tiny/tiny_dp1.yaml --backend cuda --record "$TMP/outdir/r.json"
    expect_rc 1
    [ -z "$(ls -A "$TMP/outdir")" ] || fail "partial record left"
    ;;
  what_if_slow_gpu)
    # The what-if run against the clean one, both in this invocation; JSON carries both.
    run scenario scenarios/gpt175b.yaml --what-if "slow-gpu 17 x0.8" --json --output "$TMP/outdir/w.json"
    expect_rc 0
    python3 - "$TMP/out" <<'PY' || fail "what-if JSON check failed"
import json, sys
j = json.load(open(sys.argv[1]))
w = j["extras"]["what_if"]
assert w["specs"] == ["slow-gpu 17 x0.8"], w["specs"]
assert w["iteration_seconds"] == j["throughput"]["iteration_seconds"]
assert w["iteration_seconds"] > w["clean_iteration_seconds"] > 0
assert abs(w["change"] - (w["iteration_seconds"] / w["clean_iteration_seconds"] - 1)) < 1e-12
assert w["straggler"]["rank"] == 17, w["straggler"]
assert w["summary"].startswith("+"), w["summary"]
assert j["extras"]["sim"]["simulation"]["folded_tensor_parallel"] is False
PY
    run scenario scenarios/gpt175b.yaml --what-if "slow-gpu 17 x0.8"
    expect_rc 0
    expect_out "^What-if \(compared with the clean run"
    expect_out "summary +\+[0-9.]+%: rank 17 arrived last"
    ;;
  what_if_bad)
    run scenario scenarios/gpt175b.yaml --what-if "slow-gpu 17 0.8" --output "$TMP/outdir/w.json"
    expect_refused "what-if 'slow-gpu 17 0.8'.*xF"
    run scenario scenarios/gpt175b.yaml --what-if "slow-gpu 5000 x0.5" --output "$TMP/outdir/w.json"
    expect_refused "rank 5000 does not exist.*ranks 0-1023"
    run scenario scenarios/gpt175b.yaml --what-if "link nic-999-0 x0.5" --output "$TMP/outdir/w.json"
    expect_refused "no link named 'nic-999-0'.*nic-N-J"
    run scenario scenarios/gpt175b.yaml --backend analytic --what-if "noise 5%" --output "$TMP/outdir/w.json"
    expect_refused "need the simulator: use --backend sim"
    yaml <<'Y'
model: gpt3-175b
cluster: {preset: dgx-a100-hdr, nodes: 2}
parallel: {tp: 8, pp: 2}
training: {global_batch: 16, micro_batch: 1}
what_if: ["slow-gpu 1 x0.5", "noise five"]
Y
    run scenario "$TMP/s.yaml" --output "$TMP/outdir/w.json"
    expect_refused "what_if\[1\].*line 5.*noise 5%"
    ;;
  reliability_report)
    run scenario scenarios/gpt175b.yaml --reliability --json
    expect_rc 0
    python3 - "$TMP/out" <<'PY' || fail "reliability JSON check failed"
import json, sys
j = json.load(open(sys.argv[1]))
g = j["extras"]["reliability"]
assert abs(g["failures_per_gpu_hour"] - 419 / (54 * 24 * 16384)) < 1e-12
assert 0.9 < g["goodput"] < 1
assert abs(g["monte_carlo"]["goodput"] - g["goodput"]) <= 0.02 * g["goodput"]
assert g["checkpoint_interval_auto"] is True
assert g["checkpoint_interval_iterations"] >= 1
assert g["checkpoint_bytes"] > 2e12
PY
    yaml <<'Y'
model: gpt-1.3b
cluster: {preset: dgx-a100-hdr, nodes: 2}
parallel: {tp: 1, pp: 1}
zero: 1
training: {global_batch: 64, micro_batch: 4, tokens_to_train: 1e9}
reliability: {failures_per_node_day: 2, checkpoint_interval: 1800 s, restart_overhead: 300 s, write_bandwidth: 20 GB/s}
Y
    run scenario "$TMP/s.yaml" --backend analytic
    expect_rc 0
    expect_out "^Failures and goodput over the run"
    expect_out "goodput +[0-9.]+ % closed form, [0-9.]+ % Monte-Carlo"
    expect_out "time to train +.* with failures"
    run scenario "$TMP/s.yaml" --backend analytic --set reliability.checkpoint_interval=often
    expect_refused "reliability.checkpoint_interval.*auto"
    ;;
  dp_overflow_message)
    run scenario scenarios/gpt175b.yaml --set parallel.dp=100000000
    expect_refused "tp \* pp \* dp = 8 \* 8 \* 100000000 = 6400000000 but the cluster has 1024 GPUs"
    ;;
  moe_links_and_waits)
    # Link utilization is a fraction of the iteration; with pp = 1 there is no pipeline bubble.
    run scenario scenarios/moe.yaml --json
    expect_rc 0
    python3 - "$TMP/out" <<'PY' || fail "moe check failed"
import json, sys
j = json.load(open(sys.argv[1]))
s = j["extras"]["sim"]
for l in s["links"]["busiest"]:
    assert 0 <= l["utilization"] <= 1 + 1e-9, l
for c, v in s["links"]["classes"].items():
    assert 0 <= v["max_utilization"] <= 1 + 1e-9, (c, v)
PY
    run scenario scenarios/moe.yaml
    expect_rc 0
    grep -q "pipeline bubble" "$TMP/out" && fail "pp = 1 reports a pipeline bubble"
    ;;
  *) fail "unknown case" ;;
esac
echo "ok [$CASE]"

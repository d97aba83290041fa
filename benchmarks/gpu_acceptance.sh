#!/usr/bin/env bash
# GPU acceptance (docs/gpu.md): the smoke pipeline's stages that run a model (rule on_device: base model, experts
# choice, coverage, warmup, training, evaluation, lm-eval, HumanEval generation, routing drift) on cuda for one run
# (config/gpu-check.yaml), in a scratch copy of the tree, so results/ keeps its CPU runs, then
# benchmarks/gpu_acceptance.py: moeflow's Trainer against the tuned HF Trainer on a Qwen3-30B-A3B-shaped slice.
# Everything lands in one JSON file: the benchmark's numbers, and under "parts" each part's seconds and outcome.
#
#   benchmarks/gpu_acceptance.sh --bundle [--out FILE] [--skip-smoke] [gpu_acceptance.py options]
#       on the lent GPU machine (no network; its python3 holds torch): installs .device-bundle/ (make gpu-bundle,
#       carried with the tree) with pip --no-index --no-deps into a folder of its own, over the machine's own torch
#       (never reinstalled), checks it (benchmarks/device_bundle.py check), then the two parts. At most 5 minutes
#       on an H100 or H200: each part runs under its own time limit (below), and the JSON is written whatever fails.
#   benchmarks/gpu_acceptance.sh --dry [--out FILE] [--skip-smoke]
#       CI, on the CPU, in a mimic of that machine: .venvs/device (make device-env: Python 3.12 with the machine's
#       torch 2.11 and transformers 5.17 and nothing it lacks, envs/device.txt) and the same bundle, installed the
#       same way; the smoke pipeline's stages on cpu and the slice at test sizes.
#       GPU_ACCEPTANCE_PYTHON=<python> runs it in that Python's own environment instead (no mimic, no bundle).
#   STACK=current benchmarks/gpu_acceptance.sh [--out FILE]   (make gpu-check)
#       a GPU machine with network: make env, then the two parts in .venvs/$STACK.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
mode=network
case "${1:-}" in
  --bundle) mode=bundle; shift ;;
  --dry) mode=dry; shift ;;
esac
out=""
smoke=1
bench_args=()
while (($#)); do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --skip-smoke) smoke=0; shift ;;
    *) bench_args+=("$1"); shift ;;
  esac
done
suffix=""
[[ $mode == dry ]] && suffix=".dry"
out="${out:-results/bench/gpu_acceptance$suffix.json}"
mkdir -p "$(dirname "$out")"
out="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
rm -f "$out" "${out%.json}.smoke.log" # a part that fails leaves no earlier run's numbers behind
# Each part's time limit (seconds). On the lent machine the call's 5 minutes are about 20 s of install and check,
# 170 s of pipeline (18 jobs, 11 of them on the GPU one after another; 135 s of jobs on a 2-core CPU stand-in) and
# 110 s of benchmark (two slices built, 20 steps each, the experts timed); elsewhere the limits only stop a hang.
if [[ $mode == bundle ]]; then
  SMOKE_LIMIT="${SMOKE_LIMIT:-170}"
  BENCH_LIMIT="${BENCH_LIMIT:-110}"
else
  SMOKE_LIMIT="${SMOKE_LIMIT:-1200}"
  BENCH_LIMIT="${BENCH_LIMIT:-900}"
fi
parts="$(mktemp)"
work="$(mktemp -d)"
trap 'rm -rf "$work" "$parts"' EXIT
echo '{}' >"$parts"
started=$SECONDS

python="" # the interpreter the parts run in
site=""   # where the bundle goes
case "$mode" in
  bundle)
    python="${GPU_ACCEPTANCE_PYTHON:-python3}"
    export STACK=current # torch 2.x of the machine with the bundle's transformers 5: the current stack's code paths
    ;;
  dry)
    export STACK=current
    if [[ -n "${GPU_ACCEPTANCE_PYTHON:-}" ]]; then
      python="$GPU_ACCEPTANCE_PYTHON"
    else
      make -s device-env
      python=.venvs/device/bin/python
      echo "=== device bundle (make gpu-bundle: kept wheels are reused)"
      "$python" benchmarks/device_bundle.py | tail -1
    fi
    ;;
  network)
    STACK="${STACK:-pinned}"
    export STACK
    echo "=== environment: $STACK"
    make env STACK="$STACK"
    python=".venvs/$STACK/bin/python"
    ;;
esac

[[ $python == */* && $python != /* ]] && python="$repo/$python" # the smoke pipeline runs in another folder
part() { # part NAME RC SECONDS [KEY=JSON ...]: record a part's outcome for the report
  "$python" - "$parts" "$@" <<'EOF'
import json, sys
path, name, rc, seconds, *extra = sys.argv[1:]
parts = json.load(open(path))
parts[name] = {"ok": rc == "0", "exit_code": int(rc), "seconds": float(seconds)} | {
    k: json.loads(v) for k, v in (e.split("=", 1) for e in extra)
}
json.dump(parts, open(path, "w"), indent=2)
EOF
}

if [[ $mode == bundle || ($mode == dry && -z "${GPU_ACCEPTANCE_PYTHON:-}") ]]; then
  [[ -f .device-bundle/requirements.txt ]] || {
    echo "no .device-bundle/: run 'make gpu-bundle' on a machine with network and carry .device-bundle with the tree" >&2
    exit 2
  }
  echo "=== installing the device bundle (no network, the machine's torch kept)"
  site="$work/site"
  t=$SECONDS
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$site" --find-links .device-bundle -r .device-bundle/requirements.txt
  export PYTHONPATH="$site:$repo/src${PYTHONPATH:+:$PYTHONPATH}"
  mimic=()
  [[ $mode == dry ]] && mimic=(--mimic)
  "$python" benchmarks/device_bundle.py check --site "$site" ${mimic[@]+"${mimic[@]}"} --json "$work/bundle.json"
  part bundle 0 $((SECONDS - t)) "check=$(cat "$work/bundle.json")"
else
  export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
fi

failed=0
if ((smoke)); then
  device=cuda
  overlays=(config/smoke.yaml config/gpu.yaml config/gpu-check.yaml)
  [[ $mode == dry ]] && device=cpu
  echo "=== the smoke pipeline's stages that run a model (rule on_device) on $device ($STACK, at most ${SMOKE_LIMIT}s)"
  tar --exclude=./results --exclude=./.venvs --exclude=./.device-bundle --exclude=./.git --exclude=./.snakemake \
    -cf - . | (mkdir "$work/tree" && tar -xf - -C "$work/tree")
  printf 'hardware: {device: %s, num_devices: 1}\n' "$device" >"$work/tree/config/gpu.yaml"
  cores="$(nproc)"
  ((cores > 8)) && cores=8
  t=$SECONDS
  rc=0
  # the copy's own library first: common.smk refuses a moeflow imported from another folder
  (cd "$work/tree" && PYTHONPATH="$work/tree/src:$PYTHONPATH" timeout "$SMOKE_LIMIT" "$python" -m snakemake on_device --cores "$cores" --configfile "${overlays[@]}" \
    >"$work/smoke.log" 2>&1) || rc=$?
  seconds=$((SECONDS - t))
  tail -5 "$work/smoke.log"
  finished="$(grep -c 'Finished job' "$work/smoke.log" || true)"
  if ((rc)); then
    failed=1
    echo "smoke pipeline failed (exit $rc after ${seconds}s); its log's end:" >&2
    tail -40 "$work/smoke.log" >&2
    cp "$work/smoke.log" "${out%.json}.smoke.log"
  fi
  cpu="$("$python" -c 'import csv, glob, sys
rows = [r for f in glob.glob(sys.argv[1] + "/**/*.tsv", recursive=True) for r in csv.DictReader(open(f), delimiter="\t")]
print(round(sum(float(r.get("cpu_time") or 0) for r in rows), 1))' "$work/tree/results/$STACK/benchmarks")"
  part smoke_pipeline "$rc" "$seconds" "device=\"$device\"" "jobs_finished=${finished:-0}" \
    "jobs_cpu_seconds=$cpu" "time_limit_s=$SMOKE_LIMIT"
fi

echo "=== moeflow and the HF Trainer on the slice ($STACK${suffix:+, dry}, at most ${BENCH_LIMIT}s)"
dry=()
[[ $mode == dry ]] && dry=(--dry)
t=$SECONDS
rc=0
timeout "$BENCH_LIMIT" "$python" benchmarks/gpu_acceptance.py ${dry[@]+"${dry[@]}"} --out "$out" --parts "$parts" \
  ${bench_args[@]+"${bench_args[@]}"} || rc=$?
((rc)) && failed=1
"$python" - "$out" "$parts" "$rc" $((SECONDS - t)) $((SECONDS - started)) <<'EOF'
import json, os, sys
out, parts, rc, seconds, total = sys.argv[1:]
report = json.load(open(out)) if os.path.exists(out) else {"setups": {}}
report["parts"] = json.load(open(parts))
report["parts"]["benchmark"] = {"ok": rc == "0", "exit_code": int(rc), "seconds": float(seconds)}
report["total_seconds"] = float(total)
json.dump(report, open(out, "w"), indent=2, sort_keys=True)
print(f"wrote {out} ({total} s in all)")
EOF
exit "$failed"

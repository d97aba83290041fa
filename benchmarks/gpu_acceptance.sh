#!/usr/bin/env bash
# GPU acceptance on a machine with one GPU (make gpu-check): install the stack, run the smoke pipeline
# end to end with hardware.device: cuda (in a scratch copy of the tree, so results/ keeps its CPU runs),
# then benchmarks/gpu_acceptance.py: moeflow's Trainer and the HF Trainer on a Qwen3-30B-A3B-shaped
# slice, written to results/bench/gpu_acceptance.json. About 5 minutes on an H100 once the stack is installed.
#
#   STACK=current benchmarks/gpu_acceptance.sh [--dry] [more gpu_acceptance.py options]
#
# --dry (CI, no GPU): no install, no smoke run (CI has just run it on the CPU); the benchmark at tiny
# sizes on the CPU, written to results/bench/gpu_acceptance.dry.json.
set -euo pipefail
cd "$(dirname "$0")/.."
STACK="${STACK:-pinned}"
dry=""
if [[ "${1:-}" == "--dry" ]]; then
  dry="--dry"
  shift
fi
smoke=()
if [[ -z "$dry" ]]; then
  echo "=== environment: $STACK"
  make env STACK="$STACK"
  echo "=== smoke pipeline on cuda ($STACK)"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$work"
  ln -s "$PWD/.venvs" "$work/.venvs"
  printf 'hardware: {device: cuda, num_devices: 1}\n' >"$work/config/gpu.yaml"
  started=$SECONDS
  (cd "$work" && STACK="$STACK" ".venvs/$STACK/bin/snakemake" train --cores 4 --configfile config/smoke.yaml config/gpu.yaml)
  smoke=(--smoke-pipeline-seconds "$((SECONDS - started))")
fi
echo "=== moeflow and HF Trainer on the slice ($STACK${dry:+, dry})"
PYTHONPATH=src ".venvs/$STACK/bin/python" benchmarks/gpu_acceptance.py $dry ${smoke[@]+"${smoke[@]}"} "$@"

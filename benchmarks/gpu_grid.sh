#!/usr/bin/env bash
# As much of the gpu scale as fits a deadline, on one GPU, through the Snakefile: proves the GPU path
# end to end (compiled model, bf16, kernels.attnres) on the same rules a user runs.
#
#   OUT=/some/dir DEADLINE_S=540 bash benchmarks/gpu_grid.sh
#
# The runs are asked for one `snakemake` call each, in the order below (the comparisons that matter
# most first), and a run starts only while at least RUN_S seconds are left (default 150: on an H200
# one run took 132-142 s through snakemake, compilation included; a run cut off leaves nothing).  The data
# stage's output may be carried in from another machine (results/gpu/data): it is then marked up to
# date with --touch instead of rebuilt, because the embedded corpus is read from the installed
# packages and would differ on a machine with other packages.  Writes $OUT/gpu_grid.json
# (benchmarks/gpu_grid_collect.py: every finished run's result.json with its curves, the unfinished
# runs, the call's timings), $OUT/runs/<run>/{result.json,metrics.jsonl,train.log} and
# $OUT/snakemake.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_grid}
DEADLINE=${DEADLINE_S:-540}
RUN_S=${RUN_S:-150}
PY=${PYTHON:-python3}
SMK=(${SNAKEMAKE:-$PY -m snakemake})
# targets go before --config (snakemake reads every word after --config as a config entry)
OPTS=(--cores all --scheduler greedy --nolock ${GRID_OPTS:-} --config scale=gpu)
T0=$(date +%s)
mkdir -p "$OUT/runs"
log="$OUT/snakemake.log"

RUNS=(
  gpu-small-baseline-s0
  gpu-small-lr-n8-r48-s0
  gpu-small-attnres-n8-r384-s0
  gpu-small-lr-n8-r96-s0
  gpu-small-lr-n8-r24-s0
  gpu-small-lr-fullrms-n8-r48-s0
  gpu-small-lr-n8-r192-s0
  gpu-small-plr-n8-r12-s0
  gpu-small-lr-n8-r48-s1
  gpu-small-attnres-n8-r384-s1
)
# GRID_RUNS="run1 run2 ..." replaces the list (e.g. to continue where a recorded call stopped)
if [ -n "${GRID_RUNS:-}" ]; then read -r -a RUNS <<< "$GRID_RUNS"; fi

if [ -f results/gpu/data/manifest.json ]; then
  "${SMK[@]}" results/gpu/data/manifest.json --touch "${OPTS[@]}" >> "$log" 2>&1
fi
for run in "${RUNS[@]}"; do
  left=$(( DEADLINE - ($(date +%s) - T0) ))
  if [ "$left" -lt "$RUN_S" ]; then
    echo "[gpu_grid] $run not started: ${left}s left" | tee -a "$log"
    continue
  fi
  t=$(date +%s)
  echo "[gpu_grid] $run (${left}s left)" | tee -a "$log"
  timeout --signal=TERM --kill-after=20 $(( left - 10 )) "${SMK[@]}" "results/gpu/runs/$run/result.json" "${OPTS[@]}" >> "$log" 2>&1
  echo "[gpu_grid] $run exit $? after $(( $(date +%s) - t ))s" | tee -a "$log"
  mkdir -p "$OUT/runs/$run"
  for f in result.json metrics.jsonl spec.json; do
    [ -f "results/gpu/runs/$run/$f" ] && cp "results/gpu/runs/$run/$f" "$OUT/runs/$run/"
  done
  [ -f "results/gpu/logs/train/$run.log" ] && cp "results/gpu/logs/train/$run.log" "$OUT/runs/$run/train.log"
done
$PY benchmarks/gpu_grid_collect.py "$OUT" --manifest results/gpu/data/manifest.json
echo "[gpu_grid] done at $(( $(date +%s) - T0 ))s"

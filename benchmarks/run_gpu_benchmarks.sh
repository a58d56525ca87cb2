#!/usr/bin/env bash
# Run the GPU benchmarks on one CUDA machine and write their results to a folder, named as
# benchmarks/results/ names them: <what>_<gpu>_<date>.{json,md}.
#
#   bash benchmarks/run_gpu_benchmarks.sh OUT [BENCHMARK ...]
#
# BENCHMARK (default: grad-probe gpu-tests kernel train-step throughput-1b throughput-4b, in that order):
#   grad-probe     benchmarks/compiled_grad_probe.py: the compiled training step's gradients against
#                  the eager step's for each flex variant, then 150-update gpu-small trainings with the
#                  default attention, each flex variant and eager (GRAD_PROBE_DATA: the gpu scale's
#                  manifest, else synthetic documents)    -> compiled_grad_probe_<gpu>_<date>.{json,md}
#   gpu-tests      the whole GPU suite (scripts/run_gpu_tests.py on GPU_TEST_WORKERS pytest-xdist
#                  workers per GPU, default 8; needs pytest and pytest-xdist)  -> gpu_tests_<gpu>_<date>.log
#   kernel         benchmarks/kernel_bench.py: the bf16 check, then the 90-shape grid at 8192 and 4096
#                  tokens, ours beside FLA and fast-attnres where installed    -> kernel_bench_<gpu>_<date>.*
#   train-step     benchmarks/train_step_bench.py: the compiled 1B step under the paper's protocol
#                  (micro-batch 2 x 2048, 64 accumulation steps, attention TRAIN_STEP_ATTENTION, default
#                  auto: masked SDPA), baseline and LR-AttnRes r = d/4 with the fused kernel
#                                                                         -> train_step_paper_<gpu>_<date>.*
#   throughput-1b  the throughput stage at 1B with the gpu scale's protocol of config.yaml (Table 3,
#                  Appendix I: compiled, micro-batch 2 x 2048, accumulation 64, five repeats of FLA r = d
#                  where fla imports, ours r = d and r = d/4 in rotated order, then more repeats of ours
#                  until the rank gain's 95% half-width is 0.3 points or the size has taken 15 minutes)
#                                                                         -> throughput_1b_<gpu>_<date>.json
#   throughput-4b  the same at 4B                                         -> throughput_4b_<gpu>_<date>.json
# Each benchmark also writes (appends to) <name>.log; OUT/machine.txt records the GPU, driver, torch and
# triton. A throughput benchmark keeps its finished timed runs in throughput_<size>_<gpu>_<date>.partial.json;
# with THROUGHPUT_DEADLINE_S it starts no timed run that would end later than that many seconds after
# its start and exits 75; run it again with that partial file in OUT to continue (whatever its date).
# A failed benchmark is reported and the next one runs; the exit status is 1 if any failed.
#
# Environment: PYTHON (default python3); KERNEL_ARGS, TRAIN_STEP_ARGS and GRAD_PROBE_ARGS, more options
# for kernel_bench.py, train_step_bench.py and compiled_grad_probe.py (e.g. KERNEL_ARGS="--tokens 8192
# --skip-measured A.json"); GRAD_PROBE_DATA, a data manifest for the probe's trainings;
# KERNEL_BUDGET_S (default 7200), the time after which kernel_bench starts no new shape;
# THROUGHPUT_DEADLINE_S, the seconds a throughput benchmark may take in this call; TORCHINDUCTOR_CACHE_DIR
# (default results/compile-cache): Inductor's on-disk caches, which a later call on the same machine reuses;
# LRATTNRES_COMMIT, the commit of a copy of the tree that has no .git of its own.
# The peers are optional: pip install --no-deps fla-core==0.6.0 fast-attnres==2.1.0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash benchmarks/run_gpu_benchmarks.sh OUT [BENCHMARK ...]}
shift
BENCHMARKS=("$@")
[ ${#BENCHMARKS[@]} -gt 0 ] || BENCHMARKS=(grad-probe gpu-tests kernel train-step throughput-1b throughput-4b)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/results/compile-cache}
mkdir -p "$OUT"

# The GPU's name as a file-name word: "NVIDIA H200" -> h200
GPU=$($PY -c 'import re, sys, torch
torch.cuda.is_available() or sys.exit("run_gpu_benchmarks.sh: no CUDA GPU visible to this Python")
n = torch.cuda.get_device_name(0).lower().removeprefix("nvidia ")
print(re.sub(r"[^a-z0-9]+", "-", n).strip("-"))') || exit 1
DATE=$(date -u +%Y-%m-%d)
(date -u && nvidia-smi && $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)') \
  >"$OUT/machine.txt" 2>&1

# Table 3's timing of one size with the gpu scale's protocol (config.yaml, scales.gpu.throughput), on
# CUDA, continuing the partial state of an earlier call in OUT (its stem, whatever its date).
throughput() { # size (1b, 4b), preset (1B, 4B)
  local stem partial deadline=()
  partial=$(find "$OUT" -maxdepth 1 -name "throughput_$1_${GPU}_*.partial.json" | sort | tail -n 1)
  stem=$([ -n "$partial" ] && basename "$partial" .partial.json || echo "throughput_$1_${GPU}_$DATE")
  [ -z "${THROUGHPUT_DEADLINE_S:-}" ] || deadline=(env "LRATTNRES_DEADLINE=$(($(date +%s) + THROUGHPUT_DEADLINE_S))")
  ${deadline[@]+"${deadline[@]}"} $PY -m lrattnres throughput --scale gpu --spec "{\"presets\": [\"$2\"], \"device\": \"cuda\"}" \
    --out "$OUT/$stem.json" --partial "$OUT/$stem.partial.json"
}

run_one() {
  case $1 in
  grad-probe)
    # shellcheck disable=SC2086  # GRAD_PROBE_ARGS holds several options
    $PY benchmarks/compiled_grad_probe.py --out "$OUT" --stem "compiled_grad_probe_${GPU}_$DATE" \
      ${GRAD_PROBE_DATA:+--data "$GRAD_PROBE_DATA"} ${GRAD_PROBE_ARGS:-}
    ;;
  gpu-tests)
    $PY scripts/run_gpu_tests.py --workers "${GPU_TEST_WORKERS:-8}" --log "$OUT/gpu_tests_${GPU}_$DATE.log"
    ;;
  kernel)
    # shellcheck disable=SC2086  # KERNEL_ARGS holds several options
    $PY benchmarks/kernel_bench.py --out "$OUT" --stem "kernel_bench_${GPU}_$DATE" \
      --budget-s "${KERNEL_BUDGET_S:-7200}" ${KERNEL_ARGS:-}
    ;;
  train-step)
    # shellcheck disable=SC2086
    $PY benchmarks/train_step_bench.py --out "$OUT" --stem "train_step_paper_${GPU}_$DATE" \
      --attention "${TRAIN_STEP_ATTENTION:-auto}" \
      --grad-accum 64 --configs baseline,lr-fused --profile '' ${TRAIN_STEP_ARGS:-}
    ;;
  throughput-1b)
    throughput 1b 1B
    ;;
  throughput-4b)
    throughput 4b 4B
    ;;
  *)
    echo "unknown benchmark $1; expected grad-probe, gpu-tests, kernel, train-step, throughput-1b or throughput-4b" >&2
    return 2
    ;;
  esac
}

failed=0
for b in "${BENCHMARKS[@]}"; do
  t0=$(date +%s)
  echo "[$b] started"
  run_one "$b" >>"$OUT/$b.log" 2>&1
  rc=$?
  echo "[$b] exit $rc after $(($(date +%s) - t0)) s (log: $OUT/$b.log)"
  [ "$rc" != 75 ] || echo "[$b] stopped at its deadline; run it again with its .partial.json in $OUT to continue"
  [ "$rc" = 0 ] || failed=1
done
exit $failed

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
#   throughput-1b  the throughput stage (Table 3's protocol, Appendix I), eager, at 1B: five repeats of
#                  FLA r = d, ours r = d and r = d/4, the plain backbone and the reference router r = d/4,
#                  accumulation 2                                         -> throughput_1b_<gpu>_<date>.json
#   throughput-4b  the same at 4B: FLA r = d, ours r = d and r = d/4, accumulation 1
#                                                                         -> throughput_4b_<gpu>_<date>.json
# Each benchmark also writes <name>.log; OUT/machine.txt records the GPU, driver, torch and triton. A
# throughput benchmark keeps its finished timed runs in a .partial.json; run it again to continue.
# A failed benchmark is reported and the next one runs; the exit status is 1 if any failed.
#
# Environment: PYTHON (default python3); KERNEL_ARGS, TRAIN_STEP_ARGS and GRAD_PROBE_ARGS, more options
# for kernel_bench.py, train_step_bench.py and compiled_grad_probe.py (e.g. KERNEL_ARGS="--tokens 8192
# --skip-measured A.json"); GRAD_PROBE_DATA, a data manifest for the probe's trainings;
# KERNEL_BUDGET_S (default 7200), the time after which kernel_bench starts no new shape;
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
mkdir -p "$OUT"

# The GPU's name as a file-name word: "NVIDIA H200" -> h200
GPU=$($PY -c 'import re, sys, torch
torch.cuda.is_available() or sys.exit("run_gpu_benchmarks.sh: no CUDA GPU visible to this Python")
n = torch.cuda.get_device_name(0).lower().removeprefix("nvidia ")
print(re.sub(r"[^a-z0-9]+", "-", n).strip("-"))') || exit 1
DATE=$(date -u +%Y-%m-%d)
(date -u && nvidia-smi && $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)') \
  >"$OUT/machine.txt" 2>&1

# The throughput protocol (lrattnres/throughput/spec.py resolves and checks the spec).
throughput_spec() { # preset, methods, accumulation
  printf '{"presets": ["%s"], "methods": %s, "micro_batch": 2, "seq_len": 2048, "grad_accum": %s,
 "repeats": 5, "warmup": 3, "min_updates": 8, "max_updates": 30, "window": 6, "stride": 2, "cv": 0.01,
 "drift": 0.005, "blocks": 8, "device": "cuda", "precision": "bf16", "compile": false, "doc_len_median": 512}' "$1" "$2" "$3"
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
    $PY -m lrattnres throughput --out "$OUT/throughput_1b_${GPU}_$DATE.json" \
      --partial "$OUT/throughput_1b_${GPU}_$DATE.partial.json" --spec "$(throughput_spec 1B \
        '["fla-rd", "fused-rd", "fused-rd4", "baseline", "reference-rd4"]' 2)"
    ;;
  throughput-4b)
    $PY -m lrattnres throughput --out "$OUT/throughput_4b_${GPU}_$DATE.json" \
      --partial "$OUT/throughput_4b_${GPU}_$DATE.partial.json" --spec "$(throughput_spec 4B \
        '["fla-rd", "fused-rd", "fused-rd4"]' 1)"
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
  run_one "$b" >"$OUT/$b.log" 2>&1
  rc=$?
  echo "[$b] exit $rc after $(($(date +%s) - t0)) s (log: $OUT/$b.log)"
  [ "$rc" = 0 ] || failed=1
done
exit $failed

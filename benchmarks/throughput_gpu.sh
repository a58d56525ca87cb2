#!/usr/bin/env bash
# Table 3 on one GPU: the throughput protocol of Section 4.9 / Appendix I at the paper's 1B and 4B shapes.
#
#   OUT=/some/dir bash benchmarks/throughput_gpu.sh        # from the repository root; OUT defaults to benchmarks/results
#
# Writes $OUT/throughput_h200.json (the stage's result JSON; a run cut off by the call's time limit leaves
# its finished timed runs in $OUT/throughput_h200.partial.json, which the same command continues),
# $OUT/throughput_h200.log, $OUT/pip.log and $OUT/nvidia-smi.txt.  Copy the JSON to benchmarks/results/
# and point a config.yaml key recorded.throughput_gpu<suffix> at it (the report shows every
# recorded.throughput_gpu* file; the 2026-11-29 recordings are throughput_h200_1b.json and
# throughput_h200_4b.json, from MODE=1B and MODE=4B).
#
# Settings, chosen to fit one call of at most 9 minutes (see the deadlines):
#   1B: micro-batch 2 x 2048, 4 accumulation steps (16,384 tokens per update; the paper uses 64 steps,
#       262,144 tokens), 5 repeats, methods FLA r=d, ours r=d, ours r=d/4, plain backbone, reference r=d/4.
#   4B: micro-batch 2 x 2048, 2 accumulation steps (8,192 tokens per update), 3 repeats, the three methods
#       of Table 3 (FLA r=d, ours r=d, ours r=d/4).
#   Both: N = 8, bf16 autocast, eager (compile off: compiling five 1B and three 4B models would take
#   most of the call; the paper times fullgraph-compiled models), 3 warm-up updates, 8-30 measured updates
#   with the paper's stopping rule (two six-update windows, CV <= 1%, drift <= 0.5%), rotated method order,
#   synthetic tokens (vocabulary 100,277, log-normal documents of median 512 tokens, document masking on).
#   No new 1B repeat starts after 260 s, no new 4B repeat after 410 s; the Python process is stopped at 520 s.
# FLA: fla-core is installed from .whl/ (carry it: it is git-ignored); without it FLA is skipped with a note.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
SITE=/tmp/site
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install --no-index --no-deps --target "$SITE" .whl/*.whl > "$OUT/pip.log" 2>&1 \
    || echo "pip install of .whl/ failed (see pip.log); FLA will be skipped" | tee -a "$OUT/pip.log"
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .whl/ folder: FLA will be skipped" > "$OUT/pip.log"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee "$OUT/throughput_h200.log"
$PY -c "import fla.ops.attnres; print('fla ok')" >> "$OUT/throughput_h200.log" 2>&1 || echo "fla does not import" >> "$OUT/throughput_h200.log"

SPEC='{"presets": ["1B", "4B"], "micro_batch": 2, "seq_len": 2048, "grad_accum": 4,
 "grad_accum_by_preset": {"4B": 2}, "repeats": 5, "repeats_by_preset": {"4B": 3},
 "methods": ["fla-rd", "fused-rd", "fused-rd4", "baseline", "reference-rd4"],
 "methods_by_preset": {"4B": ["fla-rd", "fused-rd", "fused-rd4"]},
 "warmup": 3, "min_updates": 8, "max_updates": 30, "window": 6, "stride": 2, "cv": 0.01, "drift": 0.005,
 "blocks": 8, "device": "cuda", "precision": "bf16", "compile": false, "doc_len_median": 512,
 "deadline_s": {"1B": 260, "4B": 410}}'

# MODE=compiled: a second, optional call -- 1B only, torch.compile(dynamic=False) as in production training,
# ours r = d and r = d/4 and the plain backbone (FLA is left out: under compile it would run behind a graph
# break at every read, which the paper's fullgraph setup did not have); writes throughput_h200_compiled.json,
# which produces no claims (record it as throughput_gpu_compiled beside throughput_gpu).
NAME=throughput_h200
if [ "${MODE:-eager}" = compiled ]; then
  NAME=throughput_h200_compiled
  SPEC='{"presets": ["1B"], "micro_batch": 2, "seq_len": 2048, "grad_accum": 4, "repeats": 5,
 "methods": ["fused-rd", "fused-rd4", "baseline"], "warmup": 3, "min_updates": 8, "max_updates": 30,
 "window": 6, "stride": 2, "cv": 0.01, "drift": 0.005, "blocks": 8, "device": "cuda", "precision": "bf16",
 "compile": true, "doc_len_median": 512, "deadline_s": 410, "claims": false}'
fi

# MODE=1B or MODE=4B: one size per call, with every repeat the protocol asks for (five at 1B, five at 4B
# with the three methods of Table 3), fitted to one call by halving the accumulation (1B: 2, 4B: 1;
# the measured 2026-11-29 repeats took 150-210 s at 1B with accumulation 4 and 120 s at 4B with 2).
# Writes throughput_h200_1b.json / throughput_h200_4b.json: record them as throughput_gpu_1b and
# throughput_gpu_4b (the report shows every recorded.throughput_gpu* file).
if [ "${MODE:-eager}" = 1B ] || [ "${MODE:-eager}" = 4B ]; then
  NAME=throughput_h200_$(echo "$MODE" | tr B b)
  if [ "$MODE" = 1B ]; then accum=2; methods='["fla-rd", "fused-rd", "fused-rd4", "baseline", "reference-rd4"]'
  else accum=1; methods='["fla-rd", "fused-rd", "fused-rd4"]'; fi
  SPEC="{\"presets\": [\"$MODE\"], \"micro_batch\": 2, \"seq_len\": 2048, \"grad_accum\": $accum, \"repeats\": 5,
 \"methods\": $methods, \"warmup\": 3, \"min_updates\": 8, \"max_updates\": 30, \"window\": 6, \"stride\": 2,
 \"cv\": 0.01, \"drift\": 0.005, \"blocks\": 8, \"device\": \"cuda\", \"precision\": \"bf16\", \"compile\": false,
 \"doc_len_median\": 512, \"deadline_s\": 470}"
fi

timeout --signal=TERM --kill-after=10 520 \
  $PY -m lrattnres throughput --spec "$SPEC" --out "$OUT/$NAME.json" 2>&1 | tee -a "$OUT/$NAME.log"
rc=${PIPESTATUS[0]}
echo "throughput exit code $rc" | tee -a "$OUT/$NAME.log"
ls -la "$OUT"
exit 0

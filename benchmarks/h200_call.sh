#!/usr/bin/env bash
# One device call on a GPU machine: runs up to two "lanes" at once, one per GPU, each under its own
# deadline, then packs each lane's folder into $OUT/<lane>.tgz (the device tool returns at most 8 files).
#
#   OUT=/some/dir bash benchmarks/h200_call.sh kernel:540                 # one lane, 540 s
#   OUT=/some/dir bash benchmarks/h200_call.sh throughput:540+grid:540     # two lanes (two GPUs, or in turn)
#
# A part is LANE:SECONDS[+LANE:SECONDS]; each lane runs under its own time limit (SECONDS, from its
# start) and writes its results and a log.txt into its folder.  Two lanes run at once, one per GPU,
# when two GPUs are visible; otherwise one after the other.
#   kernel      tests/test_kernels.py -m gpu, then benchmarks/kernel_bench.py at 8192 tokens
#   kernel4096  benchmarks/kernel_bench.py at 4096 tokens (no check), then benchmarks/kernel_sweep.py
#   kgrid8192   benchmarks/kernel_bench.py at 8192 tokens alone (its bf16 check first; no pytest)
#   kgrid4096   benchmarks/kernel_bench.py at 4096 tokens alone (no check, no torch.compile row)
#               (SKIP8192 / SKIP4096 leave out the first shapes of each, measured by an earlier call; SKIP_MEASURED=JSON
#               those a kernel_bench result has, but for the widths in REDO_WIDTHS; GRID_TESTS=EXPR runs the
#               kernel tests pytest -k EXPR selects first, in lane kgrid8192; SHAPES8192 / SHAPES4096=NxdxSxr,...
#               measure those shapes instead of the grid; VARIANTS="LABEL:ATTR=VALUE[;...] ..." also times ours
#               with those kernels.op settings, e.g. scaled:RES_BITS=false defer16:DEFER_MAX_S=16; VARIANTS8192 /
#               VARIANTS4096 for one of the two lanes)
#   ktests4096  the kernels' GPU suite (TESTS_K=EXPR selects; TESTS_S, default 380 s), then lane kgrid4096
#   sweep       benchmarks/kernel_sweep.py
#   train       benchmarks/train_step_bench.py (1B)
#   trainflex   the 1B step with flex document masking (ATTN=sdpa for the dense mask): baseline, LR and
#               AttnRes with the fused kernel, then the reference routers with what time is left
#   sweeptrain  kernel_sweep.py at the 1B step's shapes (4096 tokens, S 3-9), then kernel_bench at 4096 tokens
#   hostprof    host_overhead.py --cprofile, then baseline and LR-AttnRes 1B updates under cProfile
#   argscheck   GPU tests of kernels and attention, flex_mask_check.py, kernel_sweep of both kernel pairs at 4096 tokens
#   trainargs   the 1B step (ATTN, default flex): baseline, LR via the triton_op and via the custom op, AttnRes
#   paper1      the 1B step under the paper's protocol (accumulation 64, flex): baseline and LR-AttnRes fused
#   paper2      the same for AttnRes fused and both reference routers
#   ksweep      kernel_sweep.py --quick at the 1B step's and the goals' shapes (SHAPES overrides; SHAPE_S caps a shape;
#               ONLY=fwd|bwd one kernel; EXTRA="KIND=JSON ..." more configurations; QUICK=0 every candidate)
#   ksweep2     tests/test_kernels.py on the GPU (TESTS=0: not), then ksweep at SHAPES2 (results stem STEM2; ONLY2,
#               EXTRA2, QUICK2 where set replace ONLY, EXTRA, QUICK)
#   kmix        ksweep2, then kgrid4096 with the time left
#   kcheck      tests/test_kernels.py on the GPU (all of it: the interpreter cases run in fp32 on CUDA), then
#               kernel_bench.py at 8192 tokens (the goals' S = 9 shapes first) with the default variant
#   kncu        Nsight Compute counters of one forward+backward, ours and fast-attnres, at 8192 tokens,
#               d = 1536, r = 384 (NCU_SHAPE=TOKENSxDxR), S = 9 and 2 (NCU_S) (benchmarks/ncu_profile.py;
#               NCU_VARIANTS adds variants of ours as LABEL=JSON overrides, space-separated; NCU_BASE=""
#               leaves out the plain runs), then the summary table
#   kgpuncu     tests/test_kernels.py on the GPU (all of it), then kncu
#   traingrid   train, then as much of the gpu scale as fits (benchmarks/gpu_grid.sh)
#   grid        benchmarks/gpu_grid.sh alone
#   throughput  benchmarks/throughput_gpu.sh (Table 3 at 1B and 4B; needs about 530 s; MODE=1B or MODE=4B in
#               the environment runs one size with every repeat of the protocol)
# Provenance: the device's copy of the tree may carry a stale .git, so name the commit in the command:
#   LRATTNRES_COMMIT=<hash of HEAD here> OUT=$OUT bash benchmarks/h200_call.sh ...
# Wheels: .whl/ (fla-core, fast-attnres) and .whl_smk/ (snakemake and its needs) are installed into
# /tmp/site when present; carry them (they are git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
PART=${1:?name the lanes, e.g. kernel+train}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHON=${PYTHON:-python3}
T0=$(date +%s)
LANES=/tmp/lanes
mkdir -p "$LANES" "$OUT"

for dir in .whl .whl_smk; do
  if compgen -G "$dir/*.whl" > /dev/null; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $dir/*.whl \
      > "$OUT/pip_$dir.log" 2>&1 || echo "pip install of $dir failed" >> "$OUT/pip_$dir.log"
  fi
done
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"
NGPU=$($PYTHON -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
{ date -u; nvidia-smi; $PYTHON -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; nproc; } \
  > "$OUT/machine.txt" 2>&1
echo "GPUs: $NGPU; part $PART"

left() { echo $(( $1 - ($(date +%s) - LT0) )); }  # seconds left until $1 seconds after the lane's start

lane_kernel() {
  timeout 150 $PYTHON -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -m gpu 2>&1 | tail -25
  $PYTHON benchmarks/kernel_bench.py --out "$L" --tokens 8192 --budget-s "$(left $((DUR - 70)))"
}
lane_kernel4096() {
  $PYTHON benchmarks/kernel_bench.py --out "$L" --tokens 4096 --no-check --stem kernel_bench_4096 --budget-s "$(left $((DUR - 150)))"
  $PYTHON benchmarks/kernel_sweep.py --out "$L" --budget-s "$(left $((DUR - 20)))"
}
grid_skip() {  # kernel_bench's options for the shapes measured before (SKIP_MEASURED=JSON, REDO_WIDTHS=d,d)
  [ -n "${SKIP_MEASURED:-}" ] && echo --skip-measured "$SKIP_MEASURED" ${REDO_WIDTHS:+--redo-widths "$REDO_WIDTHS"}
}
grid_shapes() {  # this lane's own shape list instead of the grid (SHAPES8192 / SHAPES4096: NxdxSxr,...)
  [ -n "${1:-}" ] && echo --shapes "$1"
}
grid_variants() {  # VARIANTS="LABEL:ATTR=VALUE[;...] ...": kernel_bench also times ours with these kernels.op settings
  local v  # (VARIANTS8192 / VARIANTS4096, where set, for lane kgrid8192 / kgrid4096)
  for v in ${1-${VARIANTS:-}}; do echo --variant "$v"; done
}
lane_kgrid8192() {  # the side-by-side grid at 8192 tokens (kernel_bench's own bf16 check first, unless skipping)
  if [ -n "${GRID_TESTS:-}" ]; then  # a subset of the kernels' GPU tests first (a pytest -k expression)
    timeout 240 $PYTHON -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "$GRID_TESTS" -rA --tb=short 2>&1 \
      | tee "$L/pytest.txt" | grep -v "^PASSED" | tail -20
  fi
  $PYTHON benchmarks/kernel_bench.py --out "$L" --tokens 8192 --stem kernel_bench_8192 --skip "${SKIP8192:-0}" $(grid_skip) \
    $(grid_shapes "${SHAPES8192:-}") $(grid_variants ${VARIANTS8192+"$VARIANTS8192"}) --budget-s "$(left $((DUR - 60)))" \
    $([ "${SKIP8192:-0}" -gt 0 ] || [ -n "${SKIP_MEASURED:-}" ] || [ -n "${SHAPES8192:-}" ] && echo --no-check)
}
lane_kgrid4096() {
  $PYTHON benchmarks/kernel_bench.py --out "$L" --tokens 4096 --no-check --no-compile --stem kernel_bench_4096 \
    --skip "${SKIP4096:-0}" $(grid_skip) $(grid_shapes "${SHAPES4096:-}") $(grid_variants ${VARIANTS4096+"$VARIANTS4096"}) --budget-s "$(left $((DUR - 60)))"
}
lane_sweep() { $PYTHON benchmarks/kernel_sweep.py --out "$L" --budget-s "$(left $((DUR - 20)))"; }
lane_train() {
  TORCHINDUCTOR_COMPILE_THREADS=16 $PYTHON benchmarks/train_step_bench.py --out "$L" --budget-s "$(left $((DUR - 60)))"
}
lane_traingrid() {
  TORCHINDUCTOR_COMPILE_THREADS=16 $PYTHON benchmarks/train_step_bench.py --out "$L" --grad-accum 8 --budget-s "${TRAIN_S:-300}"
  OUT="$L/grid" DEADLINE_S=$(left $((DUR - 15))) PYTHON=$PYTHON bash benchmarks/gpu_grid.sh
}
lane_trainflex() {  # the 1B step with flex document masking (ATTN=sdpa to compare), then the reference routers
  TORCHINDUCTOR_COMPILE_THREADS=16 $PYTHON benchmarks/train_step_bench.py --out "$L" --stem train_step_bench_${ATTN:-flex} \
    --attention "${ATTN:-flex}" --grad-accum 8 --configs baseline,lr-fused,attnres-fused --budget-s "$(left $((DUR - 300)))"
  TORCHINDUCTOR_COMPILE_THREADS=16 $PYTHON benchmarks/train_step_bench.py --out "$L" --stem train_step_bench_${ATTN:-flex}_ref \
    --attention "${ATTN:-flex}" --grad-accum 8 --configs attnres-ref,lr-ref --profile '' --budget-s "$(left $((DUR - 290)))"
}
lane_sweeptrain() {  # launch configurations at the 1B step's shapes (4096 tokens, S 3-9), then the 4096-token grid
  $PYTHON benchmarks/kernel_sweep.py --out "$L" --budget-s "$(left 260)" \
    --shapes 4096x1536x9x384,4096x1536x6x384,4096x1536x3x384,4096x1536x9x1536,4096x1536x6x1536,8192x1536x9x384
  $PYTHON benchmarks/kernel_bench.py --out "$L" --tokens 4096 --no-check --stem kernel_bench_4096 --budget-s "$(left $((DUR - 30)))"
}
lane_hostprof() {  # where the host's time goes: the launchers under cProfile, then the 1B step's updates
  $PYTHON benchmarks/host_overhead.py --out "$L" --S 6 --tokens 4096 --cprofile
  TORCHINDUCTOR_COMPILE_THREADS=16 $PYTHON benchmarks/train_step_bench.py --out "$L" --stem train_step_bench_hostprof \
    --attention "${ATTN:-sdpa}" --grad-accum 8 --configs baseline,lr-fused --profile '' \
    --host-profile baseline,lr-fused --budget-s "$(left $((DUR - 100)))"
}
lane_argscheck() {  # GPU tests (kernels incl. the compiled triton_op path, attention), the flex mask check, sweep
  timeout 240 $PYTHON -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_attention.py -m gpu -rA 2>&1 \
    | grep -v "^PASSED" | tail -40
  timeout 100 $PYTHON benchmarks/flex_mask_check.py --out "$L"
  $PYTHON benchmarks/kernel_sweep.py --out "$L" --budget-s "$(left $((DUR - 20)))" \
    --shapes 4096x1536x9x384:args,4096x1536x9x384:table,4096x1536x6x384:args,4096x1536x3x384:args
}
lane_trainargs() {  # the 1B step: LR through the triton_op and through the custom op, AttnRes, baseline (ATTN, CONFIGS)
  TORCHINDUCTOR_COMPILE_THREADS=8 $PYTHON benchmarks/train_step_bench.py --out "$L" --stem train_step_bench_args_${ATTN:-flex} \
    --attention "${ATTN:-flex}" --grad-accum 8 --configs "${CONFIGS:-baseline,lr-fused,lr-fused-op,attnres-fused}" \
    --profile lr-fused --budget-s "$(left $((DUR - 100)))"
}
paper_step() {  # the paper's protocol (microbatch 2, 64 accumulation steps: 262,144 tokens per update), flex masking
  TORCHINDUCTOR_COMPILE_THREADS=8 $PYTHON benchmarks/train_step_bench.py --out "$L" --stem "$1" --attention flex \
    --grad-accum 64 --configs "$2" --profile '' --budget-s "$3"
}
lane_paper1() { paper_step train_step_bench_paper_main baseline,lr-fused "$(left 300)"; }
lane_paper2() { paper_step train_step_bench_paper_other attnres-fused,lr-ref,attnres-ref "$(left 400)"; }
lane_ksweep() {  # ONLY=fwd or bwd sweeps one kernel; SHAPE_S caps each shape's seconds; QUICK=0 every candidate;
  local x extra=()  # EXTRA="KIND=JSON ..." (JSON without spaces) also times those configurations
  for x in ${EXTRA:-}; do extra+=(--extra "$x"); done
  $PYTHON benchmarks/kernel_sweep.py --out "$L" --stem "${STEM:-kernel_sweep_final}" --budget-s "$(left $((DUR - 20)))" \
    $([ "${QUICK:-1}" = 1 ] && echo --quick) ${ONLY:+--only "$ONLY"} ${SHAPE_S:+--shape-budget-s "$SHAPE_S"} "${extra[@]}" \
    --shapes "${SHAPES:-4096x1536x9x384,8192x1536x9x384,4096x1536x9x384:args,8192x1024x9x256,4096x1536x3x384}"
}
lane_ksweep2() {  # a second sweep lane: the kernels' GPU tests first (TESTS=0 leaves them out, TESTS_K=EXPR runs
  if [ "${TESTS:-1}" = 1 ]; then  # those pytest -k EXPR selects), then SHAPES2
    timeout "${TESTS_S:-300}" $PYTHON -m pytest -q -p no:cacheprovider tests/test_kernels.py ${TESTS_K:+-k "$TESTS_K"} -rA \
      --tb=short 2>&1 | tee "$L/pytest.txt" \
      | grep -v "^PASSED" | tail -30
  fi
  SHAPES=$SHAPES2 STEM=${STEM2:-kernel_sweep_final2} ONLY=${ONLY2-${ONLY:-}} EXTRA=${EXTRA2-${EXTRA:-}} \
    QUICK=${QUICK2-${QUICK:-1}} lane_ksweep
}
lane_kmix() {  # the kernels' GPU tests (TESTS_K), a sweep of SHAPES2 (ONLY, SHAPE_S), then the 4096-token grid lane
  lane_ksweep2
  lane_kgrid4096
}
lane_ktests4096() {  # the kernels' GPU suite (TESTS_K=EXPR: pytest -k EXPR; TESTS_S seconds at most), then kgrid4096
  timeout "${TESTS_S:-380}" $PYTHON -m pytest -q -p no:cacheprovider tests/test_kernels.py ${TESTS_K:+-k "$TESTS_K"} -rA --tb=short 2>&1 \
    | tee "$L/pytest.txt" | grep -v "^PASSED" | tail -30
  lane_kgrid4096
}
lane_kcheck() {
  timeout 380 $PYTHON -m pytest -q -p no:cacheprovider tests/test_kernels.py -rA --tb=short 2>&1 | tee "$L/pytest.txt" \
    | grep -v "^PASSED" | tail -40
  $PYTHON benchmarks/kernel_bench.py --out "$L" --tokens 8192 --no-compile --budget-s "$(left $((DUR - 30)))"
}
lane_kncu() {
  local ncu
  ncu=$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
  [ -n "$ncu" ] || { echo "no ncu on this machine"; return 1; }
  local tok dd rr
  IFS=x read -r tok dd rr <<< "${NCU_SHAPE:-8192x1536x384}"  # tokens x d x r
  NCU_DESC="$tok tokens, d=$dd, r=$rr" $PYTHON -c 'import json, datetime, os, torch, triton; print(json.dumps({
    "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
    "shape": os.environ["NCU_DESC"],
    "commit": os.environ.get("LRATTNRES_COMMIT"),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}))' > "$L/meta.json"
  "$ncu" --version > "$L/ncu_version.txt" 2>&1
  local runs=(${NCU_BASE-ours= fast-attnres=}) S label ov impl  # NCU_BASE="" profiles the variants alone
  for v in ${NCU_VARIANTS:-}; do runs+=("$v"); done
  for S in ${NCU_S:-9 2}; do
    for spec in "${runs[@]}"; do
      label=${spec%%=*}; ov=${spec#*=}; impl=ours
      [ "$label" = fast-attnres ] && impl=fast-attnres
      [ "$(left $((DUR - 40)))" -gt 0 ] || break 2
      timeout "$(left $((DUR - 30)))" "$ncu" --clock-control none --profile-from-start off --csv --page raw \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum \
        $PYTHON benchmarks/ncu_profile.py run --impl $impl --S "$S" --tokens "$tok" --d "$dd" --r "$rr" \
        ${ov:+--override "$ov"} > "$L/${label}_S$S.csv" 2> "$L/${label}_S$S.err"
      echo "ncu $label S=$S exit $? at $(( $(date +%s) - LT0 ))s"
    done
  done
  $PYTHON benchmarks/ncu_profile.py summarize "$L" && cat "$L/ncu_summary.md"
}
lane_kgpuncu() {  # the kernels' GPU tests, then lane kncu with the time left
  timeout 380 $PYTHON -m pytest -q -p no:cacheprovider tests/test_kernels.py -rA --tb=short 2>&1 \
    | tee "$L/pytest.txt" | grep -v "^PASSED" | tail -30
  lane_kncu
}
lane_grid() { OUT="$L" DEADLINE_S=$(left $((DUR - 15))) PYTHON=$PYTHON bash benchmarks/gpu_grid.sh; }
lane_throughput() { OUT="$L" PYTHON=$PYTHON bash benchmarks/throughput_gpu.sh; }
export -f grid_skip grid_shapes grid_variants lane_ktests4096 lane_kmix lane_kncu lane_kgpuncu lane_kgrid8192 lane_kgrid4096 lane_ksweep lane_ksweep2 lane_kcheck left paper_step lane_paper1 lane_paper2 lane_argscheck lane_trainargs lane_kernel lane_kernel4096 lane_sweep lane_train lane_trainflex lane_sweeptrain lane_hostprof lane_traingrid lane_grid lane_throughput

run_lane() {  # name:seconds gpu-list cpu-list
  local name=${1%%:*} dur=${1##*:} gpus=$2 cpus=$3
  local dir=$LANES/$name
  mkdir -p "$dir"
  local pin=()
  if [ -n "$cpus" ] && taskset -c "$cpus" true 2> /dev/null; then pin=(taskset -c "$cpus"); fi
  CUDA_VISIBLE_DEVICES=$gpus L=$dir DUR=$dur LT0=$(date +%s) \
    timeout --signal=TERM --kill-after=15 "$dur" "${pin[@]}" bash -c "lane_$name" > "$dir/log.txt" 2>&1
  echo "lane $name exit $? at $(( $(date +%s) - T0 ))s" | tee -a "$dir/log.txt"
}

IFS=+ read -r -a names <<< "$PART"
half=$(( $(nproc) / 2 ))
if [ "${#names[@]}" -eq 2 ] && [ "$NGPU" -ge 2 ]; then
  run_lane "${names[0]}" 0 "0-$((half - 1))" &
  run_lane "${names[1]}" 1 "$half-$(( $(nproc) - 1 ))" &
  wait
else
  for n in "${names[@]}"; do run_lane "$n" 0 ""; done
fi

for n in "${names[@]}"; do
  n=${n%%:*}
  tar -C "$LANES" -czf "$OUT/$n.tgz" "$n"
  echo "=== $n: tail of log"
  tail -n 30 "$LANES/$n/log.txt"
done
ls -la "$OUT"
echo "call done at $(( $(date +%s) - T0 ))s"

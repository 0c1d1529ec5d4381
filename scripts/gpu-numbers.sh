#!/usr/bin/env bash
# The GPU checks and numbers in one short run (needs CUDA), in priority order, so that a run cut short still leaves
# the most important ones: the CUDA-marked tests; AR on $MODEL in bf16 under CUDA graphs, then compiled, int8 and
# fp8 (tok/s, and the share of the card's nominal and measured copy bandwidth); ISD N=4 (preset isd-n4) at
# --oracle-accept 0.85 against its ideal TPF; the MoE step of $MOE_MODEL under graphs against a dense step of its
# active width; canvas fast-dllm-dual against its cache=none twin on $CANVAS_MODEL; the forward costs of $MODEL
# (forwards.json: its `by_rows` table is what device projections price runs with); the concurrency sweep; tensor
# and expert parallelism on 2 GPUs or more. `make gpu-numbers` runs it with the venv's Python; a GPU machine
# without the venv runs
#   PYTHON=python3 scripts/gpu-numbers.sh
# Each step's output and log land in $DIR as it ends (stdout NAME.json, or the tests' text; stderr NAME.log); a step
# past STEP_TIMEOUT is cut off and the others go on; no step starts after BUDGET seconds (the rest are listed as
# skipped). Then scripts/gpu_numbers_summary.py prints one screen and writes $DIR/summary.json (`--readme README.md`
# puts its table into the README). The exit status counts the failed steps.
# Knobs: STEPS (the groups, in this order: tests ar compile int8 fp8 isd moe canvas forwards concurrency parallel),
# MODEL, MOE_MODEL, CANVAS_MODEL, TOKENS (per answer; a multiple of the canvas block, 32), REPEATS, CONCURRENCY,
# N_PROMPTS, STEP_TIMEOUT, BUDGET, DEVICE=cpu (a dry run of the steps themselves, on small models).
set -uo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-random:qwen3-8b}
MOE_MODEL=${MOE_MODEL:-random:llada2-mini}
CANVAS_MODEL=${CANVAS_MODEL:-random:llada-8b}
TOKENS=${TOKENS:-128}
REPEATS=${REPEATS:-1}
CONCURRENCY=${CONCURRENCY:-1 4 16 64}
N_PROMPTS=${N_PROMPTS:-64}
DEVICE=${DEVICE:-cuda}
STEP_TIMEOUT=${STEP_TIMEOUT:-120}
BUDGET=${BUDGET:-290}
STEPS=" ${STEPS:-tests ar compile int8 fp8 isd moe canvas forwards concurrency parallel} "
DIR=${DIR:-gpu-numbers}
mkdir -p "$DIR"
: > "$DIR/steps.txt"
failed=0
start=$SECONDS

# step NAME.EXT COMMAND...: stdout to $DIR/NAME.EXT (a JSON report, or the tests' text), stderr to $DIR/NAME.log
step() {
  local out=$1; shift
  local name=${out%.*}
  if (( SECONDS - start >= BUDGET )); then
    echo "$name: skipped (the run's $BUDGET s were spent)" | tee -a "$DIR/steps.txt"
    return
  fi
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" > "$DIR/$out" 2> "$DIR/$name.log"
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s" | tee -a "$DIR/steps.txt"
  if [ $rc -ne 0 ]; then
    failed=$((failed + 1))
    tail -n 15 "$DIR/$name.log"
  fi
}

wants() { [[ $STEPS == *" $1 "* ]]; }

studio=("$PYTHON" -m studio)
ar=(bench --model "$MODEL" --device "$DEVICE" --json -s ar --max-new-tokens "$TOKENS" --repeats "$REPEATS"
    --no-transformers)
wants tests && step cuda-tests.txt "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda \
  tests/engine/test_verify_kernel.py tests/engine/test_graphs.py tests/engine/test_device.py tests/engine/test_moe.py tests/engine/test_cuda_exact.py \
  tests/engine/test_norm.py tests/engine/test_quant_kernel.py tests/engine/test_compiled.py
wants ar && step ar.json "${studio[@]}" "${ar[@]}"
wants compile && step ar-compiled.json "${studio[@]}" "${ar[@]}" --compile --no-graphs   # compile runs without graphs
wants int8 && step ar-int8.json "${studio[@]}" "${ar[@]}" --quant int8
wants fp8 && step ar-fp8.json "${studio[@]}" "${ar[@]}" --quant fp8
wants isd && step isd-oracle-0.85.json "${studio[@]}" bench --model "$MODEL" --device "$DEVICE" --json -s ar,isd-n4 \
  --oracle-accept 0.85 --max-new-tokens "$TOKENS" --repeats "$REPEATS" --no-transformers
wants moe && step moe-forwards.json "${studio[@]}" bench forwards --model "$MOE_MODEL" --device "$DEVICE" --json \
  --repeats "$REPEATS"
wants canvas && step canvas-dual.json "${studio[@]}" bench --model "$CANVAS_MODEL" --device "$DEVICE" --json \
  -s fast-dllm-dual --max-new-tokens "$TOKENS" --repeats "$REPEATS" --no-transformers
if wants forwards; then
  step forwards.json "${studio[@]}" bench forwards --model "$MODEL" --device "$DEVICE" --json --repeats "$REPEATS"
fi
if wants concurrency; then
  "$PYTHON" -c "from studio.train.prompts import eval_prompts; print(*eval_prompts($N_PROMPTS), sep='\n')" \
    > "$DIR/prompts.txt" || exit 1
  for c in $CONCURRENCY; do
    step "concurrency-$c.json" "${studio[@]}" bench --model "$MODEL" --device "$DEVICE" --json -s ar,isd \
      --concurrency "$c" --prompts "$DIR/prompts.txt" --max-new-tokens "$TOKENS" --repeats 1 --no-transformers
  done
fi
# tensor and expert parallelism, where the machine has 2 GPUs or more (NCCL): AR and r-isd at --tp 2 beside --tp 1;
# the MoE model's AR with its experts placed across 2 GPUs (--ep 2) and split by columns (--tp 2)
if wants parallel && [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  tp=(bench --model "$MODEL" --device "$DEVICE" --json -s ar,r-isd --max-new-tokens "$TOKENS" --repeats "$REPEATS")
  step tp-2.json "${studio[@]}" "${tp[@]}" --tp 2
  step tp-1.json "${studio[@]}" "${tp[@]}"
  moe=(bench --model "$MOE_MODEL" --device "$DEVICE" --json --no-transformers -s ar --max-new-tokens "$TOKENS")
  step ep-2.json "${studio[@]}" "${moe[@]}" --ep 2 --repeats "$REPEATS"
  step moe-tp-2.json "${studio[@]}" "${moe[@]}" --tp 2 --repeats "$REPEATS"
elif wants parallel; then
  echo "tp-2, ep-2: skipped (one GPU)" | tee -a "$DIR/steps.txt"
fi
echo "$failed step(s) failed in $((SECONDS - start)) s" | tee -a "$DIR/steps.txt"
"$PYTHON" scripts/gpu_numbers_summary.py "$DIR"
exit $failed

#!/usr/bin/env bash
# The GPU checks and numbers in one go (needs CUDA): first the CUDA-marked tests (the verify kernel compiled, graphs,
# grouped-GEMM experts, the lossless strategies on the GPU paths), then forward costs with copy bandwidth and verify
# time, AR with and without graphs beside transformers, ISD at a controlled acceptance, the MoE shapes' forwards, and
# throughput at concurrency 1/4/16/64. `make gpu-numbers` runs it with the venv's Python; a GPU machine without the
# venv (whose own python has torch) runs it as
#   PYTHON=python3 scripts/gpu-numbers.sh
# Every step runs even when one fails (its log says why); each JSON lands in $DIR as it is made, and the exit status
# counts the failed steps. Knobs: MODEL, MOE_MODELS, REPEATS, CONCURRENCY, N_PROMPTS, STEP_TIMEOUT (seconds),
# EAGER_TOKENS (ar without graphs is ~5x slower a token), STEPS (the groups to run, in this order, when GPU time is short:
# tests ar forwards moe concurrency parallel), DEVICE=cpu (a dry run of the steps themselves, on a small MODEL).
set -uo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-random:qwen3-8b}
MOE_MODELS=${MOE_MODELS:-llada2-mini diffusiongemma-26b-a4b}
REPEATS=${REPEATS:-3}
CONCURRENCY=${CONCURRENCY:-1 4 16 64}
N_PROMPTS=${N_PROMPTS:-64}
DEVICE=${DEVICE:-cuda}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
EAGER_TOKENS=${EAGER_TOKENS:-64}
STEPS=" ${STEPS:-tests ar forwards moe concurrency parallel} "
DIR=${DIR:-gpu-numbers}
mkdir -p "$DIR"
failed=0

step() {   # step NAME COMMAND...: stdout to $DIR/NAME.json, stderr to $DIR/NAME.log
  local name=$1; shift
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" > "$DIR/$name.json" 2> "$DIR/$name.log"
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s" | tee -a "$DIR/steps.txt"
  if [ $rc -ne 0 ]; then
    failed=$((failed + 1))
    tail -n 15 "$DIR/$name.log"
  fi
}

wants() { [[ $STEPS == *" $1 "* ]]; }

wants tests && step cuda-tests "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests/engine/test_verify_kernel.py \
  tests/engine/test_graphs.py tests/engine/test_device.py tests/engine/test_moe.py tests/engine/test_cuda_exact.py \
  tests/engine/test_norm.py
bench=("$PYTHON" -m studio bench --model "$MODEL" --device "$DEVICE" --json)
if wants ar; then
  # AR with graphs beside transformers generate, and ISD at a controlled acceptance against that AR, in one process
  step ar-isd-oracle-0.85 "${bench[@]}" -s ar,isd --oracle-accept 0.85 --max-new-tokens 256 --repeats "$REPEATS"
  step ar-eager "${bench[@]}" -s ar --max-new-tokens "$EAGER_TOKENS" --repeats "$REPEATS" --no-graphs --no-transformers
fi
wants forwards && step forwards "$PYTHON" -m studio bench forwards --model "$MODEL" --device "$DEVICE" --json \
  --repeats "$REPEATS"
if wants moe; then
  for m in $MOE_MODELS; do
    step "forwards-${m%@*}" "$PYTHON" -m studio bench forwards --model "random:$m" --device "$DEVICE" --json \
      --repeats "$REPEATS"
  done
fi
if wants concurrency; then
  "$PYTHON" -c "from studio.train.prompts import eval_prompts; print(*eval_prompts($N_PROMPTS), sep='\n')" \
    > "$DIR/prompts.txt" || exit 1
  for c in $CONCURRENCY; do
    step "concurrency-$c" "${bench[@]}" -s ar,isd --concurrency "$c" --prompts "$DIR/prompts.txt" \
      --max-new-tokens 128 --repeats 1 --no-transformers
  done
fi
# tensor and expert parallelism, where the machine has 2 GPUs or more (NCCL): AR and r-isd at --tp 2 beside --tp 1;
# the first MoE model's AR with its experts placed across 2 GPUs (--ep 2) and split by columns (--tp 2)
if wants parallel && [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  step tp-2 "${bench[@]}" -s ar,r-isd --tp 2 --max-new-tokens 256 --repeats "$REPEATS"
  step tp-1 "${bench[@]}" -s ar,r-isd --max-new-tokens 256 --repeats "$REPEATS"
  moe=(bench --model "random:${MOE_MODELS%% *}" --device "$DEVICE" --json --no-transformers -s ar --max-new-tokens 128)
  step ep-2 "$PYTHON" -m studio "${moe[@]}" --ep 2 --repeats "$REPEATS"
  step moe-tp-2 "$PYTHON" -m studio "${moe[@]}" --tp 2 --repeats "$REPEATS"
elif wants parallel; then
  echo "tp-2, ep-2: skipped (one GPU)" | tee -a "$DIR/steps.txt"
fi
echo "$failed step(s) failed" | tee -a "$DIR/steps.txt"
exit $failed

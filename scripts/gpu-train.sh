#!/usr/bin/env bash
# The training campaign of every shipped adapter in one short GPU run (docs/training.md#the-gpu-campaign):
# self-distilled data at scale, then r-isd, jacobi, mdm + trajectory compression, isd, block and the DFlash drafter,
# in that order, each
# from the shipped adapter and within its share of the time; then every new adapter is evaluated beside the shipped
# one on held-out prompts, and the ones with a higher TPF at unchanged exactness are packed under $DIR/winners.
# Each trainer checkpoints as it goes, so a run cut off at any point leaves usable adapters and their records.
# `make gpu-train` runs it with the venv's Python; a GPU machine without the venv runs
#   PYTHON=python3 scripts/gpu-train.sh
# Knobs: SECONDS_PER_STAGE (the stage budgets, in order: data risd jacobi mdm tc isd block dflash), STEPS_PER_STAGE (each
# trainer's step count, which sets its warmup and cosine: a budget that runs out first leaves the schedule part-way),
# N_PROMPTS (prompts answered), MAX_NEW (their answer length), N_EVAL (held-out prompts per evaluation), STAGES,
# MODEL, DEVICE, DTYPE, SHIPPED=0 (train from scratch and keep every adapter: a model with no shipped ones),
# BATCH (training sequences per step), DATA_BATCH (prompts answered at once), JACOBI_BLOCK, CANVAS (the canvas
# length trajectory compression records), EVAL_NEW (tokens per evaluated answer), DFLASH_TAPS, DIR.
set -uo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-default}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
DIR=${DIR:-gpu-train}
N_PROMPTS=${N_PROMPTS:-32768}
MAX_NEW=${MAX_NEW:-160}
N_EVAL=${N_EVAL:-16}
BATCH=${BATCH:-32}
DATA_BATCH=${DATA_BATCH:-512}
SHIPPED=${SHIPPED:-1}
JACOBI_BLOCK=${JACOBI_BLOCK:-16}
CANVAS=${CANVAS:-64}
EVAL_NEW=${EVAL_NEW:-128}
DFLASH_TAPS=${DFLASH_TAPS:-1,14,27}   # the target layers the drafter reads (the embedded model's 30)
STAGES=" ${STAGES:-data risd jacobi mdm tc isd block dflash eval} "
read -r T_DATA T_RISD T_JACOBI T_MDM T_TC T_ISD T_BLOCK T_DFLASH <<< "${SECONDS_PER_STAGE:-60 70 70 30 30 25 25 30}"
read -r S_RISD S_JACOBI S_MDM S_TC S_ISD S_BLOCK S_DFLASH <<< "${STEPS_PER_STAGE:-1000 600 400 400 400 400 1500}"
mkdir -p "$DIR"
failed=0
studio=("$PYTHON" -m studio)
common=(--model "$MODEL" --device "$DEVICE" --dtype "$DTYPE")

step() {   # step NAME COMMAND...: stdout to $DIR/NAME.out (a JSON report where --json), stderr to $DIR/NAME.log
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$DIR/$name.out" 2> "$DIR/$name.log"
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s" | tee -a "$DIR/steps.txt"
  if [ $rc -ne 0 ]; then
    failed=$((failed + 1))
    tail -n 15 "$DIR/$name.log" "$DIR/$name.out"
  fi
}

wants() { [[ $STAGES == *" $1 "* ]]; }

init() {   # init SHIPPED_NAME: the option that starts a stage from the shipped adapter, when there is one
  [ "$SHIPPED" = 1 ] && echo "--init $1"
}

resume() {   # resume DIR: continue a stage that a cut-off campaign left
  [ -e "$1" ] && echo "--resume"
}

data="$DIR/data"
wants data && step data "${studio[@]}" train data --out "$data" --n-prompts "$N_PROMPTS" --max-new-tokens "$MAX_NEW" \
  --batch-size "$DATA_BATCH" --seed 3 --time-budget "${T_DATA}s" $(resume "$data/manifest.json") "${common[@]}"
train=("${studio[@]}" train)
shared=(--data "$data" --batch-size "$BATCH" --save-every 20 "${common[@]}")
# shellcheck disable=SC2046  # init/resume print whole options or nothing
wants risd && step risd "${train[@]}" idlm --out "$DIR/risd" --gate mask --start-stride 4 --mask-loss kl \
  --steps "$S_RISD" --lr 5e-4 --time-budget "${T_RISD}s" $(init smollm2-risd) $(resume "$DIR/risd/train_state.json") \
  "${shared[@]}"
wants jacobi && step jacobi "${train[@]}" jacobi --out "$DIR/jacobi" --block-size "$JACOBI_BLOCK" --record-batch 128 \
  --steps "$S_JACOBI" --time-budget "${T_JACOBI}s" $(resume "$DIR/jacobi/trajectories.jsonl") "${shared[@]}"
wants mdm && step mdm "${train[@]}" mdm --out "$DIR/mdm" --steps "$S_MDM" --lr 5e-4 --time-budget "${T_MDM}s" \
  $(init smollm2-mdm) $(resume "$DIR/mdm/train_state.json") "${shared[@]}"
mdm_init=smollm2-mdm
[ -e "$DIR/mdm/adapter_config.json" ] && mdm_init="$DIR/mdm"
wants tc && step tc "${train[@]}" tc --out "$DIR/tc" --init "$mdm_init" --max-new-tokens "$CANVAS" --steps "$S_TC" \
  --time-budget "${T_TC}s" $(resume "$DIR/tc/golden.jsonl") "${shared[@]}"
wants isd && step isd "${train[@]}" idlm --out "$DIR/isd" --gate all --clean-loss kl --start-stride 3 --stride 3 \
  --steps "$S_ISD" --lr 5e-4 --time-budget "${T_ISD}s" $(init smollm2-isd) $(resume "$DIR/isd/train_state.json") \
  "${shared[@]}"
wants block && step block "${train[@]}" block --out "$DIR/block" --steps "$S_BLOCK" --lr 5e-4 \
  --time-budget "${T_BLOCK}s" $(init smollm2-block) $(resume "$DIR/block/train_state.json") "${shared[@]}"

# the drafter from scratch (only it learns: the target's taps are computed once per answer); "shipped" is the one in
# studio/presets/drafters, which the evaluation below measures beside it
wants dflash && step dflash "${train[@]}" dflash --out "$DIR/dflash" --layers 2 --taps "$DFLASH_TAPS" --block-size 8 --gamma 4 \
  --anchors 16 --steps "$S_DFLASH" --lr 1e-3 --time-budget "${T_DFLASH}s" $(resume "$DIR/dflash/train_state.json") \
  "${shared[@]}"

if wants eval; then
  # name, shipped adapter, the strategies it is for
  for row in "risd smollm2-risd r-isd" "jacobi none jacobi,jacobi-mr-cpu" "mdm smollm2-mdm canvas-cpu" \
             "tc smollm2-mdm canvas-cpu" "isd smollm2-isd isd" "block smollm2-block s2d2-cpu,simsd-cpu" \
             "dflash studio/presets/drafters/smollm2-dflash dflash"; do
    read -r name shipped strategies <<< "$row"
    [ -e "$DIR/$name/adapter_config.json" ] || [ -e "$DIR/$name/config.json" ] || continue
    [ -e "$shipped" ] || [[ $shipped != */* ]] || shipped=none   # no drafter shipped for this model
    ev=("${studio[@]}" train eval --n-prompts "$N_EVAL" --max-new-tokens "$EVAL_NEW" -s "$strategies" --json "${common[@]}")
    step "eval-$name" "${ev[@]}" "$DIR/$name"
    if [ "$SHIPPED" = 1 ] && [ "$shipped" != none ]; then
      step "eval-$name-shipped" "${ev[@]}" "$shipped"
    fi
  done
  step winners "$PYTHON" scripts/gpu_train_winners.py "$DIR"
fi
echo "$failed step(s) failed" | tee -a "$DIR/steps.txt"
exit $failed

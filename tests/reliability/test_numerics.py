"""Numerical faults end to end, for every strategy: a model or adapter that produces NaN/inf is a clear
one-line error; extreme sampling settings have a defined meaning (T -> 0 and top-p -> 0 are greedy, top-k
beyond the vocabulary is top-k off, T -> inf is uniform)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from studio.engine.sampling import SamplingParams, process_logits
from studio.engine.strategies import STRATEGIES as REGISTERED
from studio.errors import BadInput
from studio.run.config import RunConfig
from studio.run.session import run_to_end
from tests.support.lora import random_adapter
from tests.support.tiny import tiny_engine

VOCAB = 64
STRATEGIES = [s for s in REGISTERED if s != "gemma-canvas"]   # it decodes DiffusionGemma only (its own NaN test)
CONFIDENCE_ORDERED = ["blockdiff", "canvas"]   # which MASK fills first follows the (tempered) confidences


def engine():
    e = tiny_engine("qwen3", vocab=VOCAB)
    # jacobi-mr's headroom; a native block size, which canvas needs of a causal model
    e.config = e.model.config = dataclasses.replace(e.config, max_seq_len=1024, block_size=4)
    return e


def token_ids(eng, strategy: str, temperature=None, top_k=None, top_p=None, seed: int = 0) -> list[int]:
    strat, settings = RunConfig(strategy, max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed).build()
    return run_to_end(eng, strat, settings, "hi", [1, 2, 3]).token_ids


@pytest.fixture(scope="module")
def eng():
    return engine()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_model_producing_nan_is_a_one_line_error(strategy, poison):
    bad = engine()
    with torch.no_grad():
        bad.model.model.layers[0].mlp.down_proj.weight[0, 0] = poison
    for temperature in (None, 1.0):
        with pytest.raises(BadInput, match="NaN logits at forward") as e:
            token_ids(bad, strategy, temperature)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")])
def test_an_adapter_with_non_finite_weights_is_refused_at_load(tmp_path, poison):
    eng = engine()
    path = random_adapter(tmp_path / "ad", eng.model)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    name = sorted(tensors)[3]
    tensors[name][1, 2] = poison
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(BadInput, match="not a finite") as e:
        eng.with_adapter(str(path))
    assert name.removeprefix("base_model.model.") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s not in CONFIDENCE_ORDERED])
def test_vanishing_temperature_and_nucleus_are_greedy(eng, strategy):
    greedy = token_ids(eng, strategy)
    assert token_ids(eng, strategy, temperature=1e-6, seed=5) == greedy
    assert token_ids(eng, strategy, temperature=1.0, top_p=1e-9, seed=5) == greedy


@pytest.mark.parametrize("strategy", CONFIDENCE_ORDERED)
def test_filling_by_confidence_at_vanishing_temperature_is_deterministic(eng, strategy):
    """blockdiff and canvas unmask by the tempered confidences, which are all ~1 at T -> 0 (so it is not their greedy
    schedule), but no randomness is left: every seed gives the same tokens."""
    runs = {tuple(token_ids(eng, strategy, temperature=1e-6, seed=s)) for s in range(3)}
    assert len(runs) == 1


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_top_k_at_or_beyond_the_vocabulary_is_top_k_off(eng, strategy):
    off = token_ids(eng, strategy, temperature=1.0, seed=3)
    assert token_ids(eng, strategy, temperature=1.0, top_k=VOCAB, seed=3) == off
    assert token_ids(eng, strategy, temperature=1.0, top_k=10**9, seed=3) == off


def test_huge_temperature_is_uniform_and_runs(eng):
    logits = torch.randn(VOCAB) * 20
    probs = process_logits(logits, SamplingParams(temperature=1e6))
    assert torch.isfinite(probs).all() and probs.max() / probs.min() < 1.001
    for strategy in STRATEGIES:
        ids = token_ids(eng, strategy, temperature=1e6)
        assert len(ids) == 16 and all(0 <= i < VOCAB for i in ids)

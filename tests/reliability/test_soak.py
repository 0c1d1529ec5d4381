"""Soak: many generations in one process across every strategy and random settings -- no exception, resident
memory flat after warm-up, every KV cache and event buffer released when its run is dropped."""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import random

import pytest

from studio.engine.kv_cache import KVCache
from studio.engine.strategies import STRATEGIES, make_strategy
from studio.errors import BadInput
from studio.run.config import RunConfig
from studio.run.session import Run, run_to_end
from studio.web.paramspec import param_fields
from tests.support.tiny import tiny_engine


def resident_bytes() -> int:
    """Resident memory of what is still alive: collected, and the C heap's free pages given back first
    (glibc keeps tens of MiB of freed tensors resident, up and down from run to run, which would hide a leak
    or fake one)."""
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def random_params(strategy: str, rng: random.Random, config) -> dict:
    """Each declared parameter: its default half of the time, else a random nearby value of its type
    (text fields: one of the values the strategy accepts). Combinations the strategy refuses -- alone or
    on this model (`config`) -- fall back to the defaults."""
    params = {}
    for f in param_fields(strategy):
        if rng.random() < 0.5 or f.kind is dict:
            continue
        if f.choices:
            params[f.name] = rng.choice(f.choices)
        elif f.kind is bool:
            params[f.name] = rng.random() < 0.5
        elif f.kind is int:
            params[f.name] = rng.randint(max(1, f.default // 4), max(2, f.default)) if f.default > 0 else 0
        elif f.kind is float:
            params[f.name] = round(f.default * rng.uniform(0.5, 1.0), 3)
    try:
        make_strategy(strategy, params).check_run(config, 1)
    except BadInput:
        return {}
    return params


def one_generation(engine, rng: random.Random, max_tokens: int, prompt: list[int]) -> str:
    """A random strategy with random settings; returns its stop reason."""
    strategy = rng.choice([name for name, cls in STRATEGIES.items() if cls.decodes_ar_models])   # an AR engine
    temperature = rng.choice([None, 0.0, rng.uniform(0.3, 1.5)])
    top_k = rng.choice([None, 0, rng.randint(1, 40)])
    top_p = rng.choice([None, 1.0, rng.uniform(0.5, 1.0)])
    stop = rng.choice([[], [engine.tokenizer.decode([rng.randrange(20)])]])
    strat, settings = RunConfig(strategy, params=random_params(strategy, rng, engine.config), max_new_tokens=rng.randint(1, max_tokens), temperature=temperature, top_k=top_k, top_p=top_p, seed=rng.randrange(10**6), stop=tuple(stop)).build()
    result = run_to_end(engine, strat, settings, "soak", prompt)
    assert result.footer["n_tokens"] == len(result.token_ids) <= settings.max_new_tokens
    return result.footer["stop_reason"]


def soak(engine, n: int, warmup: int, max_tokens: int, prompt: list[int], seed: int = 0) -> dict:
    """Run `n` random generations; resident memory after `warmup` of them and at the end."""
    rng = random.Random(seed)
    rss, reasons = {}, set()
    for i in range(1, n + 1):
        reasons.add(one_generation(engine, rng, max_tokens, prompt))
        if i in (warmup, n):
            rss[i] = resident_bytes()
    return {"rss": rss, "reasons": reasons}


def live(cls) -> int:
    gc.collect()
    return sum(type(o) is cls for o in gc.get_objects())


def test_a_thousand_random_generations_on_a_tiny_model():
    engine = tiny_engine("qwen3", vocab=64, eos_ids=(5,))
    engine.config = engine.model.config = dataclasses.replace(engine.config, max_seq_len=1024)  # jacobi-mr headroom
    out = soak(engine, 1000, warmup=100, max_tokens=24, prompt=[1, 2, 3, 4])
    before, after = out["rss"][100], out["rss"][1000]
    assert after < before * 1.05, f"resident memory grew from {before / 2**20:.1f} to {after / 2**20:.1f} MiB"
    assert out["reasons"] == {"max_new_tokens", "eos", "stop_string"}   # the random settings reached every way a run ends
    assert live(Run) == 0 and live(KVCache) == 0          # nothing of a finished run is kept


@pytest.mark.slow
def test_sixty_random_generations_on_the_embedded_model(default_engine):
    from studio.run.session import encode_prompt
    out = soak(default_engine, 60, warmup=10, max_tokens=8, prompt=encode_prompt(default_engine, "Count to five."))
    before, after = out["rss"][10], out["rss"][60]
    assert after < before * 1.05, f"resident memory grew from {before / 2**20:.1f} to {after / 2**20:.1f} MiB"
    assert live(Run) == 0

"""S2D2: the block-size-1 verifier (2L trick / causal), the verify step's law, routing inside the loop."""
import copy

import pytest
import torch

from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.engine.strategies.routing import AlwaysPolicy
from studio.engine.strategies.s2d2 import first_run
from studio.errors import BadInput
from tests.support.dlm import (block_size_one_greedy, block_size_one_law, block_size_one_probs, block_size_one_row, generate,
                       opened)
from tests.support.exact import assert_law, chi_square_pvalue, law_samples
from tests.support.plans import planned
from tests.support.tiny import FAMILIES, tiny_dlm


def test_first_run():
    assert first_run([]) == 0
    assert first_run([2, 3, 4, 7]) == 3
    assert first_run([0, 2]) == 1


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_verifier_equals_separate_block_size_one_forwards(family, shift):
    engine = tiny_dlm(family, shift, block=8, vocab=32, seed=2)
    strat = make_strategy("s2d2", {"cache": "causal"})
    prompt = list(range(1, 11))                  # 8 prefilled, [9, 10] in the open block
    ctx = opened(engine, strat, prompt)
    b = strat.block
    torch.manual_seed(0)
    filled = b.tokens[:2] + torch.randint(0, 31, (6,)).tolist()
    slots = list(range(2, 8))
    got = strat.verifier_logits(ctx, filled, slots)
    for i, j in enumerate(slots):
        ref = block_size_one_row(engine, prompt[:8] + filled[:j])
        ref[engine.config.mask_token_id] = got[i, engine.config.mask_token_id]   # the helper drops MASK
        assert (got[i] - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_always_verify_with_causal_cache_is_the_block_size_one_model(family, shift):
    """Every token is committed by the verifier, so greedy S2D2 = the model decoding token by token
    (right-shifted: plain greedy AR)."""
    engine = tiny_dlm(family, shift, vocab=24, seed=7)
    r = generate(engine, "s2d2", {"policy": "always", "cache": "causal"}, n=30)
    assert r.token_ids == block_size_one_greedy(engine, [1, 2, 3, 4, 5], 30)
    if shift:
        assert r.token_ids == generate(engine, "ar", n=30).token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_forced_first_slot_is_verified_but_not_counted_as_an_accepted_proposal(temperature):
    """Right-shifted model + partially causal drafts: the first masked slot is drafted by the clean row before it,
    which sees what the verifier sees, so its draft is the target's own sample and always passes. It is not a
    proposal: counted, it would put acceptance at slot 0 at 100% whatever the drafter's quality."""
    engine = tiny_dlm("llama", True, vocab=24, seed=7)
    params = {"policy": "always", "cache": "causal", "causal_prefix": True, "drafting": "fixed"}
    r = generate(engine, "s2d2", params, n=30, temperature=temperature)
    proposed = {p for e in r.events if e["t"] == "propose" for p in e["pos"]}
    verified = [e for e in r.events if e["t"] in ("accept", "reject")]
    assert all(set(e["pos"] if e["t"] == "accept" else [e["pos"]]) <= proposed for e in verified)
    rounds = [e for e in r.events if e["t"] == "forward" and e["role"] == "verify"]
    filled_unproposed = [p for e in r.events if e["t"] == "emit" for p in e["pos"]
                         if p not in proposed and not any(u["t"] == "unmask" and p in u["pos"] for u in r.events)]
    assert len(filled_unproposed) >= len(rounds) > 3     # a forced token per verify round (+ each block's slot 0)
    first_slot = [e["pos"] == min(p["pos"]) for e in verified for p in r.events
                  if p["t"] == "propose" and p["step"] == e["step"] and e["t"] == "reject"]
    assert any(first_slot), "some first proposal is rejected: slot 0 is a real draft, not a forced token"
    from studio.viz.stats import progress, stalled_steps
    assert not stalled_steps(progress(r.events))   # a draft step whose drafts go to the verifier is no stall
    assert r.footer["accept_by_pos"][0] < 1.0
    if temperature == 0:   # the accounting changes no output: always verifying is greedy AR on this model
        assert r.token_ids == generate(engine, "ar", n=30).token_ids


def _first_token_samples(engine, params, n, prompt, first=0):
    """The token the first S2D2 step commits at the first masked slot, over n seeds from `first` (same state)."""
    strat = make_strategy("s2d2", params)
    ctx = opened(engine, strat, prompt, temperature=1.0)
    slot = strat.block.masked_slots()[0]
    samples = []
    for seed in range(first, first + n):
        s = copy.copy(strat)
        s.block, s.policy = copy.deepcopy(strat.block), AlwaysPolicy()
        ctx.gen.manual_seed(seed)
        s._denoise(ctx, role="draft")
        ctx.drain()
        assert not s.block.masked[slot]
        samples.append((s.block.tokens[slot],))
    return samples, prompt[:strat.block.start] + strat.block.tokens[:slot]


@pytest.mark.law
def test_verify_step_commits_the_verifier_distribution():
    """The 2L verifier path (position-aligned); the right-shifted path is covered by whole sequences below."""
    engine = tiny_dlm("qwen3", False, vocab=6, seed=11, dim=16, layers=1)
    params, prompt = {"policy": "always", "cache": "causal"}, [1, 2, 3, 4, 1, 2]
    _, prefix = _first_token_samples(engine, params, 1, prompt)
    p = block_size_one_probs(engine, prefix, SamplingParams(1.0))
    law = {(v,): float(p[v]) for v in range(6)}
    assert_law(lambda seeds: chi_square_pvalue(_first_token_samples(engine, params, len(seeds), prompt,
                                                                    seeds.start)[0], law), law_samples(20_000))


def test_tempering_gamma_is_lossy():
    engine = tiny_dlm("qwen3", False, vocab=6, seed=11, dim=16, layers=1)
    params = {"policy": "always", "cache": "causal", "gamma": 0.2}
    samples, prefix = _first_token_samples(engine, params, 5_000, [1, 2, 3, 4, 1, 2])
    p = block_size_one_probs(engine, prefix, SamplingParams(1.0))
    assert chi_square_pvalue(samples, {(v,): float(p[v]) for v in range(6)}) < 1e-4


@pytest.mark.parametrize("params,n", [pytest.param({"block_size": 2, "drafting": "fixed"}, law_samples(12_000),
                                                   marks=pytest.mark.law),
                                      ({"block_size": 4, "causal_prefix": True}, 5_000)], ids=["fixed", "auto"])
def test_sampled_always_verify_right_shifted_matches_the_ar_law(params, n):
    """Whole sequences, real KV and block commits: with every token verified, sampled S2D2 on a
    right-shifted model with a causal cache is exactly AR sampling; with cost-aware drafting (which on the tests'
    equal costs drafts a fresh block and falls back to AR steps after a rejection) too."""
    engine = tiny_dlm("llama", True, vocab=6, seed=11, dim=16, layers=1)
    prompt = [1, 2, 3, 4, 5]
    law = block_size_one_law(engine, prompt, 3, SamplingParams(1.0))
    batches = []

    def pvalue(seeds: range) -> float:
        batches.append([generate(engine, "s2d2", {"policy": "always", "cache": "causal", **params}, prompt=prompt, n=3,
                                 temperature=1.0, seed=seed) for seed in seeds])
        return chi_square_pvalue([tuple(r.token_ids) for r in batches[-1]], law)

    assert_law(pvalue, n)
    runs = batches[0]
    if "drafting" not in params:
        plans = [planned(r) for r in runs]
        assert any(0 in p for p in plans) and all(p[0] > 0 for p in plans)


@pytest.mark.parametrize("policy", ["always", "never", "min-span", "score", "hysteresis", "ucb"])
def test_every_policy_runs_and_reports_its_route(policy):
    engine = tiny_dlm("qwen3", False, vocab=16, seed=3)
    r = generate(engine, "s2d2", {"policy": policy}, n=24, temperature=1.0, seed=1)
    routes = [e for e in r.events if e["t"] == "route"]
    drafts = [e for e in r.events if e["t"] == "forward" and e["role"] == "draft"]
    verifies = [e for e in r.events if e["t"] == "forward" and e["role"] == "verify"]
    assert len(routes) == len(drafts) and all(e["policy"] == policy for e in routes)
    assert len(verifies) == sum(e["verify"] for e in routes)
    if policy == "always":
        assert all(e["verify"] for e in routes)
    if policy == "never":
        assert not verifies
    assert len(r.token_ids) == 24


def test_never_verifying_is_blockdiff():
    engine = tiny_dlm("llama", True, vocab=16, seed=3)
    for temperature in (0.0, 1.0):
        s2d2 = generate(engine, "s2d2", {"policy": "never"}, n=30, temperature=temperature, seed=2)
        bd = generate(engine, "blockdiff", {}, n=30, temperature=temperature, seed=2)
        assert s2d2.token_ids == bd.token_ids


def test_score_policy_threshold_changes_how_often_it_verifies():
    engine = tiny_dlm("qwen3", False, vocab=16, seed=3)
    counts = []
    for threshold in (-10.0, 10.0):
        r = generate(engine, "s2d2", {"policy": "score", "route.threshold": threshold}, n=24, temperature=1.0)
        counts.append(sum(e["verify"] for e in r.events if e["t"] == "route"))
    assert counts[0] > 0 and counts[1] == 0


def test_route_params_are_validated():
    assert make_strategy("s2d2", {"policy": "hysteresis", "route": {"on": 2.0}}).policy.params.on == 2.0
    assert make_strategy("s2d2", {"policy": "score", "route.c": 3}).policy.params.c == 3.0
    for bad in ({"policy": "score", "route.nope": 1}, {"policy": "warp"}, {"gamma": 0.0},
                {"policy": "hysteresis", "route.on": -9.0}):
        with pytest.raises(BadInput):
            make_strategy("s2d2", bad)


def test_verify_replaces_off_also_unmasks_confident_slots():
    engine = tiny_dlm("qwen3", False, vocab=16, seed=3)
    on = generate(engine, "s2d2", {"policy": "always", "threshold": 0.0}, n=24)
    off = generate(engine, "s2d2", {"policy": "always", "threshold": 0.0, "verify_replaces": False}, n=24)
    assert not any(e["t"] == "unmask" for e in on.events)
    assert any(e["t"] == "unmask" for e in off.events)
    assert off.footer["forwards"] < on.footer["forwards"]


def test_an_adapter_works_at_mask_rows_only(tmp_path):
    """AR model + random adapter: drafts use the adapter, yet always-verify S2D2 with a causal cache still
    reproduces the base model's greedy AR output (clean rows, their KV and the verifier are base-only)."""
    from studio.engine.lora import attach_adapter
    from tests.support.lora import random_adapter
    engine = tiny_dlm("llama", True, vocab=24, seed=7)
    ar = generate(engine, "ar", n=24).token_ids
    attach_adapter(engine, random_adapter(tmp_path / "a", engine.model, seed=3))
    r = generate(engine, "s2d2", {"policy": "always", "cache": "causal"}, n=24)
    assert r.token_ids == ar
    drafts = [e for e in r.events if e["t"] == "forward" and e["role"] == "draft"]
    others = [e for e in r.events if e["t"] == "forward" and e["role"] != "draft"]
    assert all(e["lora_rows"] > 0 for e in drafts) and all(e["lora_rows"] == 0 for e in others)
    everywhere = generate(engine, "s2d2", {"policy": "always", "cache": "causal", "adapter_rows": "all"}, n=24)
    assert all(e["lora_rows"] == e["n_tokens"] for e in everywhere.events if e["t"] == "forward")


def test_an_ar_model_gets_a_causal_cache_by_default(tmp_path):
    """A plain AR model (no native block size) + adapter: `cache=auto` keeps prefill and commits token-causal, so
    S2D2's default policy (min-span 1: always verify) reproduces greedy AR; a block cache would not."""
    from studio.engine.lora import attach_adapter
    from tests.support.lora import random_adapter
    from tests.support.tiny import tiny_engine
    engine = tiny_engine("qwen2", vocab=24, seed=7)
    assert engine.config.block_size is None
    ar = generate(engine, "ar", n=24).token_ids
    attach_adapter(engine, random_adapter(tmp_path / "a", engine.model, seed=3))
    assert generate(engine, "s2d2", {}, n=24).token_ids == ar
    assert generate(engine, "s2d2", {"cache": "block"}, n=24).token_ids != ar

"""SimSD: drafter rounds, the target's one-forward verification (temporal layout / causal), acceptance."""
import math

import pytest
import torch

from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.errors import BadInput
from studio.run.session import Settings, run_to_end
from tests.support.dlm import block_size_one_law, generate, opened
from tests.support.exact import assert_law, chi_square_pvalue, law_samples
from tests.support.plans import planned
from tests.support.tiny import FAMILIES, tiny_dlm


@pytest.mark.parametrize("family", FAMILIES)
def test_self_draft_right_shifted_greedy_is_ar(family):
    engine = tiny_dlm(family, True, vocab=24, seed=7)
    for params in ({"cache": "causal", "drafting": "fixed"}, {"cache": "causal", "draft_steps": 1, "drafting": "fixed"}):
        r = generate(engine, "simsd", params, n=30)
        assert r.token_ids == generate(engine, "ar", n=30).token_ids
        assert any(e["t"] == "propose" and e["src"] == "draft_model" for e in r.events)


@pytest.mark.parametrize("params,n", [pytest.param({"drafting": "fixed"}, law_samples(8_000), marks=pytest.mark.law),
                                      ({"draft_steps": 1}, 5_000)],
                         ids=["fixed", "auto"])
def test_self_draft_right_shifted_sampled_matches_the_ar_law(monkeypatch, params, n):
    """Fixed and cost-aware rounds (on the tests' equal costs, without the bound that holds a round back until the
    answer can absorb its refusal: a speculative round first, AR steps after a rejection) both sample the AR law."""
    monkeypatch.setattr("studio.engine.strategies.drafting.RISK_SHARE", math.inf)
    engine = tiny_dlm("llama", True, vocab=6, seed=11, dim=16, layers=1)
    prompt = [1, 2, 3, 4, 5]
    law = block_size_one_law(engine, prompt, 3, SamplingParams(1.0))
    batches = []

    def pvalue(seeds: range) -> float:
        batches.append([generate(engine, "simsd", {"cache": "causal", "block_size": 4, **params}, prompt=prompt, n=3,
                                 temperature=1.0, seed=seed) for seed in seeds])
        return chi_square_pvalue([tuple(r.token_ids) for r in batches[-1]], law)

    assert_law(pvalue, n)
    runs = batches[0]
    if "drafting" not in params:
        plans = [planned(r) for r in runs]
        assert any(0 in p for p in plans) and all(p[0] > 0 for p in plans)


def test_target_reads_each_draft_in_the_drafts_own_order():
    """One layer: the mask copy of the r-th revealed token sees exactly the prefix and the tokens revealed
    before it, so its logits equal a block forward in which only those are filled."""
    engine = tiny_dlm("qwen3", False, block=8, vocab=32, seed=5, layers=1)
    strat = make_strategy("simsd", {})
    prompt = list(range(1, 11))
    ctx = opened(engine, strat, prompt)
    b, M = strat.block, engine.config.mask_token_id
    slots = b.masked_slots()                                  # [2..7]; slots 0, 1 hold the prompt tail
    steps = [3, 0, 2, 0, 5, 1]                                # reveal step of each slot
    toks = [7, 8, 9, 10, 11, 12]
    revealed = {j: (s, t) for j, s, t in zip(slots, steps, toks)}
    order = sorted(revealed, key=lambda j: (revealed[j][0], j))
    work = b.tokens[:2] + toks
    got = strat._target_logits(ctx, work, slots, revealed, order)
    for i, j in enumerate(order):
        seen = [t if revealed[k][0] < revealed[j][0] else M for k, t in zip(slots, toks)]
        block = b.tokens[:2] + seen
        kv = engine.model.new_cache(16)
        with torch.inference_mode():   # B = 8: the prefilled block and the open block are each bidirectional
            full = torch.ones(16, 16, dtype=torch.bool)
            full[:8, 8:] = False
            ref = engine.model(torch.tensor(prompt[:8] + block), torch.arange(16), kv, mask=full,
                               logits_rows=[8 + j])[0, 0]
        assert (got[i] - ref).abs().max().item() <= 1e-5


def test_greedy_match_accepts_only_argmax_tokens():
    engine = tiny_dlm("qwen3", False, vocab=16, seed=3)
    r = generate(engine, "simsd", {"acceptance": "greedy-match"}, n=24, temperature=1.0, seed=2)
    accepts = [p for e in r.events if e["t"] == "accept" for p in e["p"]]
    rejects = [e["p"] for e in r.events if e["t"] == "reject"]
    assert accepts or rejects
    assert all(p == 1.0 for p in accepts) and all(p == 0.0 for p in rejects)


def test_fallback_to_target_decoding_when_too_few_masks():
    engine = tiny_dlm("qwen3", False, vocab=16, seed=3)
    r = generate(engine, "simsd", {"gamma": 5}, n=16)    # B = 4 < γ: the target always decodes
    roles = {e["role"] for e in r.events if e["t"] == "forward"}
    assert roles == {"prefill", "target", "commit"}
    bd = generate(engine, "blockdiff", {"schedule": "static"}, n=16)
    assert r.token_ids == bd.token_ids


def test_separate_draft_model_keeps_its_own_cache():
    target = tiny_dlm("qwen3", False, vocab=16, seed=3)
    draft = tiny_dlm("qwen3", False, vocab=16, seed=4, dim=16)
    strat = make_strategy("simsd", {})
    strat.use_draft(draft, target.config)
    s = Settings(max_new_tokens=20, sampling=SamplingParams(0.0))
    r = run_to_end(target, strat, s, "", [1, 2, 3, 4, 5])
    assert len(r.token_ids) == 20
    assert strat.dkv.length == strat.block.start == ctx_len(r)
    draft_fwd = [e for e in r.events if e["t"] == "forward" and e["role"] == "draft"]
    assert draft_fwd and any(e["t"] == "accept" for e in r.events)
    # the self-draft run differs: the drafter matters
    assert generate(target, "simsd", {}, n=20).events != r.events


def ctx_len(r) -> int:
    return max(e["to_len"] for e in r.events if e["t"] == "kv" and e["op"] == "commit")


def test_incompatible_draft_models_are_refused():
    target = tiny_dlm("qwen3", False, vocab=16)
    strat = make_strategy("simsd", {})
    with pytest.raises(BadInput, match="vocab"):
        strat.use_draft(tiny_dlm("qwen3", False, vocab=24), target.config)
    with pytest.raises(BadInput, match="position-aligned"):
        strat.use_draft(tiny_dlm("qwen3", True, vocab=16), target.config)
    for bad in ({"gamma": -1}, {"acceptance": "maybe"}, {"reveal": "random"}):
        with pytest.raises(BadInput):
            make_strategy("simsd", bad)


@pytest.mark.parametrize("shift", [False, True])
def test_sampled_runs_read_back(tmp_path, shift):
    from studio import events as ev
    engine = tiny_dlm("qwen2", shift, vocab=16, seed=1)
    r = generate(engine, "simsd", {"gamma": 2}, n=25, temperature=1.0, seed=5, trace=tmp_path / "t.jsonl")
    back = ev.read_trace(tmp_path / "t.jsonl")
    assert back.footer["tpf"] == r.footer["tpf"] and back.footer["n_tokens"] == 25
    proposed = {(p, t) for e in r.events if e["t"] == "propose" for p, t in zip(e["pos"], e["tok"])}
    for e in r.events:
        if e["t"] == "accept":
            assert set(zip(e["pos"], e["tok"])) <= proposed
        if e["t"] == "reject":
            assert (e["pos"], e["tok"]) in proposed

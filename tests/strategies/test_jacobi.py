"""Jacobi and Jacobi MR: exactness (greedy == AR token for token, sampled law == AR law), rejection recycling,
promotion (intended vs reference), KV hygiene with candidate rows, events, bad parameters, presets."""
import dataclasses

import pytest
import torch

from studio import events as ev
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import STRATEGIES, DecodeContext, Output, make_strategy
from studio.engine.strategies.jacobi import Jacobi, JacobiMR
from studio.errors import BadInput
from studio.presets import load_strategy_preset
from studio.run.session import Settings, run_to_end
from tests.support.exact import assert_law, chi_square_pvalue, exact_sequence_law, law_samples
from tests.support.plans import CHAIN_MIXED, plan_with, planned
from tests.support.tiny import FAMILIES, tiny_engine

PROMPT = [1, 2, 3, 4]


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """The lead registers these in studio/engine/strategies/__init__.py; until then (and after) the tests
    see the same names."""
    monkeypatch.setitem(STRATEGIES, "jacobi", Jacobi)
    monkeypatch.setitem(STRATEGIES, "jacobi-mr", JacobiMR)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny-model forwards are dominated by op dispatch; extra threads only add contention."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def roomy(engine):
    """Tiny models say max_seq_len 128; jacobi-mr's headroom (1 + n (K + pool)) needs more. RoPE has no limit."""
    engine.config = dataclasses.replace(engine.config, max_seq_len=2048)
    return engine


def generate(engine, name, params=None, n=80, temperature=0.0, seed=0, prompt=PROMPT):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=seed)
    return run_to_end(engine, make_strategy(name, params), s, "", list(prompt))


def cycling_engine(family="llama", vocab=16, seed=0, dim=32):
    """A tiny model that repeats: orthogonal, large embeddings dominate the residual stream and the lm_head maps
    token x to next(x) = perm[x], so greedy output cycles (period 6 for seed 0). A first-order model is the worst
    case for plain Jacobi (a draft after a wrong token is always wrong: TPF ~1) and the best for recycling."""
    engine = roomy(tiny_engine(family, vocab=vocab, seed=seed, dim=dim))
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g))
    perm = torch.randperm(vocab, generator=g)
    m = engine.model
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(q[:vocab] * 8.0)
        w = torch.zeros_like(m.lm_head.weight)
        w[perm] = q[:vocab] * 4.0
        m.lm_head.weight.copy_(w + 0.3 * m.lm_head.weight)
    return engine


def ngram_accepted(result) -> int:
    """Tokens of a propose{src: ngram} (drafts looked up in the context) that an accept of the same step covered."""
    proposed, n = {}, 0
    for e in result.events:
        if e["t"] == "propose" and e["src"] == "ngram":
            proposed.setdefault(e["step"], set()).update(zip(e["pos"], e["tok"]))
        elif e["t"] == "accept":
            n += len(proposed.get(e["step"], set()) & set(zip(e["pos"], e["tok"])))
    return n


def _window(parents: list[int]) -> int:
    """How many of a Jacobi MR tree's nodes are the window's drafts: the leading chain, node i under node i - 1."""
    return next((i for i, p in enumerate(parents) if p != i - 1), len(parents))


def recycled_accepted(result) -> int:
    """Accepted drafts that a recycled candidate added to a tree step (a candidate won). A Jacobi MR tree holds the
    window's drafts first, as a chain (node i under node i - 1), then the nodes the candidates add."""
    window, n = {}, 0
    for e in result.events:
        if e["t"] == "propose" and "parent" in e:
            window[e["step"]] = _window(e["parent"])
        elif e["t"] == "accept" and "node" in e:
            n += sum(node >= window[e["step"]] for node in e["node"])
    return n


JACOBI_PARAMS = [{"block_size": 1}, {"block_size": 4}, {}, {"block_size": 8, "init": "repeat-last"},
                 {"block_size": 6, "max_iters": 1}]
MR_PARAMS = [{"block_size": 8}, {"block_size": 4, "blocks": 3, "spawn_ratio": 0.5},
             {"block_size": 1, "spawn_ratio": 1.0}, {"block_size": 8, "mode": "reference"}, {},
             {"block_size": 6, "pool_size": 1, "init": "repeat-last"}, {"block_size": 8, "blocks": 1},
             {"block_size": 5, "blocks": 4, "spawn_ratio": 0.4, "max_iters": 2},
             {"block_size": 3, "blocks": 3, "spawn_ratio": 0.34, "pool_size": 8, "mode": "reference"},
             {"block_size": 16, "pool_size": 0, "spawn_ratio": 0.5}]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_jacobi_and_mr_equal_greedy_ar(monkeypatch, family):
    """Every layout, drafting all its drafts (fixed) and under costs that make the plan change along the run (auto:
    AR steps, narrow forwards of a few drafts, Jacobi MR's whole layout)."""
    plan_with(monkeypatch, CHAIN_MIXED)
    plans = set()
    for engine in (roomy(tiny_engine(family, vocab=24, seed=5)), cycling_engine(family)):
        ar = generate(engine, "ar")
        for name, params in [("jacobi", p) for p in JACOBI_PARAMS] + [("jacobi-mr", p) for p in MR_PARAMS]:
            for drafting in ("fixed", "auto"):
                r = generate(engine, name, dict(params, drafting=drafting))
                assert r.token_ids == ar.token_ids, (name, params, drafting)
                assert len(r.token_ids) == 80
                assert r.footer["forwards"] <= 79
                plans |= set(planned(r))
    assert {0, 1} <= plans


@pytest.mark.parametrize("family", FAMILIES)
def test_recycled_ngrams_are_accepted_on_repetitive_output(family):
    engine = cycling_engine(family)
    ar = generate(engine, "ar")
    assert len(set(ar.token_ids)) < 10                         # it really repeats
    no_lookup = {"block_size": 8, "drafting": "fixed", "lookup": 0}   # the pool alone
    jac = generate(engine, "jacobi", no_lookup)
    mr = generate(engine, "jacobi-mr", no_lookup)
    assert mr.token_ids == ar.token_ids == jac.token_ids
    assert recycled_accepted(mr) > 0
    # the candidates are one tree with the window: each shared prefix is one row, so some candidate node hangs under
    # a node of the window or of another candidate, not under the pending token
    shared = [p for e in mr.events if e["t"] == "propose" and "parent" in e
              for p in e["parent"][_window(e["parent"]):] if p >= 0]
    assert shared
    assert mr.footer["tpf"] > 2.0                              # measured 4.21 (80 tokens, 19 forwards)
    assert mr.footer["tpf"] > jac.footer["tpf"]                # plain Jacobi: 1.01 on a first-order model
    no_pool = generate(engine, "jacobi-mr", dict(no_lookup, pool_size=0))
    assert recycled_accepted(no_pool) == 0 and no_pool.footer["forwards"] > mr.footer["forwards"]


def _promoted_kept(result) -> tuple[int, int]:
    """(kept, total): pseudo-accepted tokens of a promoted block that are among the next verified drafts."""
    unmasked, closed, kept, total = {}, None, 0, 0
    for e in result.events:
        if e["t"] == "unmask":
            unmasked.update(zip(e["pos"], e["tok"]))
        elif e["t"] == "block" and e["op"] == "close":
            closed = {(p, unmasked[p]) for p in range(e["start"], e["end"]) if p in unmasked}
        elif e["t"] == "propose" and e["src"] == "jacobi" and closed is not None:
            still_open = {x for x in closed if x[0] >= e["pos"][0]}
            kept += len(still_open & set(zip(e["pos"], e["tok"])))
            total += len(still_open)
            closed = None
    return kept, total


def test_promotion_keeps_progress_in_intended_mode_and_drops_it_in_reference_mode():
    params = {"block_size": 8, "pool_size": 0, "lookup": 0, "spawn_ratio": 0.5, "drafting": "fixed"}   # only the promotion differs
    forwards = {"intended": 0, "reference": 0}
    for family in FAMILIES:
        for seed in range(3):
            engine = roomy(tiny_engine(family, vocab=24, seed=seed))
            ar = generate(engine, "ar", n=100)
            for mode in forwards:
                r = generate(engine, "jacobi-mr", dict(params, mode=mode), n=100)
                assert r.token_ids == ar.token_ids
                forwards[mode] += r.footer["forwards"]
                kept, total = _promoted_kept(r)
                assert total > 0
                if mode == "intended":
                    assert kept == total      # the promoted block's tokens are the new real-active drafts
                else:
                    assert kept < total       # fresh context tokens instead
    assert forwards["intended"] < forwards["reference"]   # measured 526 vs 607


def _samples(engine, name, params, n_samples, length=3, first=0):
    out = []
    for seed in range(first, first + n_samples):
        r = generate(engine, name, params, n=length, temperature=1.0, seed=seed)
        out.append(tuple(r.token_ids))
    return out


@pytest.fixture(scope="module")
def law_engine():
    engine = roomy(tiny_engine("llama", vocab=6, seed=11, dim=16, layers=1))
    law = exact_sequence_law(engine.model, PROMPT, 3, SamplingParams(temperature=1.0))
    return engine, law


def test_sampled_jacobi_matches_the_ar_distribution(monkeypatch, law_engine):
    """In auto drafting, with costs under which the plan follows the verdicts (AR steps and drafts)."""
    engine, law = law_engine
    plan_with(monkeypatch, CHAIN_MIXED)
    assert_law(lambda seeds: chi_square_pvalue(_samples(engine, "jacobi", {"block_size": 2}, len(seeds),
                                                        first=seeds.start), law), 20_000)
    plans = {d for s in range(50) for d in planned(generate(engine, "jacobi", {"block_size": 2}, n=3,
                                                             temperature=1.0, seed=s))}
    assert {0, 1} <= plans


@pytest.mark.parametrize("drafting", [pytest.param("fixed", marks=pytest.mark.law), "auto"])
def test_sampled_jacobi_mr_matches_the_ar_distribution(monkeypatch, law_engine, drafting):
    """fixed: every forward carries the whole layout; auto: narrow forwards and whole ones, as the verdicts go."""
    engine, law = law_engine
    plan_with(monkeypatch, CHAIN_MIXED)
    params = {"block_size": 3, "spawn_ratio": 0.3, "pool_size": 3, "drafting": drafting}
    n = law_samples(20_000) if drafting == "fixed" else 10_000   # auto: the same rule, the plan only decides how many drafts
    assert_law(lambda seeds: chi_square_pvalue(_samples(engine, "jacobi-mr", params, len(seeds), first=seeds.start),
                                               law), n)
    runs = [generate(engine, "jacobi-mr", params, n=3, temperature=1.0, seed=seed) for seed in range(300)]
    if drafting == "fixed":   # the machinery under test was exercised: pseudo blocks, candidates, candidates that won
        kinds = {e["t"] + "/" + e.get("src", "") for r in runs for e in r.events}
        assert {"block/", "unmask/"} <= kinds and sum(map(recycled_accepted, runs)) > 0
    else:                     # the plan followed the verdicts: AR steps and forwards with drafts
        assert {0, 1} <= {d for r in runs for d in planned(r)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("engine_kind", ["cycling", "random"])
def test_committed_kv_is_exactly_the_clean_tokens(temperature, engine_kind):
    """With recycling active (candidate rows that win and are kept with ctx.keep), the cache holds exactly
    prompt + output[:-1] (the last token is pending) and equals a fresh prefill."""
    engine = cycling_engine("qwen3") if engine_kind == "cycling" else roomy(tiny_engine("qwen2", vocab=12, seed=3))
    strat = make_strategy("jacobi-mr", {"block_size": 6, "spawn_ratio": 0.5, "pool_size": 4, "drafting": "fixed"})
    out = Output(engine.tokenizer, 60, frozenset())
    kv_len = len(PROMPT) + 60 + strat.kv_headroom()
    ctx = DecodeContext(engine.model, engine.tokenizer, SamplingParams(temperature), 7, out,
                        engine.config.mask_token_id, kv_len)
    events = []
    strat.start(ctx, PROMPT)
    events += ctx.drain()
    while not out.finished:
        strat.step(ctx)
        events += ctx.drain()
    won = recycled_accepted(type("R", (), {"events": events}))
    if engine_kind == "cycling":
        assert won > 0
    ids = PROMPT + out.token_ids
    n = ctx.kv.length
    assert len(ids) - 1 <= n <= len(ids) - 1 + 6       # may have committed past max_new_tokens mid-chain
    n = min(n, len(ids))
    fresh = engine.model.new_cache(kv_len)
    with torch.inference_mode():
        engine.model(torch.tensor(ids[:n]), torch.arange(n), fresh)
    assert torch.allclose(ctx.kv.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(ctx.kv.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-5)


@pytest.mark.parametrize("name, params", [("jacobi", {"block_size": 4, "drafting": "fixed"}),
                                          ("jacobi-mr", {"block_size": 4, "spawn_ratio": 0.5, "blocks": 3,
                                                         "drafting": "fixed"})])
def test_events_tell_the_whole_story(name, params):
    engine = roomy(tiny_engine("qwen2", vocab=10, seed=2))
    r = generate(engine, name, params, n=40, temperature=1.0, seed=4)
    for i, e in enumerate(r.events):
        ev.validate_event(e, f"event {i}")
    emitted = [t for e in r.events if e["t"] == "emit" for t in e["tok"]]
    assert emitted == r.token_ids
    assert [p for e in r.events if e["t"] == "emit" for p in e["pos"]] == list(range(len(emitted)))
    fwd = [e for e in r.events if e["t"] == "forward"]
    assert fwd[0]["role"] == "prefill" and all(f["role"] == "jacobi" for f in fwd[1:])
    assert r.footer["forwards"] == len(fwd) - 1
    assert all(f["n_tokens"] <= make_strategy(name, params).kv_headroom() for f in fwd[1:])
    # every verdict is about a draft proposed in the same step; a chain's are one run of positions, a tree's (Jacobi
    # MR's window with the recycled candidates) name their nodes, siblings refused at the path's positions
    proposed, verdicts, trees = {}, {}, set()
    for e in r.events:
        if e["t"] == "propose":
            assert e["src"] in ("jacobi", "ngram") and e["q"] == [1.0] * len(e["tok"])
            proposed.setdefault(e["step"], set()).update(zip(e["pos"], e["tok"]))
            if "parent" in e:
                trees.add(e["step"])
        elif e["t"] == "accept":
            assert set(zip(e["pos"], e["tok"])) <= proposed[e["step"]]
            assert ("node" in e) == (e["step"] in trees)
            verdicts.setdefault(e["step"], []).extend(e["pos"])
        elif e["t"] == "reject":
            assert (e["pos"], e["tok"]) in proposed[e["step"]]
            assert ("node" in e) == (e["step"] in trees)
            verdicts.setdefault(e["step"], []).append(e["pos"])
    for step, positions in verdicts.items():
        run = sorted(set(positions)) if step in trees else positions
        assert run == list(range(positions[0], positions[0] + len(run)))
    assert bool(trees) == (name == "jacobi-mr")
    assert 0.0 < r.footer["accept_rate"] <= 1.0
    if name == "jacobi-mr":
        blocks = [e for e in r.events if e["t"] == "block"]
        assert blocks and all(b["end"] - b["start"] == 4 for b in blocks)


def test_stop_on_eos():
    engine = roomy(tiny_engine("llama", vocab=10, seed=1))
    ref = generate(engine, "ar", n=30)
    eos = ref.token_ids[7]
    first = ref.token_ids.index(eos)
    eng_eos = roomy(tiny_engine("llama", vocab=10, seed=1, eos_ids=[eos]))
    for name, params in [("jacobi", {"block_size": 4}), ("jacobi-mr", {"block_size": 4, "spawn_ratio": 0.5})]:
        r = generate(eng_eos, name, params, n=30)
        assert r.token_ids == ref.token_ids[:first + 1] and r.footer["stop_reason"] == "eos"


def test_position_aligned_model_is_refused():
    engine = roomy(tiny_engine("llama", vocab=10, seed=1))
    engine.model.config = dataclasses.replace(engine.model.config, logit_shift=False)
    for name in ("jacobi", "jacobi-mr"):
        with pytest.raises(BadInput, match="logit shift"):
            generate(engine, name, {"block_size": 4}, n=5)


@pytest.mark.parametrize("name, params, message", [
    ("jacobi", {"block_size": 0}, "block_size"), ("jacobi", {"init": "zeros"}, "init"),
    ("jacobi", {"max_iters": 0}, "max_iters"), ("jacobi", {"blocks": 2}, "no parameter"),
    ("jacobi-mr", {"block_size": 0}, "block_size"), ("jacobi-mr", {"blocks": 0}, "blocks"),
    ("jacobi-mr", {"spawn_ratio": 0.0}, "spawn_ratio"), ("jacobi-mr", {"spawn_ratio": 1.5}, "spawn_ratio"),
    ("jacobi-mr", {"spawn_ratio": float("nan")}, "spawn_ratio"), ("jacobi-mr", {"mode": "fast"}, "mode"),
    ("jacobi-mr", {"pool_size": -1}, "pool_size"), ("jacobi-mr", {"block_size": "8"}, "must be int"),
    ("jacobi", {"drafting": "some"}, "drafting"),
])
def test_bad_parameters_are_clear_errors(name, params, message):
    with pytest.raises(BadInput, match=message):
        make_strategy(name, params)


@pytest.mark.parametrize("preset, strategy", [("jacobi-n16", "jacobi"), ("jacobi-mr-64", "jacobi-mr"),
                                              ("jacobi-mr-cpu", "jacobi-mr")])
def test_presets_load_and_validate(preset, strategy):
    p = load_strategy_preset(preset)
    assert p.strategy == strategy and p.sampling == {"temperature": 0.0}
    s = make_strategy(p.strategy, p.params)
    if preset == "jacobi-mr-64":
        assert (s.params.block_size, s.params.blocks, s.params.spawn_ratio, s.params.pool_size) == (64, 2, 0.85, 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_looked_up_in_the_context_are_verified_exactly_and_pay_on_repetitive_output(family):
    """Prompt lookup: where the last tokens occurred before, what followed them is the first drafts (src ngram).
    On a model that cycles they are right, so Jacobi, whose own guesses get nowhere on such a model, commits several
    tokens a forward -- planned apart from its window's guesses under auto -- and still writes exactly ar's tokens."""
    engine = cycling_engine(family)
    ar = generate(engine, "ar")
    for name in ("jacobi", "jacobi-mr"):
        for drafting in ("fixed", "auto"):
            on = generate(engine, name, {"block_size": 8, "drafting": drafting})
            off = generate(engine, name, {"block_size": 8, "drafting": drafting, "lookup": 0, "pool_size": 0}
                           if name == "jacobi-mr" else {"block_size": 8, "drafting": drafting, "lookup": 0})
            assert on.token_ids == off.token_ids == ar.token_ids, (name, drafting)
            assert ngram_accepted(on) > 0 and ngram_accepted(off) == 0, (name, drafting)
            assert on.footer["tpf"] > 2.0 and on.footer["tpf"] > off.footer["tpf"] + 0.5, (name, drafting)


def test_context_lookup_finds_the_latest_longest_earlier_occurrence():
    from studio.engine.strategies.base import Output
    from studio.engine.strategies.lookup import ContextLookup

    def output(tokens, max_new_tokens=100):
        return Output(None, max_new_tokens, frozenset(), token_ids=tokens)
    look = ContextLookup([5, 1, 2, 3, 9, 1, 2, 4, 7], shortest=2)
    assert look.drafts(3) == []                       # ...4 7: never before
    look.follow(output([1, 2]))                       # ...7 1 2: "1 2" was followed by 3, then (later) by 4
    assert look.drafts(3) == [4, 7, 1]                # the latest occurrence wins
    look.follow(output([1, 2, 3]))                    # output so far: 1 2 3 -> "1 2 3" occurred at the start
    assert look.drafts(2) == [9, 1]                   # the longest suffix wins over "2 3" / "3"
    look.follow(output([1, 2, 3], max_new_tokens=5))  # two tokens left: the forward's own one and a single draft
    assert look.drafts(3) == [9]
    look.follow(output([1, 2, 3], max_new_tokens=4))  # the last token is the forward's own: nothing to draft
    assert look.drafts(3) == []
    assert ContextLookup([1, 2, 1], shortest=1).drafts(4) == [2, 1]
    assert ContextLookup([1, 2, 1], shortest=2).drafts(4) == []

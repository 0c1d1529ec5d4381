"""S2D2 on LLaDA2 (its block grid from position 0, LLaDA2.1's token editing, the paper's presets) and on a D2F student
(a bidirectional right-shifted model + a block adapter): exactness on the real KV, commit and rollback paths, the
edit rule, and the refusals."""
import copy
from types import SimpleNamespace

import pytest
import torch

from studio.engine.lora import attach_adapter
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import DecodeContext, Output, make_strategy
from studio.errors import BadInput
from studio.presets import load_strategy_preset
from tests.support.dlm import (block_size_one_greedy, block_size_one_law, full_forward_row, generate, opened,
                               verifier_grid)
from tests.support.exact import chi_square_pvalue
from tests.support.lora import merged_model, random_adapter
from tests.support.tiny import tiny_mdm

PROMPT = [1, 2, 3, 4, 5, 6]   # with block 4: one prompt block prefilled, two prompt tokens open the first block


def llada2(vocab: int = 24, block: int = 4, seed: int = 5, **kw):
    """A tiny LLaDA2-like engine: block-causal on its grid from position 0, position-aligned, MASK = vocab - 1."""
    return tiny_mdm(attention="block", block=block, vocab=vocab, seed=seed, **kw)


def d2f(tmp_path, block: int = 4, seed: int = 5):
    """A tiny Dream-like engine (bidirectional, right-shifted) carrying a random D2F-style block adapter, and an
    oracle engine whose model is that adapter merged into the weights (the student on every row)."""
    engine = tiny_mdm(shift=True, vocab=24, seed=seed)
    attach_adapter(engine, random_adapter(tmp_path / "d2f", engine.model, seed=3, block_size=block))
    return engine, SimpleNamespace(config=engine.config, model=merged_model(engine.model))


# -- exactness -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["block", "causal"])
def test_greedy_always_verify_is_the_verifiers_greedy_decode_on_llada2(cache):
    """Every token is decided by the 2L verifier, so greedy S2D2 is the model's block-size-1 decode: token-causal on
    a causal cache; on LLaDA2's own block cache (the reference's), block-causal over the committed grid blocks, the
    prompt's included, and causal inside the open one. Covers the prompt tail in the first block and four commits."""
    engine = llada2()
    grid = verifier_grid(4) if cache == "block" else None
    want = block_size_one_greedy(engine, PROMPT, 14, grid)
    r = generate(engine, "s2d2", {"policy": "always", "cache": cache}, prompt=PROMPT, n=14)
    assert r.token_ids == want
    if cache == "block":   # the two caches decode differently: the test tells them apart
        assert want != block_size_one_greedy(engine, PROMPT, 14)


def _sampled_runs(engine, params: dict, prompt: list[int], n: int, seeds):
    """Whole sampled S2D2 runs of n tokens on one context: the prefill once, then per seed a copy of the strategy after
    it, the KV rolled back to the prefill (the real cache, commits and rollback). Yields (tokens, events)."""
    strat = make_strategy("s2d2", params)
    ctx = DecodeContext(engine.model, engine.tokenizer, SamplingParams(1.0), 0,
                        Output(engine.tokenizer, n, frozenset(), ()), engine.config.mask_token_id, 32)
    strat.start(ctx, prompt)
    prefilled = ctx.kv.length
    for seed in seeds:
        s = copy.deepcopy(strat)
        ctx.rollback(prefilled)
        ctx.out = Output(engine.tokenizer, n, frozenset(), ())
        ctx.gen.manual_seed(seed)
        while not ctx.out.finished:
            s.step(ctx)
        yield tuple(ctx.out.token_ids), ctx.drain()


def test_sampled_always_verify_keeps_the_verifiers_law_on_llada2s_block_cache():
    """Whole sequences of 2 tokens, vocab 3 (+ MASK), block 2: the first token is verified in the block the prompt's
    tail opens, the block is committed, the second is verified in a fresh block. The law is the block-cache
    verifier's (`verifier_grid`), not the causal model's."""
    engine = llada2(vocab=4, block=2, seed=4, dim=16)
    prompt, law_of = [0, 1, 2], lambda grid: block_size_one_law(engine, [0, 1, 2], 2, SamplingParams(1.0), grid)
    runs = list(_sampled_runs(engine, {"policy": "always"}, prompt, 2, range(600)))
    samples = [tokens for tokens, _ in runs]
    assert chi_square_pvalue(samples, law_of(verifier_grid(2))) > 0.01
    assert chi_square_pvalue(samples, law_of(None)) < 1e-3          # the test can see a wrong cache
    assert sum(e["t"] == "reject" for _, events in runs for e in events) > 100   # residual draws were exercised


# -- LLaDA2.1 editing ------------------------------------------------------------------------------------------------
def test_an_editing_step_edits_exactly_the_filled_non_prompt_slots_above_tau_edit():
    """One step on an open block holding two prompt tokens, four filled slots and two MASKs: the edits are the filled
    non-prompt slots whose prediction (an independent full forward on LLaDA2's grid) differs from their token and
    beats τ_edit -- never a MASK, never a prompt token, never one at or below τ_edit -- and the same forward's
    M2T fills a MASK."""
    engine = llada2(block=8)
    M, prompt = engine.config.mask_token_id, [7, 3, 9, 1, 12, 5, 2, 8, 4, 10]   # 8 prefilled, 2 open the block
    strat = make_strategy("s2d2", {"policy": "never", "edit_threshold": 0.0})
    ctx = opened(engine, strat, prompt)
    b = strat.block
    for j, t in zip(range(2, 6), [3, 7, 11, 19]):
        b.fill(j, t)
    with torch.inference_mode():
        ids = prompt[:8] + b.tokens
        grid = torch.tensor([p // 8 for p in range(16)])
        probs = torch.stack([torch.softmax(full_forward_row(engine.model, ids, row, grid[None, :] <= grid[:, None])
                                           .index_fill(0, torch.tensor([M]), float("-inf")), 0) for row in range(8, 16)])
    conf, pred = probs.max(-1)
    differs = [j for j in range(8) if pred[j] != b.tokens[j]]
    assert {0, 1} & set(differs), "a prompt slot would be edited were it not protected"
    candidates = sorted(conf[j].item() for j in differs if 2 <= j < 6)
    assert len(candidates) >= 2
    for tau in (0.0, (candidates[0] + candidates[-1]) / 2):
        s = copy.deepcopy(strat)
        s.params.edit_threshold = tau
        s._denoise(ctx, role="draft")
        edits = [e for e in ctx.drain() if e["t"] == "edit"]
        want = [j for j in differs if 2 <= j < 6 and conf[j] > tau]
        assert [p + 2 for e in edits for p in e["pos"]] == want and want
        assert [o for e in edits for o in e["old"]] == [b.tokens[j] for j in want]
        assert [s.block.tokens[j] for j in want] == [int(pred[j]) for j in want]
        assert s.block.tokens[:2] == prompt[8:] and sum(s.block.masked) < 2


def test_editing_runs_keep_edits_inside_the_open_block_and_emit_at_block_close():
    """A whole run with editing on: each edit replaces a filled token of the open block (never a MASK, never the
    prompt) with a different one more probable than τ_edit; output is emitted only as a block closes, and it is the
    block's final, edited content; a full block takes at most max_post_steps more forwards."""
    engine, tau, post = llada2(vocab=16, seed=2), 0.2, 2
    r = generate(engine, "s2d2", {"policy": "always", "edit_threshold": tau, "max_post_steps": post,
                                  "threshold": 0.5}, prompt=PROMPT, n=20)
    state: dict[int, int] = {}
    open_block, n_edits, post_forwards, most_post, emitted = None, 0, 0, 0, []
    events = r.events
    for i, e in enumerate(events):
        kind = e["t"]
        if kind == "block" and e["op"] == "open":
            open_block, post_forwards = range(e["start"], e["end"]), 0
        elif kind in ("unmask", "accept"):
            state.update(zip(e["pos"], e["tok"]))
        elif kind == "resample":
            state[e["pos"]] = e["tok"]
        elif kind == "edit":
            for p, old, tok, c in zip(e["pos"], e["old"], e["tok"], e["conf"]):
                assert p in open_block and state.get(p) == old != tok and c > tau
                state[p] = tok
                n_edits += 1
        elif kind == "forward" and e["role"] == "draft" and all(p in state for p in open_block):
            post_forwards += 1
            most_post = max(most_post, post_forwards)
        elif kind == "emit":   # only the open block's tokens, once it is full and leaves the loop (or ends the run)
            assert set(e["pos"]) <= set(open_block) and all(p in state for p in open_block)
            assert [state[p] for p in e["pos"]] == e["tok"]
            emitted += e["pos"]
            after = next((x for x in events[i + 1:] if x["t"] in ("block", "forward") and x.get("role") != "commit"),
                         None)
            assert after is None or after["t"] == "block" and after["op"] == "close"
    assert n_edits > 10 and emitted == list(range(20)) and most_post == post
    assert r.token_ids == [state[p] for p in range(20)]


def test_the_paper_presets_route_as_the_reference_code_does():
    """Conservative (score −5, static, c = 4): s = K̂ − 4 ≥ −4 always passes, so it verifies at every step with masks
    (the reference code's rule; the README's prose says otherwise). Quality (score 0): verify iff K̂ ≥ 4."""
    engine = llada2(vocab=16, seed=4, max_seq_len=256)
    for name, verifies in (("s2d2-llada21-conservative", lambda s: True), ("s2d2-llada21-quality", lambda s: s >= 0)):
        preset = load_strategy_preset(name)
        r = generate(engine, preset.strategy, preset.params, prompt=PROMPT, n=32)
        routes = [e for e in r.events if e["t"] == "route"]
        assert routes and all(e["verify"] == verifies(e["score"]) for e in routes)
        assert len(r.token_ids) == 32


# -- D2F on Dream ----------------------------------------------------------------------------------------------------
def test_d2f_drafts_under_a_bidirectional_prompt_and_blocks_after_it(tmp_path):
    """The drafter reads the block behind the whole prompt, prefilled bidirectionally, as D2F trains its student: the
    first draft equals a full forward of prompt + block under D2F's mask, the adapter on every row."""
    engine, oracle = d2f(tmp_path)
    strat = make_strategy("s2d2", {"adapter_rows": "all"})
    ctx = opened(engine, strat, PROMPT)
    b = strat.block
    assert b.start == len(PROMPT) and not b.masked[0] and all(b.masked[1:])   # slot 0: the prompt's last row's token
    d = strat._draft(ctx)
    ids = PROMPT + b.tokens
    grid = torch.tensor([0] * len(PROMPT) + [1] * b.size)
    rows = [full_forward_row(oracle.model, ids, b.start + j - 1, grid[None, :] <= grid[:, None]) for j in d.slots]
    M = engine.config.mask_token_id
    want = torch.softmax(torch.stack(rows).index_fill(1, torch.tensor([M]), float("-inf")), -1)
    assert torch.allclose(d.dist, want, atol=1e-5)


@pytest.mark.parametrize("cache", ["block", "causal"])
def test_greedy_always_verify_on_a_d2f_student_is_its_causal_decode(tmp_path, cache):
    """Causal verify + right shift on the D2F student: greedy S2D2 is the student decoding token by token behind its
    bidirectional prompt (D2F's verifier with target block 1), over block-causal committed blocks or causal ones."""
    engine, oracle = d2f(tmp_path)
    grid = verifier_grid(4 if cache == "block" else 1, origin=len(PROMPT))
    r = generate(engine, "s2d2", {"policy": "always", "cache": cache, "adapter_rows": "all"}, prompt=PROMPT, n=14)
    assert r.token_ids == block_size_one_greedy(oracle, PROMPT, 14, grid)
    assert all(e["lora_rows"] == e["n_tokens"] for e in r.events if e["t"] == "forward")


# -- refusals --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, params", [
    ("s2d2", {"edit_threshold": 1.5}), ("s2d2", {"edit_threshold": -0.1}), ("blockdiff", {"max_post_steps": -1}),
    ("s2d2", {"edit_threshold": 0.9, "causal_prefix": True}), ("simsd", {"edit_threshold": 0.9})])
def test_bad_editing_params_are_refused(strategy, params):
    with pytest.raises(BadInput):
        make_strategy(strategy, params)


def test_s2d2_refuses_a_bidirectional_model_without_a_d2f_adapter(tmp_path):
    with pytest.raises(BadInput, match="D2F"):
        generate(tiny_mdm(shift=True), "s2d2", {}, n=4)
    engine, _ = d2f(tmp_path)
    with pytest.raises(BadInput, match="adapter_rows=all"):
        generate(engine, "s2d2", {}, n=4)
    with pytest.raises(BadInput, match="right-shifted"):   # editing is LLaDA2.1's: position-aligned
        generate(engine, "s2d2", {"adapter_rows": "all", "edit_threshold": 0.5}, n=4)

"""Canvas decoding (LLaDA's pipeline, Fast-dLLM's rules) against a plainly written reference loop, and the AR case."""
from __future__ import annotations

import re

import pytest
import torch

from studio.engine.masks import bidirectional
from studio.engine.strategies import make_strategy
from studio.engine.strategies.canvas import select_factor
from studio.errors import BadInput
from studio.run.session import Settings, kv_length_needed
from tests.support.dlm import generate
from tests.support.tiny import tiny_engine, tiny_mdm

PROMPT = [1, 2, 3, 4, 5]


def reference(engine, G: int, B: int, steps: int, threshold: float = 0.0) -> list[int]:
    """LLaDA's generate, greedy, written out: every step a fresh bidirectional forward over prompt + canvas; the
    open block's MASKs ranked by their softmax confidence (MASK itself never predicted); the scheduled number (or,
    with a threshold, every one above it and at least the best) filled; blocks left to right."""
    model, M, shift = engine.model, engine.config.mask_token_id, engine.config.logit_shift
    x, P = PROMPT + [M] * G, len(PROMPT)
    per_block = steps // (G // B)
    for b in range(G // B):
        lo, hi = P + b * B, P + (b + 1) * B
        s = 0
        while masked := [i for i in range(lo, hi) if x[i] == M]:
            with torch.inference_mode():
                logits = model(torch.tensor(x), torch.arange(len(x)), model.new_cache(len(x)),
                               mask=bidirectional(len(x), 0))[0]
                probs = torch.softmax(logits.float().index_fill(-1, torch.tensor([M]), float("-inf")), dim=-1)
            conf, tok = probs.max(dim=-1)
            row = {i: i - 1 if shift else i for i in masked}
            ranked = sorted(masked, key=lambda i: -conf[row[i]].item())
            if threshold:
                chosen = [i for i in ranked if conf[row[i]] > threshold] or ranked[:1]
            else:
                chosen = ranked[:B // per_block + (1 if s < B % per_block else 0)]
            for i in chosen:
                x[i] = int(tok[row[i]])
            s += 1
    return x[P:]


@pytest.mark.parametrize("shift", [False, True])          # LLaDA (position-aligned), Dream (shifted)
@pytest.mark.parametrize("B, steps, threshold", [(4, 8, 0.0), (8, 4, 0.0), (4, 8, 0.2)])
def test_canvas_decoding_fills_what_llada_s_loop_fills(shift, B, steps, threshold):
    engine = tiny_mdm(shift=shift, seed=3)
    run = generate(engine, "canvas", {"block_size": B, "steps": steps, "threshold": threshold}, prompt=PROMPT, n=8)
    assert run.token_ids == reference(engine, 8, B, steps, threshold)
    forwards = run.footer["forwards"]
    assert forwards == steps if not threshold else forwards <= steps


@pytest.mark.parametrize("engine", [tiny_engine("llama", vocab=16, seed=1), tiny_mdm(shift=True, seed=1)],
                         ids=["ar-model", "dream-style"])
def test_one_token_per_step_over_a_causal_canvas_is_greedy_ar(engine):
    """Block 1, one step per token and causal attention: each step predicts the next token from the prompt and the
    tokens before it, as AR does (the canvas's MASKs after it are invisible) -- on an AR model, and on a shifted
    masked-diffusion model (Dream-style), whose ar is its AR mode under the same causal mask."""
    canvas = generate(engine, "canvas", {"block_size": 1, "attention": "causal"}, prompt=PROMPT, n=10)
    assert canvas.token_ids == generate(engine, "ar", prompt=PROMPT, n=10).token_ids


def test_guidance_runs_a_second_forward_with_the_prompt_masked_and_random_remasking_follows_the_seed():
    engine = tiny_mdm(seed=2)
    guided = generate(engine, "canvas", {"block_size": 4, "cfg_scale": 1.5}, prompt=PROMPT, n=8)
    assert guided.footer["forwards"] == 2 * 8
    assert guided.token_ids != generate(engine, "canvas", {"block_size": 4}, prompt=PROMPT, n=8).token_ids
    runs = [generate(engine, "canvas", {"block_size": 8, "steps": 4, "remasking": "random"}, prompt=PROMPT, n=8,
                     seed=s).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] and len(runs[2]) == 8


def test_fast_dllm_factor_rule_takes_the_best_while_they_clear_their_bar():
    # bars 1 - f/(n+1) with f = 1: n=2 -> 0.667, n=3 -> 0.75, n=4 -> 0.8
    assert select_factor([0.5, 0.99, 0.7, 0.6, 0.1], 1.0) == [1, 2]       # 0.99 always; 0.7 >= 0.667; 0.6 < 0.75
    assert select_factor([0.2, 0.1], 1.0) == [0, 1]                      # a miss at the last candidate takes it too
    assert select_factor([0.3], 1.0) == [0]


@pytest.mark.parametrize("params, n, needle", [
    ({"block_size": 4}, 10, "--max-new-tokens 10 (the canvas) is not a multiple of the block size 4"),
    ({"block_size": 4, "steps": 3}, 8, "steps 3 do not divide among 2 blocks of 4"),
])
def test_a_canvas_that_does_not_split_is_one_line(params, n, needle):
    with pytest.raises(BadInput, match=re.escape(needle)):
        kv_length_needed(tiny_mdm(), make_strategy("canvas", params), Settings(max_new_tokens=n), PROMPT)


def test_an_ar_model_is_refused_unless_its_attention_is_named_and_bad_values_are_one_line():
    with pytest.raises(BadInput, match="is an AR model, trained with causal attention and no blocks"):
        kv_length_needed(tiny_engine(), make_strategy("canvas"), Settings(max_new_tokens=8), PROMPT)
    kv_length_needed(tiny_engine(), make_strategy("canvas", {"attention": "causal"}), Settings(max_new_tokens=8), PROMPT)
    for params, needle in (({"threshold": 1.5}, r"threshold must be in \[0, 1\]"), ({"factor": -1}, "factor"),
                           ({"threshold": 0.9, "factor": 1.0}, "not both"), ({"remasking": "x"}, "remasking"),
                           ({"prefix_look": 4}, "refresh a cache"), ({"cache": "prefix", "after_look": 2}, "only cache=dual"),
                           ({"credit_beta": 2}, "credit_beta")):
        with pytest.raises(BadInput, match=needle):
            make_strategy("canvas", params)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_cache_rebuilt_every_step_decodes_what_no_cache_decodes(cache):
    engine = tiny_mdm(seed=4)
    none = generate(engine, "canvas", {"block_size": 4}, prompt=PROMPT, n=12)
    cached = generate(engine, "canvas", {"block_size": 4, "cache": cache, "refresh_every": 1}, prompt=PROMPT, n=12)
    assert cached.token_ids == none.token_ids and cached.footer["forwards"] == none.footer["forwards"]


def test_the_prefix_cache_is_exact_under_block_causal_attention():
    """LLaDA2's attention: the K/V before the open block never see it, so reusing them is exact; the canvas is
    filled in blocks of 2 over the model's grid of 4 (a block starting mid-grid-block)."""
    engine = tiny_mdm(attention="block", block=4, seed=5)
    for B in (4, 2):
        none = generate(engine, "canvas", {"block_size": B}, prompt=PROMPT, n=8)
        assert generate(engine, "canvas", {"block_size": B, "cache": "prefix"}, prompt=PROMPT, n=8).token_ids == \
            none.token_ids


def test_caches_on_a_bidirectional_canvas_rebuild_at_each_block_and_match_where_the_cache_is_fresh(tmp_path):
    """One step per block: every step is a block's first, a full forward, so prefix and dual equal no cache; with
    more steps they decode the whole canvas from K/V up to a block old, each block opening with a rebuild: a
    rollback, a commit and the refresh of the slots it recomputed, in the trace."""
    from studio.events import read_trace
    engine = tiny_mdm(seed=6)
    none = generate(engine, "canvas", {"block_size": 4, "steps": 2}, prompt=PROMPT, n=8)
    for cache in ("prefix", "dual"):
        assert generate(engine, "canvas", {"block_size": 4, "steps": 2, "cache": cache}, prompt=PROMPT,
                        n=8).token_ids == none.token_ids
        run = generate(engine, "canvas", {"block_size": 4, "cache": cache}, prompt=PROMPT, n=8,
                       trace=str(tmp_path / f"{cache}.jsonl"))
        assert len(run.token_ids) == 8 and run.footer["forwards"] == 8
        kv = [(e["op"], e["from_len"], e["to_len"]) for e in read_trace(tmp_path / f"{cache}.jsonl").events
              if e["t"] == "kv"]
        a, b = {"prefix": [5, 9], "dual": [13, 13]}[cache]    # the prefix before each block, or all 13 slots
        assert kv == [("commit", 0, a), ("refresh", 0, a), ("rollback", a, 0), ("commit", 0, b), ("refresh", 0, b)]


@pytest.mark.parametrize("cache, attention, shift", [("prefix", "bidirectional", False), ("dual", "bidirectional", False),
                                                     ("prefix", "block", False), ("prefix", "bidirectional", True),
                                                     ("dual", "bidirectional", True)])
def test_a_cached_step_over_an_unchanged_canvas_gives_the_full_forwards_logits(cache, attention, shift):
    """The cached forward (the block and what follows it against the prefix's K/V, or the block alone written into
    the cached K/V) reproduces the rebuilding forward's rows while nothing has changed since the rebuild."""
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import DecodeContext, Output
    engine = tiny_mdm(attention=attention, block=4 if attention == "block" else None, shift=shift, seed=7)
    strategy = make_strategy("canvas", {"block_size": 4, "cache": cache})
    ctx = DecodeContext(engine.model, engine.tokenizer, SamplingParams(), 0, Output(engine.tokenizer, 12, frozenset()),
                        engine.config.mask_token_id, 64)
    strategy.start(ctx, PROMPT * 2)   # 10 prompt tokens: the canvas opens mid-grid-block
    strategy.block_start += 4                     # the second block, so there is a prefix of canvas too
    slots = list(range(strategy.block_start, strategy.block_start + 4))
    full = strategy._logits(ctx, slots)
    assert ctx.kv.length == {"prefix": 14 if attention == "bidirectional" else 12, "dual": len(strategy.tokens)}[cache]
    cached = strategy._logits(ctx, slots)   # a shifted model's first slot: the row before the block, recomputed
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=0)


def dream_reference(engine, G: int, steps: int, alg: str, eps: float = 1e-3) -> list[int]:
    """Dream's diffusion_generate, greedy, written out: one canvas, t = linspace(1, eps, steps + 1); step i fills
    int(masked * (1 - t[i+1]/t[i])) MASKs (the last step all) with the best scores -- the confidence (maskgit_plus),
    top-1 - top-2 (topk_margin) or sum p log p (entropy) -- each from the row before it (logits shifted right)."""
    model, M = engine.model, engine.config.mask_token_id
    x, P = PROMPT + [M] * G, len(PROMPT)
    t = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        masked = [j for j in range(P, P + G) if x[j] == M]
        if not masked:
            break
        with torch.inference_mode():
            logits = model(torch.tensor(x), torch.arange(len(x)), model.new_cache(len(x)),
                           mask=bidirectional(len(x), 0))[0]
            probs = torch.softmax(logits.float().index_fill(-1, torch.tensor([M]), float("-inf")), dim=-1)
        rows = probs[[j - 1 for j in masked]]
        top2 = rows.topk(2, dim=-1).values
        score = {"maskgit_plus": top2[:, 0], "topk_margin": top2[:, 0] - top2[:, 1],
                 "entropy": (rows * rows.clamp_min(1e-30).log()).sum(-1)}[alg]
        k = len(masked) if i == steps - 1 else int(len(masked) * (1 - t[i + 1] / t[i]))
        for r in score.topk(k).indices.tolist():
            x[masked[r]] = int(rows[r].argmax())
    return x[P:]


@pytest.mark.parametrize("alg, remasking", [("maskgit_plus", "low_confidence"), ("topk_margin", "margin"),
                                            ("entropy", "entropy")])
@pytest.mark.parametrize("steps", [8, 3])
def test_dream_s_schedule_and_scores_fill_what_its_loop_fills(alg, remasking, steps):
    engine = tiny_mdm(shift=True, seed=8)
    run = generate(engine, "canvas", {"schedule": "dream", "steps": steps, "remasking": remasking}, prompt=PROMPT, n=8)
    assert run.token_ids == dream_reference(engine, 8, steps, alg)


def test_dream_s_origin_and_sampled_positions_run_and_follow_the_seed():
    engine = tiny_mdm(shift=True, seed=8)
    for params in ({"schedule": "dream", "remasking": "origin", "steps": 4},
                   {"schedule": "dream", "remasking": "entropy", "alg_temp": 0.5, "steps": 4},
                   {"remasking": "origin", "block_size": 4, "steps": 4}):   # origin at the linear schedule's share
        runs = [generate(engine, "canvas", params, prompt=PROMPT, n=8, seed=s).token_ids for s in (3, 3)]
        assert runs[0] == runs[1] and len(runs[0]) == 8


def test_each_step_proposes_the_open_blocks_masks_and_fills_some_of_them():
    """The trace shows the model's guess for every MASK of the open block at each step (propose, src diffusion,
    unverified) and the ones the rule filled (unmask), with the same token and confidence; the header lays out the
    canvas."""
    run = generate(tiny_mdm(seed=3), "canvas", {"block_size": 4, "threshold": 0.3}, prompt=PROMPT, n=8)
    assert run.header["canvas"] == {"length": 8, "block_size": 4}
    masked, guesses = set(range(8)), None
    for e in run.events:
        if e["t"] == "propose":
            assert e["src"] == "diffusion" and set(e["pos"]) == {p for p in masked if p < (min(masked) // 4 + 1) * 4}
            guesses = dict(zip(e["pos"], zip(e["tok"], e["q"])))
        elif e["t"] == "unmask":
            assert e["pos"] and all(guesses[p] == (t, c) for p, t, c in zip(e["pos"], e["tok"], e["conf"]))
            masked -= set(e["pos"])
    assert not masked and not any(e["t"] in ("accept", "reject") for e in run.events)


@pytest.mark.parametrize("decoder", ["hierarchical", "credit"])
def test_dinfer_decoders_fill_on_a_block_causal_canvas_what_blockdiff_fills(decoder):
    """Under LLaDA2's block-causal grid a canvas block aligned with the grid sees what blockdiff's draft sees, so the
    shared dInfer decoders (hierarchical runs, credit-fused logits) fill the same tokens in both."""
    engine = tiny_mdm(attention="block", block=4, vocab=24, seed=9)
    params = {"block_size": 4, "threshold": 0.2, "decoder": decoder, "low_threshold": 0.05}
    canvas = generate(engine, "canvas", dict(params, cache="prefix"), prompt=PROMPT[:4], n=12)
    assert canvas.token_ids == generate(engine, "blockdiff", params, prompt=PROMPT[:4], n=12).token_ids
    assert canvas.footer["forwards"] < 12   # the thresholds filled several tokens in some steps


@pytest.mark.parametrize("cache, look", [("prefix", {"prefix_look": 64}), ("dual", {"prefix_look": 64, "after_look": 64}),
                                         ("dual", {"warmup_steps": 64})])
def test_a_vicinity_covering_the_whole_canvas_or_a_warmup_as_long_as_the_run_is_no_cache(cache, look):
    engine = tiny_mdm(seed=4)
    none = generate(engine, "canvas", {"block_size": 4, "steps": 12}, prompt=PROMPT, n=12)
    cached = generate(engine, "canvas", {"block_size": 4, "steps": 12, "cache": cache, **look}, prompt=PROMPT, n=12)
    assert cached.token_ids == none.token_ids


def test_the_vicinity_is_recomputed_every_step_and_each_refresh_is_in_the_trace():
    engine = tiny_mdm(seed=4)
    run = generate(engine, "canvas", {"block_size": 4, "cache": "dual", "prefix_look": 2, "after_look": 1},
                   prompt=PROMPT, n=12)
    refreshes = [(e["step"], e["from_len"], e["to_len"]) for e in run.events if e["t"] == "kv" and e["op"] == "refresh"]
    assert [r for r in refreshes if r[1] == 0] == [(1, 0, 17), (5, 0, 17), (9, 0, 17)]   # a rebuild per block
    # the other steps: the window [block - 2, block + 4 + 1) around each block (absolute slots, 5 prompt tokens)
    assert [r[1:] for r in refreshes if r[1]] == [(3, 10)] * 3 + [(7, 14)] * 3 + [(11, 17)] * 3


def test_after_an_early_eos_the_canvas_is_decoded_as_padding_unless_early_stop_and_never_counted():
    plain = generate(tiny_mdm(seed=3), "canvas", {"block_size": 4}, prompt=PROMPT, n=12).token_ids
    eos = plain[2]
    engine = tiny_mdm(seed=3, eos_ids=[eos])
    full = generate(engine, "canvas", {"block_size": 4}, prompt=PROMPT, n=12)
    early = generate(engine, "canvas", {"block_size": 4, "early_stop": True}, prompt=PROMPT, n=12)
    cut = plain.index(eos) + 1
    assert full.token_ids == early.token_ids == plain[:cut] and full.footer["stop_reason"] == "eos"
    assert full.footer["forwards"] == 12 and early.footer["forwards"] == 4   # a token a step, to the canvas end
    assert full.footer["n_tokens"] == cut and full.footer["tpf"] == cut / 12   # padding is never output
    padded = {p for e in full.events if e["t"] == "unmask" for p in e["pos"]}
    assert padded == set(range(12))   # the whole canvas was filled, the padding after EOS too


def test_ar_is_the_ar_mode_of_a_masked_diffusion_model_where_it_has_one():
    """Block-causal and position-aligned (LLaDA2): block size 1, a MASK after the pending token whose row is the next
    token; shifted and bidirectional (Dream): its next-token rows under a causal mask, i.e. the same weights' AR."""
    from tests.support.dlm import block_size_one_greedy
    llada2 = tiny_mdm(attention="block", block=4, vocab=24, seed=2)
    assert generate(llada2, "ar", prompt=PROMPT, n=12).token_ids == block_size_one_greedy(llada2, PROMPT, 12)
    dream, same_weights_ar = tiny_mdm(shift=True, seed=2), tiny_engine("llama", seed=2)
    assert generate(dream, "ar", prompt=PROMPT, n=12).token_ids == \
        generate(same_weights_ar, "ar", prompt=PROMPT, n=12).token_ids


def smoothing_reference(engine, G: int, threshold: float, cw=0.3, init=0.15, growth=0.02, decay=0.02) -> list[int]:
    """dInfer's iteration smoothing over one canvas block, greedy, written out: step t forwards the canvas with every
    still-MASK position fed E[MASK] + w_t * softmax(logits) @ E from the step before, fills (threshold rule) every MASK
    above max(1 - decay * t, threshold), at least the best, and sets w_t = min(init + growth * t, cw) for the rest."""
    model, M = engine.model, engine.config.mask_token_id
    x, P = PROMPT + [M] * G, len(PROMPT)
    E = model.model.embed_tokens.weight
    soft: dict[int, torch.Tensor] = {}
    t = 0
    while masked := [i for i in range(P, P + G) if x[i] == M]:
        shift = torch.zeros(len(x), E.shape[1])
        for i, v in soft.items():
            shift[i] = v
        with torch.inference_mode():
            logits = model(torch.tensor(x), torch.arange(len(x)), model.new_cache(len(x)),
                           mask=bidirectional(len(x), 0), embed_shift=shift)[0]
        logits = logits.index_fill(-1, torch.tensor([M]), float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        conf, tok = probs.max(dim=-1)
        bar = max(1 - decay * t, threshold)
        chosen = [i for i in masked if conf[i] > bar] or [max(masked, key=lambda i: conf[i].item())]
        w = min(init + growth * t, cw)
        for i in masked:
            soft[i] = w * (probs[i] @ E[:probs.shape[-1]])
        for i in chosen:
            x[i] = int(tok[i])
            soft.pop(i)
        t += 1
    return x[P:]


def test_iteration_smoothing_feeds_open_masks_their_expected_embedding_as_dinfer_does():
    engine = tiny_mdm(seed=5)
    params = {"threshold": 0.3, "cont_weight": 0.3}
    run = generate(engine, "canvas", params, prompt=PROMPT, n=8)
    assert run.token_ids == smoothing_reference(engine, 8, 0.3)
    # the expected embeddings matter here: without them (w = 0, the same threshold decay) other tokens are filled
    assert run.token_ids != smoothing_reference(engine, 8, 0.3, cw=0.0, init=0.0, growth=0.0)


def test_the_summary_line_of_a_canvas_run_claims_no_prefill():
    """Its prompt is part of every forward: no "prefill 0 tokens 0.00s"; an ar run still says what it prefilled."""
    from studio.viz.text import run_summary_line
    r = generate(tiny_mdm(), "canvas", {"block_size": 4}, prompt=PROMPT, n=8)
    line = run_summary_line(r.footer, "canvas", r.events)
    assert "prefill" not in line and line.endswith(f"tok/s  stop {r.footer['stop_reason']}")
    ar = generate(tiny_engine(), "ar", prompt=PROMPT, n=4)
    assert f"prefill {len(PROMPT)} tokens" in run_summary_line(ar.footer, "ar", ar.events)

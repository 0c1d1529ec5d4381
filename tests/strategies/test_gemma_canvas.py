"""gemma-canvas, DiffusionGemma's own loop as a strategy, on a tiny random DiffusionGemma: what its events say (a
viewer rebuilding the canvas from them sees what the decoder reads), the KV moves and forward counts behind TPF, the
end at an EOS, the trace and its replay, and the one-line refusals. Its tokens against transformers' generate:
tests/engine/test_diffusion_gemma.py."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from studio.engine.families import read_config
from studio.engine.engine import Engine
from studio.engine.random_models import build_random
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import DecodeContext, Output, make_strategy
from studio.errors import BadInput
from studio.events import read_trace
from studio.run.session import Settings, kv_length_needed, run_to_end
from tests.support.tiny import TinyTokenizer, tiny_engine, tiny_mdm

PROMPT = [1, 2, 3, 4, 5, 6]   # longer than the sliding window of 4
C = 4                         # the model's canvas length
# stability 0: a canvas stops at its first confident step, so canvases of different lengths occur
PARAMS = dict(max_denoising_steps=4, entropy_bound=1.0, stability_threshold=0, confidence_threshold=0.5)


def tiny_gemma(eos_ids=(), seed=0) -> Engine:
    """A DiffusionGemma of two layers (a sliding one, a full one) and 4 experts over 32 tokens, canvas 4; matrices
    scaled up so the draws are peaked enough that steps keep several and renoise others."""
    raw = {"model_type": "diffusion_gemma", "canvas_length": C, "text_config": dict(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1, sliding_window=4,
        num_experts=4, top_k_experts=2, moe_intermediate_size=16, max_position_embeddings=256)}
    cfg = dataclasses.replace(read_config(raw, name="tiny-gemma"), eos_ids=list(eos_ids))
    model = build_random(cfg, torch.device("cpu"), torch.float32, seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(30)
    return Engine(model=model, tokenizer=TinyTokenizer(32, eos_ids), config=cfg, name="tiny-gemma", source="test",
                  load_s=0.0, from_cache=False)


def by_step(events: list[dict]) -> list[list[dict]]:
    steps: dict[int, list[dict]] = {}
    for e in events:
        steps.setdefault(e["step"], []).append(e)
    return [steps[k] for k in sorted(steps)]


def test_the_events_show_the_canvas_the_decoder_reads_and_its_argmax_becomes_the_output():
    """Driven step by step: every step is one forward; a viewer applying `remask` (the noise drawn) and `unmask`
    (the draws kept) holds exactly the canvas the next decoder pass reads; `propose` gives the model's draw at each
    renoised cell; a canvas's last step shows its argmax, emits it and closes the block."""
    engine = tiny_gemma()
    strategy = make_strategy("gemma-canvas", PARAMS)
    out = Output(engine.tokenizer, 3 * C, frozenset())
    ctx = DecodeContext(engine.model, engine.tokenizer, SamplingParams(), 0, out, None, len(PROMPT) + 4 * C)
    strategy.start(ctx, PROMPT)
    shown: dict[int, int] = {}
    closed, kept_some_renoised_some, steps_per_canvas, draws = 0, False, [], 0

    def apply(events):
        for e in events:
            if e["t"] in ("remask", "unmask"):
                shown.update(zip(e["pos"], e["tok"]))
    apply(ctx.drain())
    while not strategy.finished(ctx):
        strategy.step(ctx)
        events = ctx.drain()
        kinds = [e["t"] for e in events]
        assert kinds.count("forward") == 1
        apply(events)
        start = strategy.start_pos
        cells = [shown[start + i] for i in range(C)]
        if kinds[0] == "forward" and events[0]["role"] == "commit":   # the finished canvas's encoder pass
            assert kinds == ["forward", "kv", "block", "remask"] and events[1]["op"] == "commit"
            assert cells == strategy.canvas.tokens.tolist()            # a new canvas of noise
            steps_per_canvas.append(draws)
            draws = 0
            continue
        draws += 1
        if "emit" in kinds:                                             # the canvas's last step
            assert kinds == ["forward", "unmask", "emit", "block"] and events[3]["op"] == "close"
            assert events[1]["pos"] == list(range(start, start + C))
            assert events[2]["tok"] == cells == out.token_ids[start:]  # the argmax, final
            closed += 1
            continue
        unmask = next(e for e in events if e["t"] == "unmask")
        remask = [e for e in events if e["t"] == "remask"]
        propose = [e for e in events if e["t"] == "propose"]
        assert cells == strategy.canvas.tokens.tolist()                # what the next pass reads
        renoised = remask[0]["pos"] if remask else []
        assert sorted(unmask["pos"] + renoised) == list(range(start, start + C))
        if remask:
            kept_some_renoised_some = True
            assert propose[0]["pos"] == renoised and propose[0]["src"] == "diffusion"
            assert all(0 < q <= 1 for q in propose[0]["q"]) and len(propose[0]["tok"]) == len(renoised)
    steps_per_canvas.append(draws)
    assert closed == 3 and len(out.token_ids) == 3 * C
    assert kept_some_renoised_some and len(set(steps_per_canvas)) > 1   # the test saw both, and an early stop


def test_a_run_s_trace_counts_encoder_passes_as_forwards_and_replays(tmp_path):
    """The committed K/V: the prompt, then each finished canvas through the encoder (a `commit` forward); decoder
    passes move nothing. TPF = tokens / (decoder + encoder passes). A --max-new-tokens that is not a multiple of the
    canvas decodes whole canvases and emits up to it. The trace validates; `trace info` and `trace replay` read it."""
    import json

    from typer.testing import CliRunner

    from studio.cli import app
    path = tmp_path / "gemma.jsonl"
    run = run_to_end(tiny_gemma(), make_strategy("gemma-canvas", PARAMS), Settings(max_new_tokens=3 * C - 1), "", PROMPT, trace_path=str(path))
    events, footer = read_trace(path).events, run.footer
    assert events == run.events
    forwards = [e for e in events if e["t"] == "forward"]
    assert [(e["role"], e["n_tokens"]) for e in forwards if e["role"] != "draft"] == \
        [("prefill", len(PROMPT)), ("commit", C), ("commit", C)]
    assert [(e["op"], e["from_len"], e["to_len"]) for e in events if e["t"] == "kv"] == \
        [("commit", 0, 6), ("commit", 6, 6 + C), ("commit", 6 + C, 6 + 2 * C)]
    assert footer["forwards"] == len(forwards) - 1 and footer["n_tokens"] == 3 * C - 1
    assert footer["tpf"] == pytest.approx((3 * C - 1) / (len(forwards) - 1))
    assert run.header["canvas"] == {"length": 3 * C, "block_size": C}
    assert [e["op"] for e in events if e["t"] == "block"] == ["open", "close"] * 3
    info = CliRunner().invoke(app, ["trace", "info", str(path), "--json"])
    assert info.exit_code == 0, info.output
    replay = json.loads(info.stdout)
    assert replay["footer_mismatch"] == [] and replay["metrics"]["forwards"] == footer["forwards"]
    assert replay["events"]["by_kind"]["remask"] >= 3 and replay["metrics"]["n_tokens"] == 3 * C - 1
    shown = CliRunner().invoke(app, ["trace", "replay", str(path), "--speed", "0"])
    assert shown.exit_code == 0, shown.output
    done = f"done · max_new_tokens · {3 * C - 1} tokens · {footer['forwards']} forwards"
    assert done in " ".join(shown.stdout.split())


def test_an_eos_ends_the_run_and_the_cells_after_it_are_filled_never_emitted():
    free = run_to_end(tiny_gemma(), make_strategy("gemma-canvas", PARAMS), Settings(max_new_tokens=3 * C), "", PROMPT)
    # an EOS inside the second canvas, not its last cell, that the output holds nowhere before
    end = next(i for i in range(C, 2 * C - 1) if free.token_ids[i] not in free.token_ids[:i]) + 1
    eos = free.token_ids[end - 1]
    run = run_to_end(tiny_gemma(eos_ids=[eos]), make_strategy("gemma-canvas", PARAMS), Settings(max_new_tokens=3 * C), "", PROMPT)
    assert run.token_ids == free.token_ids[:end] and run.footer["stop_reason"] == "eos"
    last = [e for e in run.events if e["t"] == "unmask"][-1]
    canvas = end - 1 - (end - 1) % C
    assert last["pos"] == list(range(canvas, canvas + C)) and last["tok"] == free.token_ids[canvas:canvas + C]
    assert max(p for e in run.events if e["t"] == "emit" for p in e["pos"]) == end - 1
    assert (run.events[-1]["t"], run.events[-1]["op"]) == ("block", "close")   # and no encoder pass after it
    roles = [e["role"] for e in run.events if e["t"] == "forward"]
    assert roles.count("commit") == canvas // C


def test_refusals_are_one_line():
    gemma = tiny_gemma()
    for engine in (tiny_engine(), tiny_mdm()):   # an AR model, a LLaDA-like one
        with pytest.raises(BadInput, match="is not a DiffusionGemma model; gemma-canvas runs DiffusionGemma's own"):
            kv_length_needed(engine, make_strategy("gemma-canvas"), Settings(max_new_tokens=8), PROMPT)
    with pytest.raises(BadInput, match=re.escape("strategy gemma-canvas runs and 'canvas' does not")):
        kv_length_needed(gemma, make_strategy("canvas"), Settings(max_new_tokens=8), PROMPT)
    with pytest.raises(BadInput, match="its own temperature schedule .* --temperature, --top-k and --top-p"):
        kv_length_needed(gemma, make_strategy("gemma-canvas"),
                         Settings(max_new_tokens=8, sampling=SamplingParams(temperature=0.7)), PROMPT)
    with pytest.raises(BadInput, match="strategies that fit: blockdiff, canvas, s2d2, simsd$"):   # never gemma-canvas
        kv_length_needed(tiny_mdm(), make_strategy("isd"), Settings(max_new_tokens=8), PROMPT)
    for params, needle in (({"max_denoising_steps": 0}, "max_denoising_steps >= 1"),
                           ({"entropy_bound": 0.0}, "entropy_bound must be > 0"),
                           ({"t_min": 0.9}, "0 < t_min <= t_max, got 0.9, 0.8")):
        with pytest.raises(BadInput, match=re.escape(needle)):
            make_strategy("gemma-canvas", params)


def test_a_model_producing_nan_is_a_one_line_error_in_either_pass():
    # a layer: the prompt's encoder pass fails; the self-conditioning MLP: the second decoder pass, the first it runs
    for module, where in (("layers.0.mlp.down_proj", "forward 0 (prefill)"),
                          ("self_conditioning.down_proj", "forward 2 (draft)")):
        engine = tiny_gemma()
        with torch.no_grad():
            engine.model.model.get_submodule(module).weight[0, 0] = float("nan")
        with pytest.raises(BadInput, match=re.escape(f"NaN logits at {where}")) as e:
            run_to_end(engine, make_strategy("gemma-canvas", PARAMS), Settings(max_new_tokens=C), "", PROMPT)
        assert "\n" not in str(e.value)

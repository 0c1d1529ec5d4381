"""The steppable run (advance, cancel, lock-step drive) and multi-turn conversations with KV reuse."""
import pytest
import torch

from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.events import read_trace
from studio.events.metrics import prefill_tokens
from studio.run.conversation import Conversation
from studio.run.session import CANCELLED, Run, Settings, drive, prepare, run_to_end
from studio.viz.text import run_summary_line
from tests.support.dlm import full_forward_row
from tests.support.tiny import tiny_dlm, tiny_engine

PROMPT = [1, 2, 3, 4]


def settings(n=24, temperature=0.0, seed=0):
    return Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=seed)


@pytest.mark.parametrize("name", ["ar", "isd", "jacobi"])
def test_advancing_by_hand_equals_session_run(name):
    engine = tiny_engine("llama", vocab=24, seed=3)
    whole = run_to_end(engine, make_strategy(name), settings(temperature=1.0, seed=4), "", PROMPT)
    run = Run(prepare(engine, make_strategy(name)), settings(temperature=1.0, seed=4), "", PROMPT)
    batches = []
    while not run.done:
        batches.append(run.advance())
    assert run.result.token_ids == whole.token_ids
    assert [e for b in batches for e in b] == run.result.events
    # one strategy step per advance: every batch starts with its forward (after the plan for it, if it has one)
    first = [next(e for e in b if e["t"] != "plan") for b in batches if b]
    assert first[0]["role"] == "prefill" and all(b for b in batches[:-1])
    assert all(e["t"] == "forward" for e in first)
    assert run.forwards == run.result.footer["forwards"]
    assert run.advance() == []


@pytest.mark.parametrize("name, packed", [("ar", False), ("isd", True)])
def test_a_run_of_wide_forwards_packs_the_weights_before_its_clock_starts(name, packed):
    """The CPU's packed weight copies are made by `prepare`, not inside a run's timed forwards; an ar run, whose
    forwards are one row wide, never uses them and makes none."""
    engine = tiny_engine("llama", vocab=24, seed=3)
    prepare(engine, make_strategy(name))
    weights = [m.weight for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(getattr(w, "_onednn", None), tuple) == packed for w in weights)


def test_prepare_measures_the_forward_costs_and_building_a_run_measures_nothing(monkeypatch, tmp_path):
    """A cost-aware strategy's table is measured (and stored) once, by `prepare`, on an engine without one; the runs
    built from it plan with that table and touch neither the measuring code nor the weights."""
    from studio.engine import cost_model, cost_table
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("studio.run.session.cost_table", cost_model.cost_table)   # not the tests' fixed table
    monkeypatch.setattr("studio.run.session.stored_table", cost_table.stored_table)
    measured = []
    real = cost_model.calibrate
    monkeypatch.setattr(cost_model, "calibrate", lambda *a, **k: measured.append(1) or real(*a, **k))
    engine = tiny_engine("llama", vocab=24, seed=3)
    ready = prepare(engine, make_strategy("jacobi"))
    assert measured == [1] and ready.costs is not None
    monkeypatch.setattr("studio.run.session.planning_costs", lambda engine: pytest.fail("a run measured costs"))
    monkeypatch.setattr("studio.run.session.pack_weights", lambda model: pytest.fail("a run packed weights"))
    ar = run_to_end(engine, make_strategy("ar"), settings(n=8), "", PROMPT).token_ids
    for _ in range(2):   # one after another, as bench's repeats: the strategy object holds its run's state
        run = Run(ready, settings(n=8), "", PROMPT)
        assert run.ctx.costs is ready.costs
        drive([run])
        assert run.result.token_ids == ar
    assert measured == [1]


def test_cancel_between_steps_writes_a_readable_trace_and_leaves_the_engine_reusable(tmp_path):
    engine = tiny_engine("qwen2", vocab=24, seed=1)
    fresh = run_to_end(engine, make_strategy("isd"), settings(n=30), "", PROMPT)
    run = Run(prepare(engine, make_strategy("isd")), settings(n=30), "", PROMPT, trace_path=str(tmp_path / "t.jsonl"))
    for _ in range(3):
        run.advance()
    run.cancel()
    assert run.advance() == [] and run.done
    r = run.result
    assert r.footer["stop_reason"] == CANCELLED
    assert 0 < r.footer["n_tokens"] < 30 and r.token_ids == fresh.token_ids[:len(r.token_ids)]
    trace = read_trace(tmp_path / "t.jsonl")
    assert trace.footer["stop_reason"] == CANCELLED and len(trace.events) == len(r.events)
    again = run_to_end(engine, make_strategy("isd"), settings(n=30), "", PROMPT)
    assert again.token_ids == fresh.token_ids


def test_drive_keeps_runs_in_lock_step_by_forward_count():
    engine = tiny_engine("llama", vocab=24, seed=3)
    names = ("ar", "isd", "jacobi")
    runs = [Run(prepare(engine, make_strategy(name)), settings(n=30), "", PROMPT) for name in names]
    log = []
    for i, r in enumerate(runs):
        def logged(i=i, advance=r.advance):
            log.append((i, [x.forwards for x in runs], [x.done for x in runs]))
            return advance()
        r.advance = logged
    drive(runs)
    assert all(r.done for r in runs) and len({i for i, _, _ in log}) == 3
    for i, counts, done in log:   # the advanced run had the fewest forwards of those still running
        assert counts[i] == min(c for c, d in zip(counts, done) if not d)
    solo = [run_to_end(engine, make_strategy(n), settings(n=30), "", PROMPT).token_ids for n in names]
    assert [r.result.token_ids for r in runs] == solo


# -- conversations -------------------------------------------------------------------------------------
CAUSAL = [("ar", {}), ("isd", {"stride": 3}), ("r-isd", {}), ("jacobi", {"block_size": 4}),
          ("jacobi-mr", {"block_size": 4}), ("blockdiff", {"cache": "causal"}), ("s2d2", {"cache": "causal"})]


def _engine_for(name):
    # block strategies read a right-shifted block-diffusion model; the rest a plain causal one
    return tiny_dlm("llama", shift=True, block=4, vocab=20, seed=2) if name in ("blockdiff", "s2d2") \
        else tiny_engine("llama", vocab=20, seed=2)


def _prefills(result):
    return [e for e in result.events if e["t"] == "forward" and e["role"] == "prefill"]


# -- long prompts: the prefill in chunks ---------------------------------------------------------------
LONG = [int(t) for t in torch.randint(0, 18, (40,), generator=torch.Generator().manual_seed(5))]


def chunked(chunk, n=8, temperature=1.0):
    return Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=3, prefill_chunk=chunk)


@pytest.mark.parametrize("name,params", CAUSAL, ids=[n for n, _ in CAUSAL])
def test_a_long_prompt_prefills_in_chunks_one_per_advance_and_decodes_the_same(name, params):
    engine = _engine_for(name)
    whole = run_to_end(engine, make_strategy(name, params), chunked(1000), "", LONG)
    run = Run(prepare(engine, make_strategy(name, params)), chunked(8), "", LONG)
    progress, batches = [], []
    while not run.done:
        progress.append(run.prefill_progress)
        batches.append(run.advance())
    assert run.result.token_ids == whole.token_ids
    assert progress[:6] == [(0, 40), (8, 40), (16, 40), (24, 40), (32, 40), None]
    assert batches[:4] == [[]] * 4                        # chunks hand out nothing: step 0 comes whole
    step0 = [e for e in batches[4] if e["step"] == 0]
    assert step0 == [e for e in run.result.events if e["step"] == 0]
    assert len([e for e in step0 if e["t"] == "forward" and e["role"] == "prefill"]) == 5
    assert prefill_tokens(run.result.events) == (40, 0) == prefill_tokens(whole.events)


def test_step_mode_waits_before_the_strategys_prefill_not_before_each_chunk():
    engine = tiny_engine("llama", vocab=20, seed=2)
    run = Run(prepare(engine, make_strategy("ar")), chunked(8, n=3), "", LONG)
    waits = []
    drive([run], before_advance=lambda: waits.append(run.prefill_progress))
    assert waits[0] == (32, 40) and waits[1] is None and len(waits) == 3   # the prefill, then one per token


def test_cancel_during_a_chunked_prefill_stops_at_the_next_chunk_and_says_so(tmp_path):
    engine = tiny_engine("llama", vocab=20, seed=2)
    run = Run(prepare(engine, make_strategy("isd")), chunked(8), "", LONG, trace_path=str(tmp_path / "t.jsonl"))
    run.advance()
    run.advance()
    run.cancel()
    events = run.advance()
    assert run.done and run.result.footer["stop_reason"] == CANCELLED and run.result.token_ids == []
    assert [(e["t"], e.get("to_len")) for e in events] == [("forward", None), ("kv", 8), ("forward", None), ("kv", 16)]
    assert read_trace(tmp_path / "t.jsonl").events == run.result.events == events
    line = run_summary_line(run.result.footer, "isd", run.result.events)
    assert line.startswith("[isd] cancelled during the prefill: 16 tokens of the prompt")


def test_a_turn_cancelled_in_its_prefill_is_not_in_the_history_and_a_resend_reuses_its_chunks():
    engine = tiny_engine("llama", vocab=20, seed=2)
    conv = Conversation(engine)
    text = "bcdefghijklmnopq" * 3
    run = conv.start_turn(text, make_strategy("ar"), chunked(8, temperature=0.0))
    run.advance()
    run.advance()
    run.cancel()
    _finish(run)
    assert conv.messages == [] and conv.turns == []
    again = _finish(conv.start_turn(text, make_strategy("ar"), chunked(8, temperature=0.0)))
    assert prefill_tokens(again.events) == (len(again.header["prompt"]["token_ids"]) - 16, 16)
    assert again.token_ids == run_to_end(engine, make_strategy("ar"), settings(n=8), "", PROMPT_OF(again)).token_ids


def _finish(run):
    drive([run])
    return run.result


@pytest.mark.parametrize("name,params", CAUSAL, ids=[n for n, _ in CAUSAL])
def test_second_turn_prefills_only_new_tokens_and_matches_a_full_prefill(name, params):
    engine = _engine_for(name)
    conv = Conversation(engine)
    first = _finish(conv.start_turn("bcdefg", make_strategy(name, params), settings(n=12)))
    run = conv.start_turn("hij", make_strategy(name, params), settings(n=12))
    history = run.prompt_ids
    assert history == conv.engine.tokenizer.encode("bcdefg" + first.footer["text"] + "hij")
    second = _finish(run)
    kv = [e for e in second.events if e["t"] == "kv"][0]
    turn1_kv = [e for e in first.events if e["t"] == "kv"][-1]["to_len"]
    assert len(PROMPT_OF(first)) < kv["from_len"] <= turn1_kv   # turn 1's answer is reused, not just its prompt
    new_rows = _prefills(second)[0]["n_tokens"]
    full_rows = _prefills(run_to_end(engine, make_strategy(name, params), settings(n=12), "", history))[0]["n_tokens"]
    assert new_rows == full_rows - kv["from_len"]
    alone = run_to_end(engine, make_strategy(name, params), settings(n=12), "", history)
    assert second.token_ids == alone.token_ids
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]


def PROMPT_OF(result):
    return result.header["prompt"]["token_ids"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_second_turn_logits_equal_one_forward_over_the_whole_history(family):
    engine = tiny_engine(family, vocab=20, seed=7)
    conv = Conversation(engine)
    _finish(conv.start_turn("bcdef", make_strategy("ar"), settings(n=10)))
    captured = []
    hook = engine.model.register_forward_hook(lambda m, args, out: captured.append(out[0, -1].clone()))
    try:
        run = conv.start_turn("ghi", make_strategy("ar"), settings(n=10))
        run.advance()            # the prefill only
    finally:
        hook.remove()
    prefill = run.events[0]
    assert prefill["n_tokens"] < len(run.prompt_ids) // 2
    full = full_forward_row(engine.model, run.prompt_ids)
    torch.testing.assert_close(captured[0], full, atol=1e-5, rtol=0)


def test_a_new_strategy_or_parameters_prefill_the_whole_history():
    engine = tiny_engine("llama", vocab=20, seed=2)
    conv = Conversation(engine)
    _finish(conv.start_turn("bcdef", make_strategy("isd"), settings(n=8)))
    other = _finish(conv.start_turn("gh", make_strategy("ar"), settings(n=8)))
    assert _prefills(other)[0]["n_tokens"] == len(PROMPT_OF(other))
    stride = _finish(conv.start_turn("ij", make_strategy("ar"), settings(n=8)))
    assert _prefills(stride)[0]["n_tokens"] < len(PROMPT_OF(stride))    # same strategy again: reused
    changed = _finish(conv.start_turn("kl", make_strategy("isd", {"stride": 3}), settings(n=8)))
    assert _prefills(changed)[0]["n_tokens"] == len(PROMPT_OF(changed)) + 2   # + the N-1 MASK rows


def test_block_attention_caches_are_not_reused():
    engine = tiny_dlm("llama", shift=True, block=4, vocab=20, seed=2)
    conv = Conversation(engine)
    _finish(conv.start_turn("bcdefgh", make_strategy("blockdiff"), settings(n=8)))
    second = _finish(conv.start_turn("ij", make_strategy("blockdiff"), settings(n=8)))
    assert [e for e in second.events if e["t"] == "kv"][0]["from_len"] == 0


def test_an_edited_history_reuses_only_the_prefix_before_the_edit():
    engine = tiny_engine("llama", vocab=20, seed=2)
    conv = Conversation(engine)
    _finish(conv.start_turn("bcdefghij", make_strategy("ar"), settings(n=6)))
    conv.messages[0]["content"] = "bcdXfghij".replace("X", "k")   # the user edits their first message
    run = conv.start_turn("lm", make_strategy("ar"), settings(n=6))
    result = _finish(run)
    assert [e for e in result.events if e["t"] == "kv"][0]["from_len"] == 3
    assert result.token_ids == run_to_end(engine, make_strategy("ar"), settings(n=6), "", run.prompt_ids).token_ids


def test_a_cancelled_turn_stays_in_the_history_and_the_next_turn_is_still_exact():
    engine = tiny_engine("llama", vocab=20, seed=2)
    conv = Conversation(engine)
    run = conv.start_turn("bcdef", make_strategy("isd"), settings(n=20))
    run.advance()
    run.advance()
    run.cancel()
    _finish(run)
    assert run.result.footer["stop_reason"] == CANCELLED and conv.messages[-1]["content"] == run.out.text
    nxt = conv.start_turn("gh", make_strategy("isd"), settings(n=10))
    result = _finish(nxt)
    assert _prefills(result)[0]["n_tokens"] < len(nxt.prompt_ids)
    assert result.token_ids == run_to_end(engine, make_strategy("isd"), settings(n=10), "", nxt.prompt_ids).token_ids


def test_reset_forgets_messages_and_cache():
    engine = tiny_engine("llama", vocab=20, seed=2)
    conv = Conversation(engine)
    _finish(conv.start_turn("bcdef", make_strategy("ar"), settings(n=6)))
    conv.reset()
    run = conv.start_turn("gh", make_strategy("ar"), settings(n=6))
    assert run.prompt_ids == engine.tokenizer.encode("gh") and conv.messages == [] and conv.turns == []
    assert _prefills(_finish(run))[0]["n_tokens"] == 2

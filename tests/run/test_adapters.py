"""Adapter choice per run: engines sharing one model switch adapters between steps; shipped adapters are
picked per strategy on their model, `--adapter none` and `--adapter NAME` override."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from studio.presets import shipped as adapters
from studio.engine.strategies import make_strategy
from studio.run.session import Run, Settings, drive, prepare, run_to_end
from tests.support.adapters import random_mask_adapter
from tests.support.tiny import tiny_engine

PROMPT = [1, 2, 3, 4]


def _engine(seed=7):
    e = tiny_engine("llama", vocab=24, seed=seed)
    e.model.config = e.config = dataclasses.replace(e.config, mask_token_id=None)
    return e


def _alone(engine, name, params=None, n=30):
    return run_to_end(engine, make_strategy(name, params), Settings(max_new_tokens=n), "", PROMPT).token_ids


@pytest.fixture
def two_adapters(tmp_path):
    model = _engine().model
    return (random_mask_adapter(tmp_path / "a", model, seed=1), random_mask_adapter(tmp_path / "b", model, seed=2))


def test_runs_with_different_adapters_interleave_on_one_model(two_adapters):
    """Lock-step runs on views of one model (no adapter, adapter a, adapter b) each equal the run alone on
    a model of its own: every step runs with its own adapter installed."""
    a, b = two_adapters
    base = _engine()
    views = [base, base.with_adapter(str(a)), base.with_adapter(str(b))]
    assert views[1].model is views[2].model is base.model and views[1].config.mask_token_id == 24
    names = [("ar", None), ("isd", {"stride": 3}), ("isd", {"stride": 3})]
    runs = [Run(prepare(v, make_strategy(n, p)), Settings(max_new_tokens=30), "", PROMPT)
            for v, (n, p) in zip(views, names)]
    drive(runs)
    alone = []
    for path, (n, p) in zip([None, a, b], names):
        e = _engine()
        if path:
            from studio.engine.lora import attach_adapter
            attach_adapter(e, path)
        alone.append(_alone(e, n, p))
    assert [r.result.token_ids for r in runs] == alone
    assert alone[1] != alone[2] != alone[0]          # isd follows its adapter: the three runs really differ
    assert [r.result.header["model"]["adapter"] for r in runs] == [None, str(a), str(b)]


@pytest.fixture
def shipped_dir(tmp_path, monkeypatch, two_adapters):
    """presets/adapters stand-in: adapter `a` shipped for isd on the tiny model."""
    a, _ = two_adapters
    (a / "studio.toml").write_text('model = "tiny-llama"\nstrategies = ["isd", "r-isd"]\n')
    monkeypatch.setattr(adapters, "ADAPTERS_DIR", tmp_path)
    adapters._entries.cache_clear()
    yield a
    adapters._entries.cache_clear()


def test_a_shipped_adapter_is_used_for_its_strategies_only(shipped_dir):
    engine = _engine()
    isd = run_to_end(engine, make_strategy("isd", {"stride": 3}), Settings(max_new_tokens=20), "", PROMPT)
    ar = run_to_end(engine, make_strategy("ar"), Settings(max_new_tokens=20), "", PROMPT)
    assert isd.header["model"]["adapter"] == str(shipped_dir) and ar.header["model"]["adapter"] is None
    assert any(e["lora_rows"] for e in isd.events if e["t"] == "forward")
    assert adapters.adapter_path("a") == str(shipped_dir)
    # a fixed choice applies to every strategy: "none" = the plain model everywhere
    plain = dataclasses.replace(_engine(), adapter_choice="none")
    with pytest.raises(Exception, match="needs a MASK token"):
        run_to_end(plain, make_strategy("isd"), Settings(max_new_tokens=5), "", PROMPT)


def test_conversation_does_not_reuse_kv_across_adapters(shipped_dir):
    """isd's committed KV depends on its adapter (LoRA on every row): switching from ar to isd in a chat
    prefills from scratch."""
    from studio.run.conversation import Conversation
    conv = Conversation(_engine(), chat=False)
    drive([conv.start_turn("abc", make_strategy("ar"), Settings(max_new_tokens=6))])
    run = conv.start_turn("de", make_strategy("isd", {"stride": 3}), Settings(max_new_tokens=6))
    drive([run])
    prefill = next(e for e in run.result.events if e["t"] == "forward")
    assert prefill["n_tokens"] == len(run.prompt_ids) + 2     # everything recomputed (+ the 2 MASK rows)


@pytest.mark.parametrize("rows", ["all", "mask"])
def test_a_chat_turn_on_an_adapter_reuses_the_kv_of_the_model_it_makes(tmp_path, rows):
    """ar on an adapter of every row reads the LoRA on its clean rows (on a MASK-row adapter it does not): a turn
    that reuses the cached history answers exactly as a fresh run over the whole history."""
    from studio.engine.lora import attach_adapter
    from studio.run.conversation import Conversation
    from tests.support.lora import random_adapter
    engine = _engine()
    attach_adapter(engine, random_adapter(tmp_path / rows, engine.model, seed=1, adapted_rows=rows))
    conv = Conversation(engine, chat=False)
    drive([conv.start_turn("abc", make_strategy("ar"), Settings(max_new_tokens=6))])
    run = conv.start_turn("de", make_strategy("ar"), Settings(max_new_tokens=6))
    drive([run])
    prefill = next(e for e in run.result.events if e["t"] == "forward")
    assert prefill["n_tokens"] < len(run.prompt_ids)                      # the history's KV was reused
    assert prefill["lora_rows"] == (prefill["n_tokens"] if rows == "all" else 0)
    fresh = run_to_end(engine, make_strategy("ar"), Settings(max_new_tokens=6), "", run.prompt_ids)
    assert run.result.token_ids == fresh.token_ids


def test_adapter_rows_of_two_adapters_are_swapped_in_place(two_adapters):
    a, b = two_adapters
    base = _engine()
    va, vb = base.with_adapter(str(a)), base.with_adapter(str(b))
    va.activate()
    table = base.model.model.embed_tokens.weight
    row_a = table[24].clone()
    vb.activate()
    assert base.model.model.embed_tokens.weight is table and not torch.equal(table[24], row_a)
    va.activate()
    assert torch.equal(table[24], row_a)

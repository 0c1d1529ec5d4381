"""studio.engine.lora: PEFT adapters, the per-row gate, merged weights, MASK rows, bad adapters."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from studio.engine.lora import (TARGETS, attach_adapter, detach_adapter, read_adapter,
                                save_adapter)
from studio.engine.masks import causal
from studio.engine.gated_lora import RowGate
from studio.engine.model import Linear
from studio.errors import BadInput
from tests.support.lora import merged_model, random_adapter, random_lora
from tests.support.tiny import FAMILIES, tiny_engine, tiny_model

TOKENS = [1, 5, 2, 7, 3, 9, 4, 11]
CHUNKS = [5, 2, 1]   # prefill, a 2-token extend, a 1-token step: the KV cache is on the path


def run_chunks(model, tokens=TOKENS, chunks=CHUNKS, gate=None) -> torch.Tensor:
    """Logits [T, V] of `tokens` fed in `chunks` through one KV cache; `gate`: one bool per token, or None."""
    kv = model.new_cache(64)
    outs, i = [], 0
    for n in chunks:
        g = None if gate is None else torch.tensor(gate[i:i + n])
        with torch.inference_mode():
            outs.append(model(torch.tensor(tokens[i:i + n]), torch.arange(i, i + n), kv, lora_gate=g)[0])
        kv.commit(n)
        i += n
    return torch.cat(outs)


@pytest.fixture(params=FAMILIES)
def pair(request, tmp_path):
    """(engine with a random adapter, the same base model without one)."""
    engine = tiny_engine(request.param, vocab=24, seed=3)
    base = tiny_engine(request.param, vocab=24, seed=3).model
    attach_adapter(engine, random_adapter(tmp_path / "ad", engine.model))
    return engine, base


# -------------------------------------------------------------------------------------------------
# the gate
# -------------------------------------------------------------------------------------------------
def test_attach_sets_every_target_and_the_engine_name(pair, tmp_path):
    engine, _ = pair
    adapted = [n for n, m in engine.model.named_modules() if isinstance(m, Linear) and m.lora_A is not None]
    assert len(adapted) == 7 * engine.config.n_layers
    assert engine.adapter == str(tmp_path / "ad")
    m = engine.model.model.layers[0].self_attn.q_proj
    assert m.lora_A.dtype == torch.float32 and m.lora_scale == 1.0


@pytest.mark.parametrize("gate", [None, "off"])
def test_gate_off_is_bit_identical_to_base(pair, gate):
    engine, base = pair
    g = None if gate is None else [False] * len(TOKENS)
    assert torch.equal(run_chunks(engine.model, gate=g), run_chunks(base))


def test_gate_on_equals_the_merged_model(pair):
    engine, base = pair
    on = run_chunks(engine.model, gate=[True] * len(TOKENS))
    merged = run_chunks(merged_model(engine.model))
    assert torch.allclose(on, merged, atol=1e-5, rtol=0)
    assert (merged - run_chunks(base)).abs().max() > 0.1   # the adapter really changes the model


def test_mixed_gate_off_rows_are_base_on_rows_are_merged(pair):
    """The R-ISD layout: a base-only prefix, then gated rows. Off rows are bit-identical to the base model;
    on rows equal the merged model reading the base prefix's KV."""
    engine, base = pair
    gate = [False] * 6 + [True] * 2
    mixed = run_chunks(engine.model, gate=gate)
    assert torch.equal(mixed[:6], run_chunks(base)[:6])
    kv = base.new_cache(64)
    with torch.inference_mode():
        base(torch.tensor(TOKENS[:5]), torch.arange(5), kv)
        kv.commit(5)
        base(torch.tensor(TOKENS[5:6]), torch.tensor([5]), kv)
        kv.commit(1)
        tail = merged_model(engine.model)(torch.tensor(TOKENS[6:]), torch.arange(6, 8), kv)[0]
    assert torch.allclose(mixed[6:], tail, atol=1e-5, rtol=0)
    assert (tail - run_chunks(base)[6:]).abs().max() > 0.1


@pytest.mark.parametrize("pattern", ["tail", "holes"])
def test_sliced_gathered_and_dense_gates_agree(pair, pattern):
    """Three ways to apply the gate -- a slice (gated rows in one run: R-ISD's MASK tail), a gather/scatter
    (rows with holes), the dense 0/1 multiplier (CUDA graphs) -- give bit-identical off rows and the same on rows."""
    engine, base = pair
    gate = torch.tensor([False] * 5 + [True] * 3 if pattern == "tail" else [True, False] * 4)
    tokens, pos = torch.tensor([TOKENS]), torch.arange(8)[None]

    def logits(g: RowGate | None, model=engine.model) -> torch.Tensor:
        kv = model.new_cache(64)
        kv.begin(8)
        with torch.inference_mode():
            return model.run(tokens, pos, kv, causal(8, 0), g, None)[0]

    sparse = RowGate(gate)
    assert (sparse.span is not None) == (pattern == "tail")
    got, dense = logits(sparse), logits(RowGate(gate.float()[None], dense=True))
    plain = logits(None, base)
    first_on = int(gate.nonzero()[0])
    assert torch.equal(got[:first_on], plain[:first_on])   # rows before any gated row read base KV only
    assert torch.allclose(got, dense, atol=1e-5, rtol=0)
    assert (got[gate] - plain[gate]).abs().max() > 0.1


def test_detach_gives_the_base_model_back(pair):
    engine, base = pair
    detach_adapter(engine.model)
    assert torch.equal(run_chunks(engine.model, gate=[True] * len(TOKENS)), run_chunks(base))


def test_save_from_a_model_round_trips(pair, tmp_path):
    engine, _ = pair
    save_adapter(engine.model, tmp_path / "again", r=4, alpha=4.0, targets="all-linear")
    ad = read_adapter(tmp_path / "again")
    for name, (A, B) in ad.lora.items():
        m = engine.model.get_submodule(name)
        assert torch.equal(A, m.lora_A) and torch.equal(B, m.lora_B)
    assert len(ad.lora) == 7 * engine.config.n_layers


@pytest.mark.parametrize("rows", ["mask", "all", None])
def test_the_adapted_rows_round_trip_and_default_to_all(tmp_path, rows):
    """A PEFT adapter from elsewhere records no rows: LoRA on every row, the PEFT meaning."""
    engine = tiny_engine("llama", vocab=24, seed=3)
    path = random_adapter(tmp_path / "ad", engine.model, adapted_rows=rows)
    assert ("adapted_rows" in json.loads((path / "adapter_config.json").read_text())) == (rows is not None)
    assert read_adapter(path).adapted_rows == (rows or "all")
    assert attach_adapter(engine, path).adapted_rows == (rows or "all")
    assert engine.with_adapter(str(path)).lora.adapted_rows == (rows or "all")


def test_scale_alpha_over_r_and_rslora(tmp_path):
    model = tiny_model("llama")
    assert read_adapter(random_adapter(tmp_path / "a", model, r=4, alpha=16)).scale == 4.0
    ad = read_adapter(random_adapter(tmp_path / "b", model, r=4, alpha=16, use_rslora=True))
    assert ad.scale == pytest.approx(16 / math.sqrt(4))


def test_partial_targets_and_peft_names_without_prefix(tmp_path):
    engine = tiny_engine("qwen3", vocab=24, seed=3)
    path = random_adapter(tmp_path / "ad", engine.model, targets=("q_proj", "v_proj"))
    # the same tensors without the base_model.model. prefix
    sd = load_file(str(path / "adapter_model.safetensors"))
    save_file({k.removeprefix("base_model.model."): v for k, v in sd.items()}, str(path / "adapter_model.safetensors"))
    attach_adapter(engine, path)
    adapted = {n.rsplit(".", 1)[-1] for n, m in engine.model.named_modules() if getattr(m, "lora_A", None) is not None}
    assert adapted == {"q_proj", "v_proj"}


# -------------------------------------------------------------------------------------------------
# bad adapters: one-line BadInput, the model left untouched
# -------------------------------------------------------------------------------------------------
def _edit_config(path, **changes):
    f = path / "adapter_config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg))


def _other_dim(path, model):
    random_adapter(path, tiny_model("llama", dim=48))


def _rank(path, model):
    save_adapter(random_lora(model, r=8), path, r=4, alpha=4.0, targets=list(TARGETS))


def _unknown_target(path, model):
    random_adapter(path, model)
    _edit_config(path, target_modules=["q_proj", "c_attn"])


def _unknown_tensor(path, model):
    lora = random_lora(model)
    lora["model.layers.0.self_attn.c_attn"] = tuple(t.clone() for t in lora["model.layers.0.self_attn.q_proj"])
    save_adapter(lora, path, r=4, alpha=4.0, targets="all-linear")


def _missing_layer(path, model):
    random_adapter(path, tiny_model("llama", layers=3))


def _no_config(path, model):
    random_adapter(path, model)
    (path / "adapter_config.json").unlink()


def _bin_only(path, model):
    random_adapter(path, model)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.bin").write_bytes(b"\x80\x04not read")


def _corrupt(path, model):
    random_adapter(path, model)
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def _garbage(path, model):
    random_adapter(path, model)
    (path / "adapter_model.safetensors").write_bytes(b"this is not a safetensors file at all")


def _bad_json(path, model):
    random_adapter(path, model)
    (path / "adapter_config.json").write_text("{r: 4")


def _fan_in_fan_out(path, model):
    random_adapter(path, model)
    _edit_config(path, fan_in_fan_out=True)


def _dora(path, model):
    random_adapter(path, model)
    _edit_config(path, use_dora=True)


def _nan_alpha(path, model):
    random_adapter(path, model)
    _edit_config(path, lora_alpha=float("nan"))


def _targets_not_strings(path, model):
    random_adapter(path, model)
    _edit_config(path, target_modules=[5])


def _modules_to_save_string(path, model):
    random_adapter(path, model)
    _edit_config(path, modules_to_save="classifier")


def _only_a(path, model):
    save_adapter(random_lora(model), path, r=4, alpha=4.0, targets="all-linear")
    f = path / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(str(f)).items() if "down_proj.lora_B" not in k}, str(f))


def _mask_row_wrong_id(path, model):
    random_adapter(path, model, mask_token_id=3, mask_embedding=torch.randn(1, model.config.dim))


def _mask_row_wrong_dim(path, model):
    random_adapter(path, model, mask_token_id=24, mask_embedding=torch.randn(1, 7))


def _missing_dir(path, model):
    pass


def _bad_adapted_rows(path, model):
    random_adapter(path, model)
    _edit_config(path, adapted_rows="clean")


@pytest.mark.parametrize("make, message", [
    (_other_dim, r"q_proj\.lora_A has shape \(4, 48\), the model needs \(4, 32\)"),
    (_rank, "rank mismatch"),
    (_unknown_target, "unknown module 'c_attn'"),
    (_unknown_tensor, "unknown module 'c_attn'"),
    (_missing_layer, r"model\.layers\.2.*2 layers"),
    (_no_config, "no adapter_config.json"),
    (_bin_only, "never unpickles"),
    (_corrupt, "corrupt safetensors"),
    (_garbage, "corrupt safetensors"),
    (_bad_json, "invalid .*adapter_config.json"),
    (_fan_in_fan_out, "fan_in_fan_out"),
    (_dora, "use_dora"),
    (_nan_alpha, "lora_alpha must be a positive number"),
    (_targets_not_strings, "target_modules must be a string or a list of strings"),
    (_modules_to_save_string, "modules_to_save 'classifier'"),
    (_only_a, "lora_A but no lora_B"),
    (_mask_row_wrong_id, "base vocab size 24"),
    (_mask_row_wrong_dim, "dim 7"),
    (_missing_dir, "adapter not found"),
    (_bad_adapted_rows, r"ad/adapter_config\.json: adapted_rows must be one of 'mask', 'all', got 'clean'"),
])
def test_bad_adapters_are_one_line_errors(tmp_path, make, message):
    engine = tiny_engine("llama", vocab=24, seed=3)
    before = run_chunks(engine.model)
    config = engine.config
    make(tmp_path / "ad", engine.model)
    with pytest.raises(BadInput, match=message) as e:
        attach_adapter(engine, tmp_path / "ad")
    assert "\n" not in str(e.value)
    assert engine.adapter is None and engine.config is config
    assert all(m.lora_A is None for m in engine.model.modules() if isinstance(m, Linear))
    assert torch.equal(run_chunks(engine.model), before)


# -------------------------------------------------------------------------------------------------
# a new MASK token
# -------------------------------------------------------------------------------------------------
def _engine_without_mask(family="llama", **kw):
    engine = tiny_engine(family, vocab=24, seed=3, **kw)
    engine.config = engine.model.config = dataclasses.replace(engine.config, mask_token_id=None)
    return engine


@pytest.mark.parametrize("tie", [False, True])
def test_adapter_adds_an_input_only_mask_row(tmp_path, tie):
    engine = _engine_without_mask(tie_embeddings=tie)
    model = engine.model
    old_table = model.model.embed_tokens.weight.detach().clone()
    old_head = model.lm_head.weight.detach().clone()
    before = run_chunks(model)
    row = torch.randn(1, model.config.dim)
    attach_adapter(engine, random_adapter(tmp_path / "ad", model, mask_token_id=24, mask_embedding=row))

    assert engine.config.mask_token_id == model.config.mask_token_id == 24
    assert engine.config is model.config
    table = model.model.embed_tokens.weight
    assert table.shape == (25, model.config.dim) and model.model.embed_tokens.num_embeddings == 25
    assert torch.equal(table[:24], old_table) and torch.equal(table[24:], row)
    # the head keeps the base rows: MASK is never predicted, clean rows score exactly the base vocab
    assert torch.equal(model.lm_head.weight, old_head)
    assert engine.config.vocab_size == 24
    if tie:
        assert model.lm_head.weight.data_ptr() == table.data_ptr()   # still one shared copy
    assert torch.equal(run_chunks(model), before)
    with torch.inference_mode():   # the MASK id is a valid input now
        logits = model(torch.tensor([1, 2, 24]), torch.arange(3), model.new_cache(8),
                       lora_gate=torch.tensor([False, False, True]))
    assert logits.shape == (1, 3, 24) and torch.isfinite(logits).all()


def test_switching_adapters_keeps_the_tied_heads_packed_copy(tmp_path):
    """Two adapters with their own MASK rows, installed in turn as a comparison does every step: each install writes
    its rows past the tied head, the head's packed copy (made once) stays, and every forward equals a fresh model's."""
    engine = _engine_without_mask(tie_embeddings=True)
    views = [engine.with_adapter(str(random_adapter(tmp_path / name, engine.model, mask_token_id=24,
                                                    mask_embedding=torch.randn(1, engine.config.dim), seed=seed)))
             for name, seed in (("a", 1), ("b", 2))]
    # 6 rows: the head's product runs through oneDNN's packed copy (1-4 rows take the CPU kernel, which packs nothing)
    tokens, gate = [1, 5, 7, 3, 24, 24], [False, False, False, False, True, True]
    expected = []
    for view in views:   # each adapter alone, packed copies made fresh
        view.activate()
        expected.append(run_chunks(view.model, tokens, [6], gate))
        view.model.lm_head.weight._onednn = None
    packed = None
    for view, want in [*zip(views, expected)] * 2:
        view.activate()
        assert torch.equal(run_chunks(view.model, tokens, [6], gate), want)
        packed = view.model.lm_head.weight._onednn[1] if packed is None else packed
        assert view.model.lm_head.weight._onednn[1] is packed   # not re-packed by the switch


def test_resized_table_only_its_new_rows_are_read(tmp_path):
    """PEFT modules_to_save style: a full [V + k, dim] table; existing rows stay base (the gate cannot switch them)."""
    engine = _engine_without_mask()
    model = engine.model
    old_table = model.model.embed_tokens.weight.detach().clone()
    path = random_adapter(tmp_path / "ad", model, mask_token_id=25)
    full = torch.cat([old_table + 0.5, torch.randn(2, model.config.dim)])   # retrained rows + 2 new ones
    f = path / "adapter_model.safetensors"
    save_file(dict(load_file(str(f)), **{"base_model.model.model.embed_tokens.weight": full}), str(f))
    _edit_config(path, modules_to_save=["embed_tokens"])
    attach_adapter(engine, path)
    table = model.model.embed_tokens.weight
    assert table.shape[0] == 26 and engine.config.mask_token_id == 25
    assert torch.equal(table[:24], old_table) and torch.equal(table[24:], full[24:])


def test_mask_id_of_an_existing_token_needs_no_rows(tmp_path):
    engine = _engine_without_mask()
    attach_adapter(engine, random_adapter(tmp_path / "ad", engine.model, mask_token_id=23))
    assert engine.config.mask_token_id == 23 and engine.model.model.embed_tokens.weight.shape[0] == 24


def test_mask_id_out_of_range_without_rows(tmp_path):
    engine = _engine_without_mask()
    with pytest.raises(BadInput, match="mask_token_id 30 has no embedding row"):
        attach_adapter(engine, random_adapter(tmp_path / "ad", engine.model, mask_token_id=30))
    assert engine.config.mask_token_id is None

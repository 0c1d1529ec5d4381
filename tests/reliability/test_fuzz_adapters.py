"""Fuzzing the PEFT adapter reader: studio.engine.lora.load_adapter (adapter_config.json, then
adapter_model.safetensors, then the fit against a tiny model), the path of `--adapter DIR`.

Each mutation family is one test; see tests/support/fuzzing.py for the property and the profiles."""
from __future__ import annotations

import json
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from studio.engine.lora import CONFIG_FILE, WEIGHTS_FILE, LoadedAdapter, load_adapter, save_adapter
from tests.support.fuzzing import (HUGE_INTS, bit_flipped, check_reader, case_path, fuzz, mutated_doc, dump_json,
                           safetensors_bytes, spliced, split_safetensors, truncated, write_case)
from tests.support.tiny import tiny_model

pytest_plugins = ["tests.support.fuzzing"]

MODEL = tiny_model("llama", vocab=16, dim=32, layers=2)   # q_proj 32 -> 32, v_proj 32 -> 16, 4 heads of 8
V, DIM = MODEL.lm_head.weight.shape


def _seed() -> dict[str, bytes]:
    g = torch.Generator().manual_seed(0)
    lora = {"model.layers.0.self_attn.q_proj": (torch.randn(2, 32, generator=g), torch.randn(32, 2, generator=g)),
            "model.layers.1.self_attn.v_proj": (torch.randn(2, 32, generator=g), torch.randn(16, 2, generator=g))}
    root = case_path("seed-adapter")
    save_adapter(lora, root, r=2, alpha=4.0, targets=["q_proj", "v_proj"], mask_token_id=V,
                 mask_embedding=torch.randn(1, DIM, generator=g))
    return {CONFIG_FILE: (root / CONFIG_FILE).read_bytes(), WEIGHTS_FILE: (root / WEIGHTS_FILE).read_bytes()}


SEED = _seed()
CONFIG = json.loads(SEED[CONFIG_FILE])
TENSORS_HEADER, TENSORS_DATA = split_safetensors(SEED[WEIGHTS_FILE])
WEIGHTS_FOCUS = len(SEED[WEIGHTS_FILE]) - len(TENSORS_DATA)
CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "mask_token_id", "peft_type", "fan_in_fan_out",
               "use_dora", "bias", "rank_pattern", "alpha_pattern", "modules_to_save", "lora_dropout")


def _valid(result) -> None:
    assert isinstance(result, LoadedAdapter)
    assert math.isfinite(result.scale)
    for name, (A, B) in result.modules.items():
        m = MODEL.get_submodule(name)
        assert A.shape[1] == m.in_features and B.shape[0] == m.out_features and A.shape[0] == B.shape[1], name
    assert result.mask_token_id is None or (isinstance(result.mask_token_id, int) and result.mask_token_id >= 0)


def load_case(files: dict[str, bytes]):
    root = write_case("adapter", files)
    return check_reader("adapter", lambda: load_adapter(MODEL, root), files, valid=_valid)


def test_adapter_seed_is_valid():
    loaded = load_case(SEED)
    assert set(loaded.modules) == {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}
    assert loaded.mask_token_id == V and loaded.rows.shape == (1, DIM)


def _bytes_mutation(seed: bytes, focus: int = 0):
    return st.one_of(truncated(seed, focus), bit_flipped(seed, focus), spliced(seed, (), focus))


@fuzz(120)
@given(mutated_doc(CONFIG, "json", keys=CONFIG_KEYS))
def test_adapter_config_fields(config):
    """adapter_config.json with one field of a wrong type / huge / NaN / non-UTF-8 / deeply nested, deleted,
    or a known field added with such a value."""
    load_case({CONFIG_FILE: dump_json(config), WEIGHTS_FILE: SEED[WEIGHTS_FILE]})


@fuzz(80)
@given(_bytes_mutation(SEED[CONFIG_FILE]))
def test_adapter_config_bytes(config):
    """adapter_config.json truncated, bit-flipped or spliced."""
    load_case({CONFIG_FILE: config, WEIGHTS_FILE: SEED[WEIGHTS_FILE]})


@fuzz(80)
@given(_bytes_mutation(SEED[WEIGHTS_FILE], WEIGHTS_FOCUS))
def test_adapter_weights_bytes(weights):
    """adapter_model.safetensors truncated, bit-flipped or spliced."""
    load_case({CONFIG_FILE: SEED[CONFIG_FILE], WEIGHTS_FILE: weights})


_KEYS = sorted(k for k in TENSORS_HEADER if k != "__metadata__")
_NEW_KEYS = ["mask_embedding", "model.embed_tokens.weight", "lm_head.weight", "base_model.model.lm_head.weight",
             "model.layers.0.self_attn.c_attn.lora_A.weight", "model.layers.0.mlp.q_proj.lora_A.weight",
             "model.layers.7.self_attn.q_proj.lora_A.weight", "model.layers.1.self_attn.k_proj.lora_B.weight",
             "model.layers." + "9" * 5000 + ".self_attn.q_proj.lora_A.weight",
             "model.layers.\u0663.self_attn.q_proj.lora_A.weight", "", "x" * 1000]
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool,
           torch.uint8, torch.complex64]
_SHAPES = st.lists(st.sampled_from([0, 1, 2, 3, 16, 17, 32, 33]), max_size=3)


@st.composite
def _tensor(draw) -> torch.Tensor:
    shape, dtype = draw(_SHAPES), draw(st.sampled_from(_DTYPES))
    fill = draw(st.sampled_from([0.0, 1.0, math.nan, math.inf, -math.inf, 1e30]))
    t = torch.full(shape, fill if dtype.is_floating_point or dtype.is_complex else 1).to(dtype)
    return t


def _tensors_seed() -> dict[str, torch.Tensor]:
    from safetensors.torch import load
    return dict(load(SEED[WEIGHTS_FILE]))


@fuzz(120)
@given(st.data())
def test_adapter_tensors(data):
    """The tensors rewritten: one replaced by a tensor of another shape / dtype / NaN / inf, renamed (unknown
    module, other layer, huge or non-ASCII layer index), dropped, or an extra one added; or a field of the
    safetensors header made a wrong type (the header length kept right)."""
    op = data.draw(st.sampled_from(("replace", "rename", "drop", "add", "header")))
    if op == "header":
        header = data.draw(mutated_doc(TENSORS_HEADER, "json", keys=("dtype", "shape", "data_offsets")))
        weights = safetensors_bytes(header, TENSORS_DATA)
    else:
        from safetensors.torch import save
        tensors = _tensors_seed()
        key = data.draw(st.sampled_from(_KEYS))
        if op == "replace":
            tensors[key] = data.draw(_tensor())
        elif op == "rename":
            tensors[data.draw(st.sampled_from(_NEW_KEYS))] = tensors.pop(key)
        elif op == "drop":
            del tensors[key]
        else:
            tensors[data.draw(st.sampled_from(_NEW_KEYS))] = data.draw(_tensor())
        weights = save(tensors)
    load_case({CONFIG_FILE: SEED[CONFIG_FILE], WEIGHTS_FILE: weights})


@fuzz(60)
@given(st.sampled_from(["r", "lora_alpha", "mask_token_id"]), st.sampled_from(HUGE_INTS + [-0.0, 1e308, 0.5]))
def test_adapter_config_numbers(key, value):
    """r, lora_alpha and mask_token_id at the edges of int64/float64 and beyond."""
    load_case({CONFIG_FILE: dump_json(dict(CONFIG, **{key: value})), WEIGHTS_FILE: SEED[WEIGHTS_FILE]})

"""Fuzzing the text readers: presets (studio.presets, TOML), `--param KEY=VALUE` (studio.run.config.parse_param,
studio.engine.strategies.params.parse_params, and the strategy registry that applies them) and bench prompt files
(studio.run.bench.load_prompts). Seeds are the shipped studio/presets/*/*.toml and the built-in prompts.

Each mutation family is one test; see tests/support/fuzzing.py for the property and the profiles."""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib

from hypothesis import given
from hypothesis import strategies as st

from studio.run.bench import BUILTIN_PROMPTS, load_prompts
from studio.engine.strategies import STRATEGIES, make_strategy
from studio.engine.strategies.routing import _CLASSES as POLICY_CLASSES
from studio.engine.strategies.params import parse_params
from studio.presets import PRESETS_DIR, ModelPreset, StrategyPreset, load_model_preset, load_strategy_preset
from studio.run.config import parse_param
from tests.support.fuzzing import (HUGE_INTS, RAW_TOML, SPECIAL_FLOATS, bit_flipped, check_reader, dump_json,
                           dump_toml, fuzz, mutated_doc, spliced, truncated, write_case)

pytest_plugins = ["tests.support.fuzzing"]


# -------------------------------------------------------------------------------------------------
# presets
# -------------------------------------------------------------------------------------------------
STRATEGY_SEEDS = tuple(p.read_bytes() for p in sorted((PRESETS_DIR / "strategies").glob("*.toml")))
MODEL_SEEDS = tuple(p.read_bytes() for p in sorted((PRESETS_DIR / "models").glob("*.toml")))
STRATEGY_KEYS = ("description", "strategy", "params", "sampling", "max_new_tokens", "paper", "temperature", "top_k",
                 "top_p", "block_size", "route")
MODEL_KEYS = ("description", "source", "mask_token_id", "block_size", "logit_shift", "note")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _valid_strategy(p) -> None:
    assert isinstance(p, StrategyPreset) and isinstance(p.strategy, str) and isinstance(p.description, str)
    assert isinstance(p.params, dict) and isinstance(p.sampling, dict)
    assert all(_is_number(v) for v in p.sampling.values()), p.sampling
    assert p.max_new_tokens is None or (isinstance(p.max_new_tokens, int) and not isinstance(p.max_new_tokens, bool)
                                        and p.max_new_tokens > 0), p.max_new_tokens


def _valid_model(p) -> None:
    assert isinstance(p, ModelPreset) and isinstance(p.source, str)
    assert isinstance(p.description, str) and isinstance(p.note, str)
    for k, v in p.overrides.items():
        assert (isinstance(v, bool) if k == "logit_shift" else isinstance(v, int) and not isinstance(v, bool)), (k, v)


def read_preset(kind: str, data: bytes):
    p = write_case(f"case-{kind}.toml", data)
    if kind == "strategy":
        return check_reader("preset-strategy", lambda: load_strategy_preset(str(p)), data, names=(p.name,),
                            valid=_valid_strategy)
    return check_reader("preset-model", lambda: load_model_preset(str(p)), data, names=(p.name,), valid=_valid_model)


def test_preset_seeds_are_valid():
    assert STRATEGY_SEEDS and MODEL_SEEDS
    for seed in STRATEGY_SEEDS:
        assert isinstance(read_preset("strategy", seed), StrategyPreset)
    for seed in MODEL_SEEDS:
        assert isinstance(read_preset("model", seed), ModelPreset)


def _bytes_mutation(seeds: tuple[bytes, ...]):
    return st.sampled_from(seeds).flatmap(lambda s: st.one_of(truncated(s), bit_flipped(s), spliced(s, seeds)))


def _field_mutation(seeds: tuple[bytes, ...], keys: tuple[str, ...]):
    docs = [tomllib.loads(s.decode()) for s in seeds]
    return st.sampled_from(docs).flatmap(lambda d: mutated_doc(d, "toml", keys=keys, root_ok=False)).map(dump_toml)


@fuzz(80)
@given(_bytes_mutation(STRATEGY_SEEDS))
def test_strategy_preset_bytes(data):
    """A shipped strategy preset truncated, bit-flipped or spliced (non-UTF-8 bytes included)."""
    read_preset("strategy", data)


@fuzz(120)
@given(_field_mutation(STRATEGY_SEEDS, STRATEGY_KEYS))
def test_strategy_preset_fields(data):
    """A strategy preset with one value of a wrong type / huge / nan / inf / a date / deeply nested, a key
    deleted, or a known key added with such a value."""
    read_preset("strategy", data)


@fuzz(60)
@given(_bytes_mutation(MODEL_SEEDS))
def test_model_preset_bytes(data):
    read_preset("model", data)


@fuzz(80)
@given(_field_mutation(MODEL_SEEDS, MODEL_KEYS))
def test_model_preset_fields(data):
    read_preset("model", data)


# -------------------------------------------------------------------------------------------------
# --param KEY=VALUE
# -------------------------------------------------------------------------------------------------
PARAM_SEEDS = ("block_size=4", "threshold=0.9", 'mode="dynamic"', "strict_on=true", "route={c = 1.0, on = 1.0}",
               "x=[1, 2]", "policy=hysteresis", "route.c=1", "temperature=0.7", " steps = 4 ")
_CHARS = st.sampled_from(list("=\"'[]{},.#\n\r\t \\0123456789eE+-_xnaifINF") + ["\x00", "\ud800", "\udcff", "\u2028"])


@st.composite
def _param_text(draw) -> str:
    text = draw(st.sampled_from(PARAM_SEEDS))
    op = draw(st.sampled_from(("truncate", "insert", "value", "any")))
    if op == "truncate":
        return text[:draw(st.integers(0, len(text)))]
    if op == "insert":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.text(_CHARS, min_size=1, max_size=3)) + text[at:]
        return text
    if op == "value":
        raw = draw(st.sampled_from(RAW_TOML))
        return text.split("=", 1)[0] + "=" + bytes(raw).decode("utf-8", "surrogateescape")
    return draw(st.text())  # any text, surrogates (undecodable argv bytes) included


def _valid_param(result) -> None:
    key, value = result
    assert isinstance(key, str)


@fuzz(120)
@given(_param_text())
def test_parse_param(text):
    """`--param` text: a seed truncated, with quotes/brackets/newlines/NUL/surrogates inserted, its value a huge
    number / nan / a date / deep nesting, or any text at all."""
    check_reader("param", lambda: parse_param(text), text, valid=_valid_param)


PARAMS_CLASSES = sorted({**{f"strategy {n}": c.Params for n, c in STRATEGIES.items()},
                         **{f"routing policy {n}": c.Params for n, c in POLICY_CLASSES.items()}}.items())
_PY_VALUES = st.one_of(st.sampled_from(HUGE_INTS + SPECIAL_FLOATS + [None, True, "", "x", [], {}, [1.5], {"a": 1}]),
                       st.integers(), st.floats(), st.text(max_size=8),
                       st.text(_CHARS, max_size=12).map(lambda t: parse_param("k=" + t)[1]))


@st.composite
def _params(draw):
    owner, cls = draw(st.sampled_from(PARAMS_CLASSES))
    names = [f.name for f in dataclasses.fields(cls)]
    keys = st.sampled_from(names) if names else st.text(max_size=5)
    params = draw(st.dictionaries(st.one_of(keys, keys, st.text(max_size=5)), _PY_VALUES, max_size=3))
    return owner, cls, params


def _valid_params(cls):
    def check(p) -> None:
        assert isinstance(p, cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            v = getattr(p, f.name)
            assert type(v) is type(default) or (isinstance(v, type(default)) and not isinstance(v, bool)), (f.name, v)
            assert not isinstance(v, float) or math.isfinite(v), (f.name, v)
    return check


@fuzz(120)
@given(_params())
def test_parse_params(case):
    """parse_params of every strategy's and routing policy's Params: known and unknown names, values of any
    type (huge ints, NaN/inf, strings, lists, dicts, what parse_param makes of odd text)."""
    owner, cls, params = case
    check_reader("params", lambda: parse_params(owner, cls, params), case, valid=_valid_params(cls))


@fuzz(80)
@given(st.sampled_from(sorted(STRATEGIES)), st.lists(_param_text(), max_size=3))
def test_strategy_params(name, texts):
    """What `--param` reaches: make_strategy(name, dict(parse_param(t) ...)) with the strategy's own checks."""

    def run():
        return make_strategy(name, dict(parse_param(t) for t in texts))
    check_reader("strategy-params", run, (name, texts))


# -------------------------------------------------------------------------------------------------
# bench prompt files
# -------------------------------------------------------------------------------------------------
PLAIN = "\n".join(BUILTIN_PROMPTS).encode() + b"\n"
JSONL = b"".join(json.dumps({"prompt": p, "id": i}).encode() + b"\n" for i, p in enumerate(BUILTIN_PROMPTS))
PROMPT_SEEDS = (PLAIN, JSONL, PLAIN + JSONL)


def _valid_prompts(result) -> None:
    assert isinstance(result, list) and result and all(isinstance(p, str) and p for p in result)


def read_prompts(data: bytes):
    p = write_case("prompts.txt", data)
    return check_reader("prompts", lambda: load_prompts(p), data, names=(p.name,), valid=_valid_prompts)


def test_prompt_seeds_are_valid():
    assert read_prompts(PLAIN) == BUILTIN_PROMPTS and read_prompts(JSONL) == BUILTIN_PROMPTS


@fuzz(80)
@given(st.sampled_from(PROMPT_SEEDS).flatmap(lambda s: st.one_of(truncated(s), bit_flipped(s),
                                                                 spliced(s, PROMPT_SEEDS))))
def test_prompts_bytes(data):
    """A prompts file truncated, bit-flipped or spliced (non-UTF-8 bytes, NUL, CR, U+2028 included)."""
    read_prompts(data)


@st.composite
def _prompt_fields(draw) -> bytes:
    lines = JSONL.splitlines(keepends=True)
    i = draw(st.integers(0, len(lines) - 1))
    lines[i] = dump_json(draw(mutated_doc(json.loads(lines[i]), "json", keys=("prompt",)))) + b"\n"
    return b"".join(lines)


@fuzz(80)
@given(_prompt_fields())
def test_prompts_fields(data):
    """A JSONL line whose "prompt" (or another field, or the whole object) is a wrong type / huge / NaN /
    non-UTF-8 / deeply nested."""
    read_prompts(data)


@fuzz(60)
@given(st.lists(st.text(min_size=1).filter(str.strip), min_size=1, max_size=5))
def test_prompts_jsonl_round_trip(prompts):
    """Any prompts written as JSON Lines (json.dumps, ensure_ascii=False) read back exactly: line breaks that
    JSON leaves unescaped (U+2028, U+0085, \\x0b ...) must not split a line."""
    data = b"".join(json.dumps({"prompt": p}, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
                    for p in prompts)
    result = read_prompts(data)
    assert result == prompts, (result, prompts)

"""Regression tests for the defects the reader fuzzers (tests/reliability/test_fuzz_*.py) found: each keeps the failing
input literally (or the exact edit of a seed that made it) and checks the reader now gives a one-line
BadInput naming the file, where it used to raise another exception, hang, or return a wrong-typed result."""
from __future__ import annotations

import json
import struct

import pytest

from studio.run.bench import load_prompts
from studio.engine import gguf_file as G
from studio.engine.lora import CONFIG_FILE, WEIGHTS_FILE, load_adapter
from studio.engine.strategies import make_strategy
from studio.engine.strategies.isd import ISD
from studio.errors import BadInput
from studio.events import read_trace
from studio.engine.strategies.params import parse_params
from studio.presets import load_model_preset, load_strategy_preset
from studio.run.config import parse_param
from tests.support.fuzzing import (ARR, I32, STR, U32, check_reader, gguf_bytes, safetensors_bytes, split_safetensors,
                           tiny_gguf_spec, write_case)

pytest_plugins = ["tests.support.fuzzing"]


def bad_input(reader: str, data, call, names=()) -> str:
    """The reader's answer must be a BadInput (check_reader fails the test on anything else)."""
    result = check_reader(reader, call, data, names=names)
    assert isinstance(result, BadInput), f"expected a BadInput, got a valid result: {result!r}"
    return str(result)


# -------------------------------------------------------------------------------------------------
# GGUF (studio.engine.gguf_file.read_gguf)
# -------------------------------------------------------------------------------------------------
def gguf_error(data: bytes) -> str:
    p = write_case("regression.gguf", data)
    return bad_input("gguf", data, lambda: G.read_gguf(p), names=(p.name,))


def _seed_with(key: str, t: int, value) -> bytes:
    kv, tensors = tiny_gguf_spec()
    return gguf_bytes([(k, t, value) if k == key else (k, kt, v) for k, kt, v in kv], tensors)[0]


# A whole GGUF: no tensors, one metadata entry "a" = an array of u8 claiming 2**60 items, then 7 bytes.
GGUF_ARRAY_COUNT_2_60 = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
                         + struct.pack("<IIQ", 9, 0, 2**60) + b"\x00" * 7)


def test_gguf_array_count_past_the_file_is_refused_not_looped_over():
    """test_gguf_lying_lengths: gguf.GGUFReader looped over the 2**60 claimed items past the end of the file
    (reading empty arrays, never advancing: a hang with memory growing ~80 MB/s). Now the header walk
    checks every count and length against the file size first."""
    assert "claims" in gguf_error(GGUF_ARRAY_COUNT_2_60) or "needs" in gguf_error(GGUF_ARRAY_COUNT_2_60)


@pytest.mark.parametrize("count", [2**32, 2**60, 2**64 - 1])
def test_gguf_lying_counts_in_a_real_header(count):
    """The same, in the tiny seed: the u8 array "dlm.fuzz.bytes" (and the tensor / metadata counts) lying."""
    data, fields = gguf_bytes(*tiny_gguf_spec())
    for kind, offset, fmt in fields:
        if kind in ("array length", "tensor count", "metadata count"):
            b = bytearray(data)
            struct.pack_into(fmt, b, offset, count)
            gguf_error(bytes(b))


def test_gguf_tensor_offset_that_wraps_around_is_refused():
    """test_gguf_tensor_table: gguf.GGUFReader adds a tensor's offset to the data start in 64 bits, so an offset of
    2**64-1 wrapped around and the tensor read the bytes before it: accepted, with other weights."""
    kv, tensors = tiny_gguf_spec()
    data, fields = gguf_bytes(kv, tensors)
    b = bytearray(data)
    _, offset, fmt = [f for f in fields if f[0] == "tensor offset"][1]
    struct.pack_into(fmt, b, offset, 2**64 - 1)
    assert "extends past the end of the file" in gguf_error(bytes(b))


def test_gguf_tensor_of_many_dimensions_is_refused():
    """gguf.GGUFReader takes any dimension count; the tensor's own check refuses more than a weight has."""
    kv, tensors = tiny_gguf_spec()
    name, dims, kind, blob = tensors[1]
    tensors[1] = (name, [*dims, 1, 1, 1, 1], kind, blob)
    assert "has 5 dimensions (expected 1 or 2)" in gguf_error(gguf_bytes(kv, tensors)[0])


def test_gguf_arrays_nested_deeper_than_the_walk_goes_are_refused():
    from tests.support.fuzzing import deep_gguf_array
    assert "nests arrays more than 8 deep" in gguf_error(_seed_with("general.name", *deep_gguf_array(50)))


@pytest.mark.parametrize("field, value, words", [
    ("version", 7, "version 7"),                        # GGUFReader's own checks, its words in the BadInput
    ("tensor type", 99, "corrupt GGUF file"),
])
def test_gguf_errors_gguf_reader_finds_itself_are_bad_input(field, value, words):
    data, fields = gguf_bytes(*tiny_gguf_spec())
    b = bytearray(data)
    if field == "version":
        struct.pack_into("<I", b, 4, value)
    else:
        _, offset, fmt = [f for f in fields if f[0] == field][0]
        struct.pack_into(fmt, b, offset, value)
    assert words in gguf_error(bytes(b))


def test_gguf_metadata_of_a_wrong_type():
    """test_gguf_metadata_fields: llama.block_count = an array of arrays of strings -> TypeError from int()."""
    assert "llama.block_count must be a positive integer" in gguf_error(
        _seed_with("llama.block_count", ARR, (ARR, [(STR, ["x" * 70_000] * 2)] * 2)))


def test_gguf_architecture_of_a_wrong_type():
    """general.architecture = an array -> TypeError: unhashable type: 'list' (dict lookup)."""
    assert "unsupported GGUF architecture" in gguf_error(_seed_with("general.architecture", ARR, (I32, [1, 2])))


@pytest.mark.parametrize("key,t,value", [
    ("llama.attention.head_count", U32, 0),            # ZeroDivisionError (dim // n_heads)
    ("llama.attention.head_count_kv", U32, 0),         # ZeroDivisionError (ModelConfig: n_heads % n_kv_heads)
    ("llama.block_count", U32, 2**32 - 1),             # _check_shapes built 9 * 2**32 expected names first
    ("llama.rope.freq_base", 6, float("nan")),         # a config with rope_theta = nan came back as valid
    ("llama.attention.layer_norm_rms_epsilon", 6, float("inf")),
    ("llama.embedding_length", STR, "32"),             # int("32") used to pass, int("x") raised ValueError
])
def test_gguf_metadata_out_of_range(key, t, value):
    gguf_error(_seed_with(key, t, value))


def test_gguf_tokenizer_error_names_the_file():
    """test_gguf_bit_flips: one flipped bit turned the key tokenizer.ggml.model into uokenizer.ggml.model;
    the BadInput said "unsupported GGUF tokenizer None ..." without naming the file."""
    kv, tensors = tiny_gguf_spec()
    data = gguf_bytes([("uokenizer.ggml.model" if k == "tokenizer.ggml.model" else k, t, v) for k, t, v in kv],
                      tensors)[0]
    assert "unsupported GGUF tokenizer" in gguf_error(data)


def test_gguf_tokenizer_damage_is_bad_input():
    """Token strings that are not UTF-8, and merges of a wrong type: UnicodeDecodeError / TypeError from the
    tokenizer built from the metadata."""
    gguf_error(_seed_with("tokenizer.ggml.tokens", ARR, (STR, [b"\xff\xfe", b"h"])))
    gguf_error(_seed_with("tokenizer.ggml.merges", ARR, (I32, [1, 2])))


def test_gguf_token_bit_flip():
    """test_gguf_bit_flips: one bit flipped the token "he" into "ie"; the merge "h e" then names a token out of
    the vocabulary -> tokenizers' plain Exception "Error while initializing BPE: Token `he` out of vocabulary"."""
    from tests.support.fuzzing import TINY_TOKENS
    tokens = ["ie" if t == "he" else t for t in TINY_TOKENS]
    assert "tokenizer" in gguf_error(_seed_with("tokenizer.ggml.tokens", ARR, (STR, tokens)))


def test_gguf_qk_rows_not_divisible_by_heads():
    """test_gguf_lying_tensor_info: blk.0.attn_q.weight's second dimension set to 1 (data cut to match) ->
    "cannot unpermute a Q/K tensor of 1 rows into 4 heads", a BadInput that did not name the file."""
    kv, tensors = tiny_gguf_spec()
    name, dims, ggml_type, blob = tensors[4]
    assert name == "blk.0.attn_q.weight"
    tensors[4] = (name, [dims[0], 1], ggml_type, blob[:dims[0] * 2])
    assert "cannot unpermute" in gguf_error(gguf_bytes(kv, tensors)[0])


def test_gguf_zero_dimension_tensor():
    """test_gguf_tensor_table: blk.0.attn_q.weight with no dimensions (n_dims = 0) -> IndexError: tuple index
    out of range (unpermute_qk reads shape[0])."""
    kv, tensors = tiny_gguf_spec()
    name, dims, ggml_type, blob = tensors[4]   # blk.0.attn_q.weight (unpermuted for llama)
    tensors[4] = (name, [], 0, b"\0\0\0\0")
    gguf_error(gguf_bytes(kv, tensors)[0])


# -------------------------------------------------------------------------------------------------
# PEFT adapters (studio.engine.lora.load_adapter)
# -------------------------------------------------------------------------------------------------
def _adapter_seed():
    from tests.reliability.test_fuzz_adapters import MODEL, SEED
    return MODEL, SEED


def adapter_error(files: dict[str, bytes]) -> str:
    model, _ = _adapter_seed()
    root = write_case("regression-adapter", files)
    return bad_input("adapter", files, lambda: load_adapter(model, root))


def _config(**changes) -> bytes:
    _, seed = _adapter_seed()
    cfg = json.loads(seed[CONFIG_FILE])
    cfg.update(changes)
    return json.dumps(cfg).encode()


def test_adapter_modules_to_save_not_a_list():
    """test_adapter_config_fields: "modules_to_save": 2147483647 -> TypeError: 'int' object is not iterable."""
    _, seed = _adapter_seed()
    assert "modules_to_save must be a list" in adapter_error({CONFIG_FILE: _config(modules_to_save=2147483647),
                                                              WEIGHTS_FILE: seed[WEIGHTS_FILE]})


@pytest.mark.parametrize("key", ["r", "lora_alpha"])
def test_adapter_rank_beyond_float_range(key):
    """test_adapter_config_numbers: "r": 10**400 -> OverflowError: int too large to convert to float."""
    _, seed = _adapter_seed()
    msg = adapter_error({CONFIG_FILE: _config(**{key: 10**400}), WEIGHTS_FILE: seed[WEIGHTS_FILE]})
    assert f"{key} must be a positive" in msg and len(msg) < 300


def test_adapter_config_nested_too_deep():
    """adapter_config.json with 100000 nested arrays -> RecursionError from json.loads."""
    _, seed = _adapter_seed()
    config = b'{"r": 2, "lora_alpha": 4, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "invalid" in adapter_error({CONFIG_FILE: config, WEIGHTS_FILE: seed[WEIGHTS_FILE]})


def test_adapter_tensor_with_a_5000_digit_layer_number():
    """test_adapter_tensors: a tensor renamed model.layers.<5000 nines>.self_attn.q_proj.lora_A.weight ->
    ValueError: Exceeds the limit (4300 digits) for integer string conversion (sorting by layer)."""
    _, seed = _adapter_seed()
    header, data = split_safetensors(seed[WEIGHTS_FILE])
    old = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    header["model.layers." + "9" * 5000 + ".self_attn.q_proj.lora_A.weight"] = header.pop(old)
    assert "not a LoRA weight" in adapter_error({CONFIG_FILE: seed[CONFIG_FILE],
                                                 WEIGHTS_FILE: safetensors_bytes(header, data)})


# -------------------------------------------------------------------------------------------------
# traces (studio.events.read_trace)
# -------------------------------------------------------------------------------------------------
def trace_error(data: bytes) -> str:
    p = write_case("regression.jsonl", data)
    return bad_input("trace", data, lambda: read_trace(p), names=(p.name,))


def _fixture_lines() -> list[bytes]:
    from tests.reliability.test_fuzz_traces import LINES
    return list(LINES[0])


def test_trace_line_nested_too_deep():
    """test_trace_fields: a header field replaced by 100000 nested arrays -> RecursionError from json.loads."""
    lines = _fixture_lines()
    header = json.loads(lines[0])
    lines[0] = json.dumps(header)[:-1].encode() + b', "params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    assert "nested too deeply" in trace_error(b"".join(lines))


def test_trace_number_of_5000_digits():
    """test_trace_lines: an inserted line holding a 5000-digit integer -> ValueError (int conversion limit)."""
    lines = _fixture_lines()
    lines.insert(3, b"9" * 5000 + b"\n")
    assert "number too long" in trace_error(b"".join(lines))


def test_trace_schema_with_a_5000_digit_major():
    """schema "dlm-studio.trace/<5000 digits>" -> ValueError from int() in check_schema."""
    lines = _fixture_lines()
    header = json.loads(lines[0])
    header["schema"] = "dlm-studio.trace/" + "1" * 5000
    lines[0] = json.dumps(header).encode() + b"\n"
    assert "unsupported trace schema" in trace_error(b"".join(lines))


# -------------------------------------------------------------------------------------------------
# presets (studio.presets)
# -------------------------------------------------------------------------------------------------
def preset_error(kind: str, data: bytes) -> str:
    p = write_case(f"regression-{kind}.toml", data)
    load = load_strategy_preset if kind == "strategy" else load_model_preset
    return bad_input(f"preset-{kind}", data, lambda: load(str(p)), names=(p.name,))


def test_preset_not_utf8():
    """test_strategy_preset_bytes: b'\\xe4escription = ...' -> UnicodeDecodeError from read_text()."""
    data = b'\xe4escription = "Plain autoregressive decoding, the baseline (greedy)"\nstrategy = "ar"\n\n' \
           b'[sampling]\ntemperature = 0.0\n'
    assert "not UTF-8" in preset_error("strategy", data)
    assert "not UTF-8" in preset_error("model", b'\xffdescription = "x"\nsource = "default"\n')


def test_preset_values_of_wrong_types():
    """test_strategy_preset_fields / test_model_preset_fields: description = [] came back as a preset with a
    list for a description; params = 5 raised TypeError (dict(5)); sampling = "x" was read as keys x."""
    assert "description must be a string" in preset_error(
        "strategy", b'"description" = []\n"strategy" = "ar"\n"sampling" = {"temperature" = 0.0}\n')
    assert "description must be a string" in preset_error(
        "model", b'"description" = []\n"source" = "default"\n"mask_token_id" = 0\n')
    assert "params must be a table" in preset_error("strategy", b'strategy = "ar"\nparams = 5\n')
    assert "sampling must be a table" in preset_error("strategy", b'strategy = "ar"\nsampling = "x"\n')
    assert "strategy must be a string" in preset_error("strategy", b"strategy = 1979-05-27\n")
    assert "sampling.temperature must be a finite number" in preset_error(
        "strategy", b'strategy = "ar"\nsampling = {temperature = nan}\n')
    assert "mask_token_id must be a non-negative integer" in preset_error(
        "model", b'source = "default"\nmask_token_id = -1\n')


def test_preset_numbers_python_cannot_hold():
    """A 5000-digit int -> ValueError from tomllib; 5000 nested arrays -> RecursionError; a hex int of
    4300+ decimal digits could not even be printed in the error message (ValueError from repr)."""
    assert "not valid TOML" in preset_error("strategy", b'strategy = "ar"\nmax_new_tokens = ' + b"9" * 5000 + b"\n")
    assert "not valid TOML" in preset_error("strategy", b'strategy = "ar"\nx = ' + b"[" * 5000 + b"]" * 5000 + b"\n")
    assert "description must be a string" in preset_error(
        "model", b'"description" = 0x' + b"f" * 4000 + b'\nsource = "default"\n')


def test_preset_that_is_a_directory(tmp_path):
    """A preset path that is a directory -> IsADirectoryError (only FileNotFoundError was caught)."""
    d = tmp_path / "dir.toml"
    d.mkdir()
    assert "cannot read preset" in bad_input("preset-strategy", str(d), lambda: load_strategy_preset(str(d)),
                                             names=("dir.toml",))


# -------------------------------------------------------------------------------------------------
# --param KEY=VALUE (studio.run.config.parse_param, studio.engine.strategies.params.parse_params)
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["block_size=" + "9" * 5000, "x=" + "[" * 5000 + "]" * 5000],
                         ids=["5000 digits", "5000 nested arrays"])
def test_param_value_python_cannot_hold(text):
    """test_parse_param: block_size=<5000 nines> -> ValueError from tomllib (int conversion limit);
    5000 nested arrays -> RecursionError."""
    assert "too long a number or nested too deeply" in bad_input("param", text, lambda: parse_param(text))


def test_params_int_beyond_float_range_for_a_float():
    """tau (a float) = 10**400 -> OverflowError from float(); a TOML hex int of 4000 digits for an int field
    came back as a valid parameter (and could not be printed in a message: ValueError from repr)."""
    assert "must be finite" in bad_input("params", 10**400,
                                         lambda: parse_params("strategy 'isd'", ISD.Params, {"tau": 10**400}))
    huge = parse_param("stride=0x" + "f" * 4000)[1]
    assert "out of range" in bad_input("params", "0xfff...", lambda: parse_params("strategy 'isd'", ISD.Params,
                                                                                   {"stride": huge}))


def test_s2d2_route_must_be_a_table():
    """test_strategy_params: `-s s2d2 --param 'route={'` (parse_param keeps the unparsable value as the
    string "{") -> ValueError: dictionary update sequence element #0 has length 1; 2 is required."""
    with pytest.raises(BadInput):
        make_strategy("s2d2", dict([parse_param("route={")]))


# -------------------------------------------------------------------------------------------------
# bench prompt files (studio.run.bench.load_prompts)
# -------------------------------------------------------------------------------------------------
def prompts_error(data: bytes) -> str:
    p = write_case("regression-prompts.txt", data)
    return bad_input("prompts", data, lambda: load_prompts(p), names=(p.name,))


def test_prompts_not_utf8():
    """test_prompts_bytes: b'\\xffWhat is the capital of France?...' -> UnicodeDecodeError."""
    assert "not UTF-8" in prompts_error(b"\xffWhat is the capital of France?\nWrite a numbered list.\n")


def test_prompts_json_python_cannot_hold():
    """test_prompts_fields: a JSONL line of 5000 nested objects -> RecursionError; a 5000-digit number ->
    ValueError (not a JSONDecodeError, so not caught)."""
    assert "expected a JSON object" in prompts_error(b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"\n")
    assert "expected a JSON object" in prompts_error(b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}\n")


def test_prompts_jsonl_line_separators_inside_strings(tmp_path):
    """test_prompts_jsonl_round_trip: {"prompt": "0\\x85"} written by json.dumps(ensure_ascii=False) was split
    at U+0085 by str.splitlines(), so a valid file was refused ("expected a JSON object")."""
    for prompt in ["0\x85", "a\u2028b", "c\x0bd", "e\x1cf"]:
        p = tmp_path / "p.jsonl"
        p.write_bytes(json.dumps({"prompt": prompt}, ensure_ascii=False).encode() + b"\n")
        assert load_prompts(p) == [prompt]


def test_prompts_line_numbers_count_blank_lines(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": 5}\n')
    with pytest.raises(BadInput, match=r"p\.jsonl:3: "):
        load_prompts(p)


def test_sampling_params_refuse_ints_beyond_the_float_range():
    """SamplingParams(temperature=10**400): math.isnan raised OverflowError (found by reading, after presets
    learnt to refuse such values: other callers still reach it)."""
    from studio.engine.sampling import SamplingParams
    for kw in (dict(temperature=10**400), dict(top_p=10**400)):
        with pytest.raises(BadInput):
            SamplingParams(**kw)

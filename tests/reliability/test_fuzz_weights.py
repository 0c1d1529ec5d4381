"""Fuzzing the weight readers: `studio.engine.gguf_file.read_gguf` (header, metadata, tensor table, data,
the tokenizer built from it) and `read_safetensors` (the reader of every *.safetensors file).

Each mutation family is one test; see tests/support/fuzzing.py for the property and the profiles."""
from __future__ import annotations

import math
import struct

import torch
from hypothesis import given
from hypothesis import strategies as st

from studio.engine import gguf_file as G
from studio.engine.lazy_tensors import read_safetensors
from tests.support.fuzzing import (GGUF_ALIGN, HUGE_INTS, NON_UTF8, SAFETENSORS_DTYPES, bit_flipped, check_reader,
                           deep_gguf_array, fuzz, gguf_bytes, gguf_header_size, gguf_values, mutated_doc,
                           safetensors_bytes, spliced, split_safetensors, tiny_gguf_spec, truncated, write_case)

pytest_plugins = ["tests.support.fuzzing"]

KV, TENSORS = tiny_gguf_spec("llama")
SEED, LENGTH_FIELDS = gguf_bytes(KV, TENSORS)
DONOR, _ = gguf_bytes(*tiny_gguf_spec("qwen3"))
HEADER = gguf_header_size(SEED)
KNOWN_KEYS = tuple(k for k, _, _ in KV) + ("llama.attention.key_length", "llama.rope.scaling.type",
                                            "llama.rope.scaling.factor", "tokenizer.ggml.eot_token_id",
                                            "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")


def _valid_gguf(result) -> None:
    cfg, sd, tok = result
    for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
        v = getattr(cfg, f)
        assert isinstance(v, int) and v > 0, f"config {f} = {v!r}"
    for f in ("rope_theta", "rms_eps"):
        v = getattr(cfg, f)
        assert isinstance(v, float) and math.isfinite(v) and v > 0, f"config {f} = {v!r}"
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in sd.values())
    assert all(isinstance(i, int) for i in cfg.eos_ids)


def read_gguf_case(data: bytes):
    p = write_case("case.gguf", data)
    try:
        return check_reader("gguf", lambda: G.read_gguf(p), data, names=(p.name,), valid=_valid_gguf)
    finally:
        p.unlink()


def test_gguf_seed_is_valid():
    cfg, sd, tok = read_gguf_case(SEED)
    assert (cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads) == (32, 1, 12, 4, 2)
    assert tok.decode(tok.encode("hello")) == "hello"


@fuzz(80)
@given(truncated(SEED, HEADER))
def test_gguf_truncated(data):
    read_gguf_case(data)


@fuzz(120)
@given(bit_flipped(SEED, HEADER))
def test_gguf_bit_flips(data):
    read_gguf_case(data)


@fuzz(80)
@given(spliced(SEED, (DONOR,), HEADER))
def test_gguf_splices(data):
    read_gguf_case(data)


_HUGE = {"<Q": [2**32, 2**40, 2**60, 2**63, 2**64 - 1, len(SEED), len(SEED) + 1], "<I": [2**31, 2**32 - 1]}
_SMALL = {"<Q": [0, 1, 2, 7], "<I": [0, 1, 2, 13, 14, 31]}
_BY_KIND: dict[str, list] = {}
for _kind, _offset, _fmt in LENGTH_FIELDS:
    _BY_KIND.setdefault(_kind, []).append((_offset, _fmt))
_LENGTHS = ("tensor count", "metadata count", "key length", "value string length", "array length",
            "tensor name length")


def _lie(kinds):
    """A field of one of `kinds` (a kind first, then a field of it) and a value for it: huge half the time."""
    return st.sampled_from(kinds).flatmap(lambda kind: st.sampled_from(_BY_KIND[kind])).flatmap(
        lambda f: st.tuples(st.just(f), st.one_of(st.sampled_from(_HUGE[f[1]]), st.sampled_from(_SMALL[f[1]]))))


def _lied(lies) -> bytes:
    b = bytearray(SEED)
    for (offset, fmt), value in lies:
        struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@fuzz(200)
@given(st.lists(_lie(_LENGTHS), min_size=1, max_size=2))
def test_gguf_lying_lengths(lies):
    """A count or a string/array length claiming up to 2**64-1 items or bytes: it must be checked against the
    file size before anything is read, looped over or allocated by it."""
    read_gguf_case(_lied(lies))


@fuzz(120)
@given(st.lists(_lie(sorted(set(_BY_KIND) - set(_LENGTHS))), min_size=1, max_size=2))
def test_gguf_lying_tensor_info(lies):
    """A value type, array item type, tensor dimension count, dimension, tensor type or data offset replaced
    by an absurd value."""
    read_gguf_case(_lied(lies))


_METADATA_OPS = ("replace", "replace", "delete", "duplicate", "add", "bad key", "deep")


@fuzz(160)
@given(st.data())
def test_gguf_metadata_fields(data):
    """One metadata entry replaced by a value of a wrong type / huge / NaN / non-UTF-8 / nested, deleted,
    duplicated, or a known key added with such a value."""
    kv = list(KV)
    i = data.draw(st.integers(0, len(kv) - 1))
    op = data.draw(st.sampled_from(_METADATA_OPS))
    if op == "replace":
        kv[i] = (kv[i][0], *data.draw(gguf_values()))
    elif op == "delete":
        del kv[i]
    elif op == "duplicate":
        kv.insert(data.draw(st.integers(0, len(kv))), kv[i])
    elif op == "add":
        kv.append((data.draw(st.sampled_from(KNOWN_KEYS)), *data.draw(gguf_values())))
    elif op == "bad key":
        kv[i] = (data.draw(st.sampled_from(NON_UTF8 + [b""])), *kv[i][1:])
    else:
        kv[i] = (kv[i][0], *deep_gguf_array(data.draw(st.sampled_from([2, 50, 2000, 100_000]))))
    blob, _ = gguf_bytes(kv, TENSORS)
    read_gguf_case(blob)


@fuzz(120)
@given(st.data())
def test_gguf_tensor_table(data):
    """One tensor's dims, type, name, offset or data changed, or the tensor dropped / duplicated."""
    tensors = list(TENSORS)
    offsets = None
    i = data.draw(st.integers(0, len(tensors) - 1))
    name, dims, ggml_type, blob = tensors[i]
    op = data.draw(st.sampled_from(("dims", "ndims", "type", "name", "offset", "data", "drop", "duplicate")))
    if op == "dims":
        dims = list(dims)
        dims[data.draw(st.integers(0, len(dims) - 1))] = data.draw(st.sampled_from([0, 1, 3, 33, 2**31, 2**32,
                                                                                    2**62, 2**64 - 1]))
    elif op == "ndims":
        dims = data.draw(st.lists(st.sampled_from([0, 1, 2, 8, 32, 2**33]), max_size=6))
    elif op == "type":
        ggml_type = data.draw(st.one_of(st.integers(0, 40), st.sampled_from([2**31, 2**32 - 1])))
    elif op == "name":
        name = data.draw(st.one_of(st.sampled_from(NON_UTF8 + [b"", "blk.0.mystery.weight", "rope_freqs.weight",
                                                                 "blk.99999999999999999999.attn_q.weight",
                                                                 "blk.0.attn_q.bias", TENSORS[0][0]]),
                                   st.text(max_size=20)))
    elif op == "offset":
        offsets, pos = [], 0
        for t in tensors:
            offsets.append(pos)
            pos += len(t[3]) + (-len(t[3]) % GGUF_ALIGN)
        offsets[i] = data.draw(st.sampled_from([1, 3, GGUF_ALIGN, pos, pos + GGUF_ALIGN, 2**40, 2**63, 2**64 - 1]))
    elif op == "data":
        blob = blob[:data.draw(st.integers(0, len(blob)))]
    if op == "drop":
        del tensors[i]
    elif op == "duplicate":
        tensors.insert(data.draw(st.integers(0, len(tensors))), tensors[i])
    else:
        tensors[i] = (name, dims, ggml_type, blob)
    if offsets is not None and op in ("drop", "duplicate"):
        offsets = None
    out, _ = gguf_bytes(KV, tensors, offsets=offsets)
    read_gguf_case(out)


# -------------------------------------------------------------------------------------------------
# safetensors
# -------------------------------------------------------------------------------------------------
def _safetensors_seed() -> bytes:
    from safetensors.torch import save
    g = torch.Generator().manual_seed(0)
    return save({"a": torch.randn(3, 4, generator=g), "b": torch.arange(5), "c": torch.randn(2, 2, 2).half(),
                 "d": torch.zeros(0, 3), "e": torch.tensor([True, False])}, metadata={"format": "pt"})


ST_SEED = _safetensors_seed()
ST_HEADER, ST_DATA = split_safetensors(ST_SEED)
ST_FOCUS = 8 + struct.unpack("<Q", ST_SEED[:8])[0]


def _valid_tensors(result) -> None:
    assert isinstance(result, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in result.items())


def read_safetensors_case(data: bytes):
    p = write_case("case.safetensors", data)
    try:
        return check_reader("safetensors", lambda: read_safetensors(p), data, names=(p.name,),
                            valid=_valid_tensors)
    finally:
        p.unlink()


def test_safetensors_seed_is_valid():
    sd = read_safetensors_case(ST_SEED)
    assert set(sd) == {"a", "b", "c", "d", "e"} and sd["c"].shape == (2, 2, 2)


@fuzz(60)
@given(truncated(ST_SEED, ST_FOCUS))
def test_safetensors_truncated(data):
    read_safetensors_case(data)


@fuzz(80)
@given(bit_flipped(ST_SEED, ST_FOCUS))
def test_safetensors_bit_flips(data):
    read_safetensors_case(data)


@fuzz(60)
@given(spliced(ST_SEED, (), ST_FOCUS))
def test_safetensors_splices(data):
    read_safetensors_case(data)


@fuzz(60)
@given(st.sampled_from([0, 1, 2, 7, 8, ST_FOCUS - 9, ST_FOCUS - 7, ST_FOCUS, len(ST_SEED), len(ST_SEED) + 1,
                        100_000_001, 2**31, 2**32, 2**60, 2**63, 2**64 - 1]))
def test_safetensors_lying_header_length(length):
    """The 8-byte header length claims anything from 0 to 2**64-1 bytes."""
    read_safetensors_case(struct.pack("<Q", length) + ST_SEED[8:])


_SHAPES = st.lists(st.one_of(st.sampled_from(HUGE_INTS), st.integers(-2, 40)), max_size=5)
_OFFSETS = st.lists(st.one_of(st.sampled_from(HUGE_INTS), st.integers(-2, len(ST_DATA) + 2)), max_size=3)


@fuzz(120)
@given(st.data())
def test_safetensors_header_fields(data):
    """A header field replaced by a wrong type / huge / NaN / non-UTF-8 / deeply nested value (the header
    length kept right, so the JSON is what gets read), or a tensor's dtype, shape or offsets made absurd."""
    header = ST_HEADER
    if data.draw(st.booleans()):
        header = data.draw(mutated_doc(header, "json", keys=("dtype", "shape", "data_offsets", "__metadata__")))
    else:
        header = {k: dict(v) for k, v in header.items()}
        name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = data.draw(st.sampled_from(("dtype", "shape", "data_offsets")))
        header[name][field] = data.draw({"dtype": st.sampled_from(SAFETENSORS_DTYPES), "shape": _SHAPES,
                                         "data_offsets": _OFFSETS}[field])
    read_safetensors_case(safetensors_bytes(header, ST_DATA))

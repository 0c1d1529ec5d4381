"""Jacobi trajectories of a causal model and the noisy state each block trains on (Jacobi Forcing's data:
docs/training.md#jacobi-forcing).

The answer of a sequence is tiled from its first token into blocks of n. Each block is iterated by greedy Jacobi
from the public recipe's start: the block's first token is right (the AR prediction of its prefix), the other n-1
are tokens drawn from the context (the prompt and the answer before the block). An iteration replaces every draft
by the model's greedy prediction from the block's prefix; every state is recorded until the block stops changing:
its fixed point, greedy AR's continuation of the prefix (on self-distilled data, the answer itself).

All blocks of a batch of sequences iterate at once: block j attends to the answer's clean prefix before it (a
clean pass's K/V) and to itself causally. That is what decoding the blocks one after another sees, because each
earlier block has converged to that prefix when the next one starts. Once every block's first c tokens are the
answer's, an iteration computes only rows c-1.. (the rows before predict what they already hold): about half the
rows of recomputing whole blocks.

A block's noise is the share of it not yet converged: (n - the first index where the state differs from the
fixed point) / n. The progressive schedule gives block j the target noise linspace(0, 1, window)[j mod window]
(rising across each window of consecutive blocks, then again); `random` draws the schedule index. The state
whose noise is closest to the target (the earliest on a tie) is the block's noisy state.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from studio.errors import BadInput
from studio.interrupts import uninterruptible
from studio.train.data import Sequence
from studio.train.layout import block_positions, noisy_rows_mask
from studio.train.objectives import TwoPassKV

SCHEDULES = ("progressive", "random")


@dataclass
class Trajectory(Sequence):
    block: int                         # n: the block size the states were recorded at
    states: list[list[list[int]]]      # per block of the answer: its states, the start first, the fixed point last

    def n_blocks(self) -> int:
        """The blocks that lie inside the (possibly cut) answer."""
        return min(len(self.states), (len(self.tokens) - self.prompt_len) // self.block)

    def clean(self, j: int) -> list[int]:
        """Block j of the answer: the state its noisy states are measured against and the clean block it trains."""
        start = self.prompt_len + j * self.block
        return self.tokens[start:start + self.block]


def noise(state: list[int], clean: list[int]) -> float:
    """The share of `state` not yet converged to `clean`: (n - the first index where they differ) / n."""
    n = len(clean)
    first = next((i for i, (a, b) in enumerate(zip(state, clean)) if a != b), n)
    return (n - first) / n


def pick_state(states: list[list[int]], clean: list[int], j: int, window: int, schedule: str,
               rng: random.Random) -> list[int]:
    """Block j's noisy state: the recorded state whose noise is closest to the schedule's target for j."""
    index = j % window if schedule == "progressive" else rng.randrange(window)
    target = index / (window - 1) if window > 1 else 0.0          # linspace(0, 1, window)[index]
    gaps = [abs(noise(s, clean) - target) for s in states]
    return states[gaps.index(min(gaps))]


def _starts(seq: Sequence, n: int, rng: random.Random) -> list[list[int]]:
    """Every block's first state: its right first token, then n-1 tokens drawn from the context before it."""
    out = []
    for j in range((len(seq.tokens) - seq.prompt_len) // n):
        start = seq.prompt_len + j * n
        out.append([seq.tokens[start]] + [seq.tokens[rng.randrange(start)] for _ in range(n - 1)])
    return out


@torch.no_grad()
def record_batch(model, seqs: list[Sequence], n: int, rng: random.Random, adapted: bool = False) -> list[Trajectory]:
    """The Jacobi trajectories of every block of `seqs` (answers of at least n tokens) at block size n. `adapted`:
    the model's LoRA applies on every row (a model an `all` adapter makes)."""
    device = model.lm_head.weight.device
    firsts = [_starts(s, n, rng) for s in seqs]
    if any(not f for f in firsts):
        raise BadInput(f"an answer shorter than the block size {n} has no Jacobi block")
    B, L, K = len(seqs), max(len(s.tokens) for s in seqs), max(len(f) for f in firsts)
    clean = torch.zeros(B, L, dtype=torch.long)
    for b, s in enumerate(seqs):
        clean[b, :len(s.tokens)] = torch.tensor(s.tokens)
    # a sequence with fewer blocks repeats its last one (computed, never recorded)
    starts = [[s.prompt_len + min(j, len(f) - 1) * n for j in range(K)] for s, f in zip(seqs, firsts)]
    state = torch.tensor([[f[min(j, len(f) - 1)] for j in range(K)] for f in firsts])          # [B, K, n]
    answer = torch.stack([clean[b, torch.tensor(st)[:, None] + torch.arange(n)] for b, st in enumerate(starts)])
    kv = TwoPassKV()
    gate = (lambda t: torch.ones_like(t, dtype=torch.bool)) if adapted else (lambda t: None)
    model(clean.to(device), torch.arange(L, device=device)[None].expand(B, L), kv, lora_gate=gate(clean),
          logits_rows=[0])
    kv.recording = False
    traces = [[[f] for f in fs] for fs in firsts]
    for _ in range(n):                       # greedy Jacobi fixes at least one more token per iteration
        # the first c tokens of every block are the answer's, so rows 0..c-2 predict what they already hold: the
        # forward starts at row c-1 (its input and context are the answer's), a block of n - c + 1 rows
        c = int((state == answer).int().cumprod(-1).sum(-1).min().clamp(min=1))
        if c == n:
            break
        w, shifted = n - c + 1, [[x + c - 1 for x in st] for st in starts]
        positions = torch.stack([block_positions(st, w) for st in shifted]).to(device)
        mask = torch.stack([noisy_rows_mask(st, w, L) for st in shifted])[:, None].to(device)
        rows = state[..., c - 1:].reshape(B, K * w).to(device)
        guess = model(rows, positions, kv, mask=mask, lora_gate=gate(rows)).argmax(-1).view(B, K, w).cpu()
        new = torch.cat([state[..., :c], guess[..., :n - c]], dim=-1)
        moved = (new != state).any(-1)
        if not moved.any():
            break
        tokens = new.tolist()
        for b, j in moved.nonzero().tolist():
            if j < len(firsts[b]):
                traces[b][j].append(tokens[b][j])
        state = new
    return [Trajectory(s.tokens, s.prompt_len, n, t) for s, t in zip(seqs, traces)]


def record(model, seqs: list[Sequence], n: int, path: Path, seed: int = 0, batch_size: int = 8,
           adapted: bool = False, progress: Callable[[int, int, float], None] | None = None,
           deadline: float | None = None) -> list[Trajectory]:
    """The trajectories of every sequence with at least one whole block, appended to `path` (JSON lines) batch by
    batch; a file already there is continued at its last whole batch (each batch's draws depend only on its index).
    `progress(done, total, converged)`: the share of blocks whose fixed point is the answer's block, so far.
    `deadline` (time.perf_counter()): stop before a batch that would start after it (fewer trajectories return)."""
    seqs = [s for s in seqs if len(s.tokens) - s.prompt_len >= n]
    if not seqs:
        raise BadInput(f"no training sequence has an answer of a whole block ({n} tokens)")
    done = read(path, n) if path.is_file() else []
    # a batch cut off mid-write is recorded again
    whole = len(done) if len(done) == len(seqs) else len(done) // batch_size * batch_size
    if any(t.tokens != s.tokens for t, s in zip(done, seqs)):
        raise BadInput(f"{path} holds the trajectories of other sequences: remove it to record these")
    if whole < len(done):
        done = done[:whole]
        _write(path, done, "w")
    for first in range(whole, len(seqs), batch_size):
        if deadline is not None and time.perf_counter() > deadline:
            break
        rng = random.Random(seed * 1_000_003 + first)
        trajs = record_batch(model, seqs[first:first + batch_size], n, rng, adapted)
        _write(path, trajs, "a")
        done += trajs
        if progress:
            progress(len(done), len(seqs), converged_share(done))
    return done


@uninterruptible   # a batch's lines are written whole, so a resumed recording starts at a batch boundary
def _write(path: Path, trajs: list[Trajectory], mode: str) -> None:
    with open(path, mode, encoding="utf-8") as f:
        f.write("".join(json.dumps({"tokens": t.tokens, "prompt_len": t.prompt_len, "states": t.states}) + "\n"
                        for t in trajs))


def converged_share(trajs: list[Trajectory]) -> float:
    """The share of blocks whose fixed point is the answer's own block (1.0 but for near-ties between the data's
    decoder and the training forward)."""
    hits = total = 0
    for t in trajs:
        for j in range(len(t.states)):
            hits += t.states[j][-1] == t.clean(j)
            total += 1
    return hits / max(1, total)


def read(path: Path, n: int) -> list[Trajectory]:
    """The trajectories in `path`, recorded at block size n; a last line cut off mid-write is dropped."""
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        try:
            d = json.loads(line)
            t = Trajectory(d["tokens"], d["prompt_len"], n, d["states"])
        except (ValueError, KeyError, TypeError):
            break
        if any(len(s) != n for block in t.states for s in block):
            raise BadInput(f"{path}: line {i + 1} was not recorded at block size {n}")
        out.append(t)
    return out

"""Trajectory compression (dInfer App. C.1) for canvas models: golden trajectories of the masked-diffusion model
decoding its prompts, and the objective that trains it to jump between their non-consecutive states
(docs/training.md#trajectory-compression).

A golden trajectory is one `canvas` run on a data sequence's prompt, kept when its answer agrees with the base
model's greedy answer (the data's, cut to the canvas) on at least `min_agreement` of the tokens: each canvas
position is recorded with the step (the forward) that revealed it. State s_t is the canvas after t steps: the
positions revealed by then hold their final tokens, the rest are MASK. Training draws two states a < b of a
trajectory, feeds s_a, and puts the loss on the positions MASKed in s_a and revealed by s_b, each read on the row
before it (the logit shift): one forward learns what the trajectory took b - a forwards to reveal.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from studio.errors import BadInput
from studio.interrupts import uninterruptible
from studio.train.data import Sequence
from studio.train.objectives import IGNORE, MDM, T_QUARTERS, CanvasBatch


@dataclass
class CanvasTrajectory(Sequence):
    reveal: list[int]    # per canvas position (after the prompt): the step that revealed it, 1..steps

    @property
    def steps(self) -> int:
        return max(self.reveal)


def trajectory_of(prompt: list[int], events: list[dict], canvas_len: int, fill: int | None) -> CanvasTrajectory:
    """A canvas run's trajectory from its events: every `unmask` reveals its positions at the current step (the
    number of forwards so far). A position the run never revealed (its canvas stopped early after an EOS) holds
    `fill` (the EOS), revealed at the last step."""
    tokens: list[int | None] = [None] * canvas_len
    reveal = [0] * canvas_len
    step = 0
    for e in events:
        if e["t"] == "forward":
            step += 1
        elif e["t"] == "unmask":
            for p, t in zip(e["pos"], e["tok"]):
                if 0 <= p < canvas_len and tokens[p] is None:
                    tokens[p], reveal[p] = t, max(1, step)
    last = max(1, step)
    if fill is None and None in tokens:
        raise BadInput("a canvas run left cells unrevealed on a model without an EOS to fill them with")
    canvas = [fill if t is None else t for t in tokens]
    return CanvasTrajectory(prompt + canvas, len(prompt), [r or last for r in reveal])


def agreement(answer: list[int], reference: list[int]) -> float:
    """The share of the reference's tokens the answer reproduces at the same position."""
    return sum(a == b for a, b in zip(answer, reference)) / max(1, len(reference))


def record(run_one: Callable[[list[int]], tuple[list[int], list[dict]]], seqs: list[Sequence], canvas_len: int,
           fill: int | None, min_agreement: float, path: Path, progress=None,
           deadline: float | None = None) -> tuple[list[CanvasTrajectory], int]:
    """The golden trajectories of `seqs` (`run_one(prompt ids)` -> the run's answer tokens and events), appended to
    `path` (JSON lines, one per sequence tried, with its agreement) and continued where a file there stopped. Which
    are kept is decided by `min_agreement` on every call, so a resumed run may keep more or fewer. No run starts
    after `deadline` (a `time.perf_counter()` value): the next call goes on from there. Returns the kept
    trajectories and how many sequences have been tried. `progress(done, total, kept)`."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    tried = []
    for line in lines:
        try:
            tried.append(json.loads(line))
        except ValueError:
            break                                    # a line cut off mid-write: tried again
    if any(d["tokens"][:d["prompt_len"]] != s.tokens[:s.prompt_len] for d, s in zip(tried, seqs)):
        raise BadInput(f"{path} holds the trajectories of other prompts: remove it to record these")
    if len(tried) < len(lines):
        _write(path, tried, "w")
    def golden(d: dict) -> bool:
        return d["agreement"] >= min_agreement

    for s in seqs[len(tried):]:
        if deadline is not None and time.perf_counter() > deadline:
            break
        prompt = s.tokens[:s.prompt_len]
        answer, events = run_one(prompt)
        t = trajectory_of(prompt, events, canvas_len, fill)
        # the canvas holds canvas_len tokens: the data's answer past them cannot be agreed with
        d = {"tokens": t.tokens, "prompt_len": t.prompt_len, "reveal": t.reveal,
             "agreement": agreement(answer, s.tokens[s.prompt_len:][:canvas_len])}
        _write(path, [d], "a")
        tried.append(d)
        if progress:
            progress(len(tried), len(seqs), sum(map(golden, tried)))
    return [CanvasTrajectory(d["tokens"], d["prompt_len"], d["reveal"]) for d in tried if golden(d)], len(tried)


@uninterruptible   # a line is written whole
def _write(path: Path, rows: list[dict], mode: str) -> None:
    with open(path, mode, encoding="utf-8") as f:
        f.write("".join(json.dumps(d) + "\n" for d in rows))


class Compression(MDM):
    """The compressed-transition loss: -sum over k in M_a minus M_b of log p(x_k = s_b[k] | s_a), averaged over those
    positions in the batch; a and b drawn uniformly with 0 <= a < b <= steps. Accuracy by slot: by the quarter of the
    canvas still MASKed in s_a (slot 1: almost all revealed ... 4: almost all MASKed)."""

    def make_batch(self, seqs: list[CanvasTrajectory], rows_per_seq: int, progress: float,
                   gen: torch.Generator) -> CanvasBatch:
        B, L = len(seqs), max(len(s.tokens) for s in seqs)
        tokens = torch.zeros(B, L, dtype=torch.long)
        keys = torch.zeros(B, L, dtype=torch.bool)
        targets = torch.full((B, L), IGNORE, dtype=torch.long)
        weights = torch.zeros(B, L)
        slot = torch.zeros(B, L, dtype=torch.long)
        for b, s in enumerate(seqs):
            n, P = len(s.tokens), s.prompt_len
            a, hi = sorted(torch.randperm(s.steps + 1, generator=gen)[:2].tolist())
            reveal = torch.tensor(s.reveal)
            answer = torch.tensor(s.tokens[P:])
            masked = reveal > a
            jumped = masked & (reveal <= hi)
            tokens[b, :n] = torch.tensor(s.tokens)
            tokens[b, P:n] = torch.where(masked, self.mask_id, answer)
            keys[b, :n] = True
            rows = torch.arange(P, n)[jumped] - (1 if self.shift else 0)
            targets[b, rows] = answer[jumped]
            weights[b, rows] = 1.0
            share = float(masked.float().mean())
            slot[b, rows] = 1 + min(T_QUARTERS - 1, int(share * T_QUARTERS))
        return CanvasBatch(tokens, keys, targets, weights, slot, (targets != IGNORE).sum().float())

"""Jacobi Forcing (progressive consistency distillation, docs/training.md#jacobi-forcing): the objective
`train jacobi` trains, on trajectories recorded by studio.train.trajectories.

A sequence packs `prompt + [k_0, l_0, ..., k_{T-1}, l_{T-1}]`: block j's noisy state k_j (chosen by the schedule)
and its clean block l_j, with shared positions and the noise-aware causal mask (layout.jacobi_forcing_layout). One
forward with the LoRA on every row gives both streams' logits, and

    loss = ar_weight * L_AR + L_consistency

L_AR: next-token cross-entropy over the clean stream (the prompt, inside each clean block and across blocks, up to
and including the first EOS). L_consistency: at every offset t of k_j from the first index where k_j and l_j differ,
the soft cross-entropy of the noisy row against the detached logits of the clean row at t (temperature tau, times
tau^2): the noisy context learns to predict what the clean one predicts, so the Jacobi drafts after an unconverged
token come right sooner. The adapter makes a new model; `jacobi` and `jacobi-mr` decode it exactly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from studio.train.layout import jacobi_forcing_layout
from studio.train.objectives import IGNORE, Losses, Objective, OnDevice, TwoPassKV, hits_by_slot
from studio.train.trajectories import Trajectory, pick_state


@dataclass
class PackedBatch(OnDevice):
    tokens: torch.Tensor         # [B, N] prompt + [k_0, l_0, ...], right-padded
    positions: torch.Tensor      # [B, N]
    mask: torch.Tensor           # [B, N, N] the noise-aware causal mask (a padding row sees itself)
    ar_targets: torch.Tensor     # [B, N] the clean stream's next token on prompt and clean rows, IGNORE elsewhere
    teacher: torch.Tensor        # [B, N] on a noisy row trained for consistency: the clean row at its offset
    targets: torch.Tensor        # [B, N] on those noisy rows: the clean next token (their accuracy), else IGNORE
    slot: torch.Tensor           # [B, N] 1 + the offset past the first unconverged token, 0 = none


class JacobiForcing(Objective):
    gate_all = True

    def __init__(self, block: int, window: int = 8, schedule: str = "progressive", ar_weight: float = 10.0,
                 temperature: float = 1.0, eos_ids=()):
        self.n, self.window, self.schedule, self.ar_weight = block, window, schedule, ar_weight
        self.tau, self.eos_ids = temperature, set(eos_ids)

    def block_width(self, progress: float) -> int:
        return self.n

    def min_answer(self) -> int:
        return self.n

    def n_slots(self) -> int:
        return self.n

    def pack(self, t: Trajectory, n_blocks: int, rng: random.Random):
        """(tokens, positions, mask, ar_targets, teacher, targets, slot) of one trajectory's first n_blocks."""
        n, P = self.n, t.prompt_len
        positions, mask = jacobi_forcing_layout(P, n, n_blocks)
        prompt = t.tokens[:P]
        answer = t.tokens[P:]
        eos = next((i for i, tok in enumerate(answer) if tok in self.eos_ids), len(answer))
        tokens, ar, teacher, targets, slot = list(prompt), [*prompt[1:], answer[0]], [0] * P, [IGNORE] * P, [0] * P
        for j in range(n_blocks):
            clean = t.clean(j)
            noisy = pick_state(t.states[j], clean, j, self.window, self.schedule, rng)
            base = len(tokens)                     # k_j's first row; l_j's is base + n
            first = next((i for i, (a, b) in enumerate(zip(noisy, clean)) if a != b), n)
            for i in range(n):
                a = j * n + i + 1                  # the answer index row i of either block predicts
                keep = a < len(answer) and a <= eos
                trained = keep and i >= first
                teacher.append(base + n + i if trained else 0)
                targets.append(answer[a] if trained else IGNORE)
                slot.append(i - first + 1 if trained else 0)
            ar += [IGNORE] * n
            ar += [answer[a] if a < len(answer) and a <= eos else IGNORE for a in range(j * n + 1, j * n + n + 1)]
            teacher += [0] * n
            targets += [IGNORE] * n
            slot += [0] * n
            tokens += noisy + clean
        return (torch.tensor(tokens), positions, mask, *(torch.tensor(x) for x in (ar, teacher, targets, slot)))

    def make_batch(self, seqs: list[Trajectory], rows_per_seq: int, progress: float,
                   gen: torch.Generator) -> PackedBatch:
        rng = random.Random(int(torch.randint(2 ** 31, (), generator=gen)))   # the random schedule's draws
        parts = [self.pack(t, max(1, min(t.n_blocks(), rows_per_seq // self.n)), rng) for t in seqs]
        B, N = len(parts), max(len(p[0]) for p in parts)
        out = [torch.zeros(B, N, dtype=torch.long), torch.zeros(B, N, dtype=torch.long),
               torch.eye(N, dtype=torch.bool).repeat(B, 1, 1), torch.full((B, N), IGNORE, dtype=torch.long),
               torch.zeros(B, N, dtype=torch.long), torch.full((B, N), IGNORE, dtype=torch.long),
               torch.zeros(B, N, dtype=torch.long)]
        for b, p in enumerate(parts):
            k = len(p[0])
            for field, value in zip(out, p):
                if field.dim() == 3:
                    field[b, :k, :k] = value
                else:
                    field[b, :k] = value
        return PackedBatch(*out)

    def loss(self, model, batch: PackedBatch, n_slots: int) -> Losses:
        batch = batch.to(model.lm_head.weight.device)
        logits = model(batch.tokens, batch.positions, TwoPassKV(), mask=batch.mask[:, None],
                       lora_gate=torch.ones_like(batch.tokens, dtype=torch.bool))
        ar = F.cross_entropy(logits.flatten(0, 1), batch.ar_targets.flatten(), ignore_index=IGNORE)
        rows = batch.targets != IGNORE
        if rows.any():
            b = torch.arange(len(logits), device=logits.device)[:, None].expand_as(rows)[rows]
            student = logits[rows].float() / self.tau
            teacher = logits[b, batch.teacher[rows]].detach().float() / self.tau
            consistency = -(teacher.softmax(-1) * student.log_softmax(-1)).sum(-1).mean() * self.tau ** 2
        else:                                  # every noisy state chosen was its fixed point
            consistency = logits.sum() * 0.0
        correct, counted = hits_by_slot(logits, batch.targets, batch.slot, n_slots)
        return Losses(self.ar_weight * ar + consistency, float(consistency.detach()), float(ar.detach()),
                      correct, counted)

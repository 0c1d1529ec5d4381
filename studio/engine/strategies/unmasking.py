"""What a denoising step unmasks: the drafter's view of a block's masked slots after one forward, and the rules that
choose which of them to commit (SDAR/LLaDA's fixed counts, Fast-dLLM's threshold, dInfer's hierarchical and credit
decoders). Shared by blockdiff, canvas, S2D2 and SimSD.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from studio.engine.sampling import SamplingParams, process_logits, sample
from studio.engine.strategies.params import param
from studio.errors import BadInput

DECODERS = ("threshold", "hierarchical", "credit")


@dataclass
class Draft:
    """The drafter's view of the masked slots after one forward, in slot order."""
    slots: list[int]
    tokens: list[int]            # chosen token per slot (argmax when greedy, else drawn from q)
    conf: list[float]            # its probability: softmax when greedy, q otherwise
    q: torch.Tensor | None       # [n, V] the processed distributions the tokens were drawn from (None: greedy)
    dist: torch.Tensor           # [n, V] the drafter distribution routing reads (softmax when greedy, else q)

    @classmethod
    def from_logits(cls, slots: list[int], logits: torch.Tensor, sampling: SamplingParams,
                    gen: torch.Generator) -> "Draft":
        if sampling.greedy:
            dist = torch.softmax(logits.float(), dim=-1)
            conf, tokens = dist.max(dim=-1)
            return cls(slots, tokens.tolist(), conf.tolist(), None, dist)
        q = process_logits(logits, sampling)
        tokens = sample(q, gen)
        return cls(slots, tokens.tolist(), q.gather(1, tokens[:, None])[:, 0].tolist(), q, q)

    def subset(self, idx: list[int]) -> "Draft":
        pick = torch.tensor(idx, dtype=torch.long, device=self.dist.device)
        return Draft([self.slots[i] for i in idx], [self.tokens[i] for i in idx], [self.conf[i] for i in idx],
                     None if self.q is None else self.q[pick], self.dist[pick])


def transfer_counts(n_masked: int, steps: int) -> list[int]:
    """Tokens to unmask per step: n spread over `steps`, the remainder on the first steps (SDAR/LLaDA)."""
    base, rem = divmod(n_masked, steps)
    return [base + 1] * rem + [base] * (steps - rem)


def top_k(conf: list[float], k: int) -> list[int]:
    order = sorted(range(len(conf)), key=lambda i: -conf[i])   # stable: ties go to the left slot
    return sorted(order[:k])


def select_dynamic(conf: list[float], quota: int, threshold: float) -> list[int]:
    hi = [i for i, c in enumerate(conf) if c > threshold]
    return hi if len(hi) >= quota else top_k(conf, quota)


@dataclass
class DecoderParams:
    """dInfer's decoders, shared by blockdiff and canvas (their Params extend this)."""
    decoder: str = param("threshold", "threshold | hierarchical | credit (dInfer)", choices=DECODERS)
    low_threshold: float = param(0.62, "hierarchical decoder: dInfer eval guide (with threshold 0.92)")
    credit_alpha: float = param(0.7, "credit decoder α (dInfer default)")
    credit_gamma: float = param(0.2, "credit decoder γ (dInfer default)")
    credit_beta: float = param(0.8, "credit decoder β (dInfer default)")

    @staticmethod
    def check(name: str, p) -> None:
        if p.decoder not in DECODERS:
            raise BadInput(f"{name} decoder must be one of {', '.join(DECODERS)}, got {p.decoder!r}")
        for f in ("low_threshold", "credit_beta"):
            if not 0.0 <= getattr(p, f) <= 1.0:
                raise BadInput(f"{name} {f} must be in [0, 1], got {getattr(p, f)}")
        if p.credit_alpha < 0 or p.credit_gamma < 0:
            raise BadInput(f"{name} credit_alpha and credit_gamma must be >= 0")


class Credit:
    """dInfer's credit decoder: a block's [B, V] credit matrix, decayed by β each later step; a masked row's top-1
    token earns (its probability)^γ; the fill rule reads logits + α·log(1 + credit)."""

    def __init__(self, p: DecoderParams):
        self.alpha, self.gamma, self.beta = p.credit_alpha, p.credit_gamma, p.credit_beta
        self.matrix: torch.Tensor | None = None

    def fuse(self, rows: list[int], logits: torch.Tensor, block_size: int) -> torch.Tensor:
        """`logits` [n, V] of the block's rows `rows` (0..B-1), with their credit added (the credit updated first)."""
        if self.matrix is None:
            self.matrix = torch.zeros(block_size, logits.shape[-1], device=logits.device)
        else:
            self.matrix *= self.beta
        top_p, top_v = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        self.matrix[index, top_v] += top_p ** self.gamma
        return logits + self.alpha * torch.log1p(self.matrix[index])


def select_hierarchical(conf: list[float], slots: list[int], threshold: float, low: float) -> list[int]:
    chosen = {i for i, c in enumerate(conf) if c > threshold}
    run: list[int] = []
    for i in range(len(slots) + 1):
        if run and (i == len(slots) or slots[i] != slots[run[-1]] + 1):
            best = max(run, key=lambda r: conf[r])
            if conf[best] > low:
                chosen.add(best)
            run = []
        if i < len(slots):
            run.append(i)
    chosen.update(top_k(conf, 1))
    return sorted(chosen)

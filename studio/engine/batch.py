"""Batched greedy decoding: B prompts in one stationary batch (I-DLM §3.3) for `ar`, `isd` and `r-isd`.

One KV cache with a batch dimension, one committed length per sequence: ISD accepts a different number
of drafts in every sequence, so sequences advance at their own rates. Every round of every sequence is
one row of a fixed-width forward [B, W], W = 2N-1 (AR is ISD with stride N = 1: one clean row, no MASK
rows, W = 1):
  verify  [pending, d1..d(N-1), M x (N-1)]    the rounds of studio.engine.strategies.isd, unchanged
  cold    [pending, M x (N-1), M x (N-1)]     padded to W; the padding comes last, so under causal
                                             attention no real row sees it, and its outputs are ignored
Sequence b writes row t at slot length[b] + t (a SlotView with [B, T] slots), attends to its committed
slots and its own rows up to t, and commits what batch-1 ISD commits: the pending token and the
accepted drafts, never a MASK row. The rules are the greedy ones (DESIGN §4, temperature 0: accept iff
draft == argmax, else the argmax is the correction), so each sequence goes through the rounds of its
batch-1 run: the same tokens, forwards and acceptance (up to float reduction order; tests check
equality on tiny models of each family).

Prompts are left-padded to one length, so the prefill (which folds in the first cold round, as batch 1
does) reads the same logits rows for every sequence; positions start at 0 at each sequence's first real
token, and pad slots are masked out of every row (a pad row sees only itself, so its values stay finite
and never reach a real row). A finished sequence (EOS or max_new_tokens) stops counting at once and
leaves the batch once a quarter of it is done, so long answers do not drag dead rows along.
`greedy_batch` (AR) is what `train data` generates with.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from studio.engine.kv_cache import SlotView
from studio.engine.model import RowGate
from studio.engine.strategies.isd import ISD
from studio.errors import BadInput

BATCHED = ("ar", "isd", "r-isd")


@dataclass
class SequenceResult:
    """One sequence of a batch, measured as its batch-1 run's footer measures it (DESIGN §2.3)."""
    tokens: list[int] = field(default_factory=list)
    stop_reason: str | None = None                        # eos | max_new_tokens
    forwards: int = 0          # forwards after the prefill while the sequence was live (each batched one counts once)
    accepted: list[int] = field(default_factory=list)     # per draft slot k: drafts accepted there
    verified: list[int] = field(default_factory=list)     # per draft slot k: drafts verified there

    @property
    def tpf(self) -> float:
        return len(self.tokens) / self.forwards if self.forwards else 0.0

    @property
    def accept_rate(self) -> float | None:
        """accepted / verified drafts; None when nothing was verified."""
        return sum(self.accepted) / sum(self.verified) if sum(self.verified) else None

    @property
    def accept_by_pos(self) -> list[float]:
        # slot k is verified only after slot k-1 was accepted: the verified slots are a prefix
        return [a / v for a, v in zip(self.accepted, self.verified) if v]


class _Sequence:
    """One sequence's decoding state -- batch-1 ISD's `pending` and `drafts` -- its committed KV length and its
    result."""

    def __init__(self, n_mask: int, max_new_tokens: int, eos: frozenset[int]):
        self.out = SequenceResult(accepted=[0] * n_mask, verified=[0] * n_mask)
        self.n_mask, self.max_new_tokens, self.eos = n_mask, max_new_tokens, eos
        self.pending = 0                 # the last emitted token: the next round writes its K/V first
        self.drafts: list[int] = []      # proposals the next round verifies ([]: a cold round)
        self.length = 0                  # committed slots, left padding included

    @property
    def live(self) -> bool:
        return self.out.stop_reason is None

    def round_tokens(self, mask_id: int, width: int) -> list[int]:
        rows = [self.pending] + self.drafts + [mask_id] * self.n_mask
        return rows + [mask_id] * (width - len(rows))

    def round_gate(self, gate_clean_rows: bool, width: int) -> list[bool]:
        """LoRA on the MASK rows, on the clean rows too for isd (not r-isd), never on padding."""
        n_clean = 1 + len(self.drafts)
        return [gate_clean_rows] * n_clean + [True] * self.n_mask + [False] * (width - n_clean - self.n_mask)

    def absorb(self, targets: list[int]) -> int:
        """One round's argmax per row (row 0 = the pending token's): verify the drafts, emit, take the MASK
        rows' proposals when every draft was accepted. Returns the rows to commit (pending + accepted)."""
        k = len(self.drafts)
        a = 0
        while a < k and self.drafts[a] == targets[a]:
            a += 1
        for slot in range(min(a + 1, k)):           # the accepted drafts and the rejected one
            self.out.verified[slot] += 1
            self.out.accepted[slot] += slot < a
        self._emit(self.drafts[:a] + [targets[a]])  # + the bonus (all accepted) or the correction
        self.pending = targets[a]
        self.drafts = targets[k + 1:k + 1 + self.n_mask] if a == k else []
        return 1 + a

    def _emit(self, tokens: list[int]) -> None:
        """The stop rules of batch-1 `Output`: up to and including an EOS, at most max_new_tokens."""
        for tok in tokens:
            self.out.tokens.append(tok)
            if tok in self.eos:
                self.out.stop_reason = "eos"
            elif len(self.out.tokens) >= self.max_new_tokens:
                self.out.stop_reason = "max_new_tokens"
            if not self.live:
                return


class _BatchForward:
    """Forwards of a batch over one cache, each sequence writing and reading at its own slots."""

    def __init__(self, model, kv, pad: list[int]):
        self.model, self.kv = model, kv
        self.device = model.lm_head.weight.device
        self.pad = torch.tensor(pad, device=self.device)    # left-padding slots of each batch row

    def select(self, rows: list[int]) -> None:
        """Keep only these batch rows."""
        keep = torch.tensor(rows, device=self.device)
        self.kv.select_batch(keep)
        self.pad = self.pad[keep]

    def __call__(self, tokens: list[list[int]], starts: list[int], gate: list[list[bool]],
                 rows: torch.Tensor | None = None) -> list[list[int]]:
        """The argmax of every row in `rows` (all if None) of one forward: batch row b's `tokens[b]` written at
        slots starts[b].., under causal attention over its own real slots."""
        dev = self.device
        tokens = torch.tensor(tokens, device=dev)
        slots = torch.tensor(starts, device=dev)[:, None] + torch.arange(tokens.shape[1], device=dev)   # [B, T]
        n_visible = max(starts) + tokens.shape[1]
        cols, own = torch.arange(n_visible, device=dev), slots[..., None]
        mask = (cols <= own) & ((cols >= self.pad[:, None, None]) | (cols == own))                     # [B, T, S]
        positions = (slots - self.pad[:, None]).clamp(min=0)
        g = torch.tensor(gate, device=dev)
        logits = self.model.run(tokens, positions, SlotView(self.kv, slots, n_visible), mask[:, None],
                                RowGate(g) if bool(g.any()) else None, rows)
        return logits.argmax(-1).tolist()


@torch.inference_mode()
def decode_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids, stride: int = 1,
                 mask_id: int | None = None, gate_clean_rows: bool = False) -> list[SequenceResult]:
    """Greedy ISD with stride `stride` (1: AR) on every prompt at once; one result per prompt, in order.
    `gate_clean_rows`: the LoRA gate of clean rows (isd: on, r-isd: off; MASK rows are always gated)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("decode_batch needs non-empty prompts")
    if stride > 1 and mask_id is None:
        raise ValueError("ISD rounds (stride > 1) need a MASK token id")
    n_mask, width = stride - 1, 2 * stride - 1
    P = max(len(p) for p in prompts)
    seqs = [_Sequence(n_mask, max_new_tokens, frozenset(eos_ids)) for _ in prompts]
    forward = _BatchForward(model, model.new_cache(P + max_new_tokens + width, batch=len(prompts)),
                            [P - len(p) for p in prompts])
    # the prefill is the first cold round: [prompt, M x (N-1)]; the last prompt row and the MASK rows give logits
    targets = forward([[0] * (P - len(p)) + p + [mask_id] * n_mask for p in prompts], [0] * len(prompts),
                      [[False] * (P - len(p)) + [gate_clean_rows] * len(p) + [True] * n_mask for p in prompts],
                      rows=torch.arange(P - 1, P + n_mask, device=forward.device))
    for s, t in zip(seqs, targets):
        s.absorb(t)
        s.length = P
    rows = list(range(len(prompts)))       # the sequence in each batch row
    while True:
        live = [seqs[i].live for i in rows]
        if not any(live):
            break
        if live.count(False) * 4 >= len(rows):
            keep = [j for j, alive in enumerate(live) if alive]
            forward.select(keep)
            rows = [rows[j] for j in keep]
        batch = [seqs[i] for i in rows]
        targets = forward([s.round_tokens(mask_id, width) for s in batch], [s.length for s in batch],
                          [s.round_gate(gate_clean_rows, width) for s in batch])
        for s, t in zip(batch, targets):
            if s.live:
                s.out.forwards += 1
                kept = s.absorb(t)
                if s.live:    # a finished row runs on until compaction: its frozen length keeps its writes in the cache
                    s.length += kept
    return [s.out for s in seqs]


def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids) -> list[list[int]]:
    """Greedy AR continuations of `prompts` (each up to and including its first EOS, or max_new_tokens)."""
    return [r.tokens for r in decode_batch(model, prompts, max_new_tokens, eos_ids)]


def round_shape(strategy, sampling) -> tuple[int, bool]:
    """(stride, gate_clean_rows) of `strategy`'s batched rounds. BadInput unless it is ar, isd or r-isd at
    temperature 0 (the equality with batch 1 is a greedy guarantee; sampled batches are not offered)."""
    if strategy.name not in BATCHED:
        raise BadInput(f"batched decoding supports {', '.join(BATCHED)}, not {strategy.name!r}")
    if not sampling.greedy:
        raise BadInput(f"batched decoding is greedy only: temperature must be 0, got {sampling.temperature:g}")
    return (strategy.params.stride, strategy.gate_clean_rows) if isinstance(strategy, ISD) else (1, False)


def decode_strategy_batch(engine, strategy, sampling, prompts: list[list[int]],
                          max_new_tokens: int) -> list[SequenceResult]:
    """`strategy` (ar, isd, r-isd; greedy) on `prompts` in one stationary batch, with the adapter that strategy
    runs with (`Engine.for_strategy`)."""
    stride, gate_clean_rows = round_shape(strategy, sampling)
    engine = engine.for_strategy(strategy.name)
    engine.activate()
    return decode_batch(engine.model, prompts, max_new_tokens, engine.eos_ids(), stride,
                        engine.config.mask_token_id, gate_clean_rows)

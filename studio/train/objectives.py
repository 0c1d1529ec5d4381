"""The training objectives: batches of noisy rows and their loss (see layout.py).

`IDLM` (the I-DLM paper, §3.1 and appendix E): noisy blocks of b MASKs, causal, logit shift: the MASK at position
s+j (j < b) sees x_0[:s] and the block's earlier MASKs and predicts x_0[s+j+1] -- exactly what ISD's
MASK rows read at inference (the first MASK sits right after the last clean token). b follows the
stride curriculum N = 2 -> 3 -> 4 (b = N - 1).
`Block` (SDAR-style block diffusion): a block of B slots at s, a random subset of them masked (ratio
t ~ U(0, 1]), bidirectional inside; right-shifted for an AR model (slot 0 is the filled AR token, row
j-1 predicts slot j) or position-aligned (row j predicts slot j), as `blockdiff` reads the model.
Both run over a clean pass (two passes, `TwoPassKV`).

Gate `mask`: LoRA on MASK rows only (R-ISD; the clean pass is the base model, run without gradient).
Gate `all`: LoRA on every row (the I-DLM recipe), the clean pass trained too, with the clean
next-token loss auto-balanced against the masked loss (Eq. 2: L = L_mask + (L_mask / L_clean)sg · L_clean).

`MDM` (masked diffusion, Dream's recipe on an AR model): one bidirectional pass over [prompt | answer with a share t
of its tokens MASKed], the logit shift kept (hidden i-1 predicts token i), the loss on the MASKed tokens only,
each weighted 1/t (docs/training.md says why). The LoRA is on every row: the adapter makes a bidirectional model,
which `canvas` decodes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from studio.train.data import Sequence
from studio.train.layout import block_positions, noisy_rows_mask

IGNORE = -100


class TwoPassKV:
    """Stands in for the KV cache in training forwards: the clean pass records each layer's K/V; the
    noisy pass attends to [clean K/V | its own rows] (torch.cat keeps both differentiable)."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.length = 0
        self.recording = True

    def begin(self, n_new: int) -> None:
        pass

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.recording:
            self.k[layer], self.v[layer] = k, v
            return k, v
        return torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)


class OnDevice:
    """A dataclass of tensors that moves to a device as a whole."""

    def to(self, device):
        return type(self)(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


@dataclass
class Batch(OnDevice):
    clean: torch.Tensor          # [B, L] right-padded token ids
    clean_targets: torch.Tensor  # [B, L] next token of each answer row, IGNORE elsewhere
    noisy: torch.Tensor          # [B, R] noisy-row token ids (MASK or filled)
    positions: torch.Tensor      # [B, R]
    mask: torch.Tensor           # [B, R, L + R]
    gate: torch.Tensor           # [B, R] LoRA on
    targets: torch.Tensor        # [B, R] IGNORE where a row predicts nothing
    slot: torch.Tensor           # [B, R] 1-based draft slot of each target (accuracy by slot), 0 = none
    source: torch.Tensor         # [B, R] the clean row predicting each target's position (its soft target), 0 = none


@dataclass
class Losses:
    total: torch.Tensor
    task: float
    clean: float | None
    correct: torch.Tensor        # [n_slots] greedy hits by slot
    counted: torch.Tensor        # [n_slots]


CLEAN_LOSSES = ("ce", "kl")
MASK_LOSSES = ("ce", "kl")


class Objective:
    gate_all: bool
    clean_loss = "ce"            # gate all: ce (I-DLM Eq. 2, the clean tokens) | kl (the base model's law)
    mask_id: int
    bidirectional = False        # noisy rows see their whole block (block diffusion) or a causal prefix (I-DLM)
    trained_attention: str | None = None   # the attention the adapter declares (None: the base model's own)

    def block_width(self, progress: float) -> int:
        raise NotImplementedError

    def n_slots(self) -> int:
        """How many slots the accuracy-by-slot report has."""
        raise NotImplementedError

    def rows(self, seq: Sequence, n_blocks: int, width: int, gen: torch.Generator):
        """(starts, tokens, targets, slots, sources) of one sequence's noisy rows: a target's source is the clean
        row whose next-token law is its soft target (the row before the target's position)."""
        raise NotImplementedError

    def min_answer(self) -> int:
        raise NotImplementedError

    def make_batch(self, seqs: list[Sequence], rows_per_seq: int, progress: float, gen: torch.Generator) -> Batch:
        width = self.block_width(progress)
        n_blocks = max(1, rows_per_seq // width)
        L = max(len(s.tokens) for s in seqs)
        clean = torch.zeros(len(seqs), L, dtype=torch.long)
        clean_t = torch.full((len(seqs), L), IGNORE, dtype=torch.long)
        parts = []
        for i, s in enumerate(seqs):
            clean[i, :len(s.tokens)] = torch.tensor(s.tokens)
            clean_t[i, s.prompt_len - 1:len(s.tokens) - 1] = torch.tensor(s.tokens[s.prompt_len:])
            parts.append(self.rows(s, n_blocks, width, gen))
        starts = [p[0] for p in parts]
        noisy = torch.stack([p[1] for p in parts])
        mask = torch.stack([noisy_rows_mask(st, width, L, self.bidirectional) for st in starts])
        gate = torch.ones_like(noisy, dtype=torch.bool) if self.gate_all else noisy == self.mask_id
        return Batch(clean, clean_t, noisy, torch.stack([block_positions(st, width) for st in starts]), mask,
                     gate, *(torch.stack([p[k] for p in parts]) for k in (2, 3, 4)))

    def loss(self, model, batch: Batch, n_slots: int) -> Losses:
        kv = TwoPassKV()
        batch = batch.to(model.lm_head.weight.device)
        B, L = batch.clean.shape
        pos = torch.arange(L, device=batch.clean.device)[None].expand(B, L)
        clean_loss = soft = None
        sources = sorted(set(batch.source[batch.targets != IGNORE].tolist())) if self.mask_loss == "kl" else [0]
        if self.gate_all:
            logits = model(batch.clean, pos, kv, lora_gate=torch.ones_like(batch.clean, dtype=torch.bool))
            clean_loss = self._clean_loss(model, batch, pos, logits)
            if self.mask_loss == "kl":
                with torch.no_grad():   # the base model (no LoRA) at the target rows' sources
                    soft = model(batch.clean, pos, TwoPassKV(), logits_rows=sources)
        else:
            with torch.no_grad():   # the base model: its K/V are constants of this step
                soft = model(batch.clean, pos, kv, logits_rows=sources)
        kv.recording = False
        logits = model(batch.noisy, batch.positions, kv, mask=batch.mask[:, None], lora_gate=batch.gate)
        if self.mask_loss == "kl":
            task = _soft_target_kl(logits, batch, soft, sources)
        else:
            task = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)
        total = task
        if clean_loss is not None:
            total = task + (task.detach() / (clean_loss.detach() + 1e-8)) * clean_loss
        correct, counted = hits_by_slot(logits, batch.targets, batch.slot, n_slots)
        return Losses(total, float(task.detach()), None if clean_loss is None else float(clean_loss.detach()),
                      correct, counted)

    def _clean_loss(self, model, batch: Batch, pos: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The clean rows' loss under --gate all. ce: cross-entropy on the clean tokens (the I-DLM recipe).
        kl: KL(base || adapted) on the answer rows, so the adapter keeps the base model's whole next-token law
        there, near-ties included: ISD then decodes (nearly) what the base model decodes."""
        if self.clean_loss == "ce":
            return F.cross_entropy(logits.flatten(0, 1), batch.clean_targets.flatten(), ignore_index=IGNORE)
        rows = batch.clean_targets != IGNORE
        with torch.no_grad():   # the base model (no LoRA) on the same rows; its K/V go nowhere
            base = model(batch.clean, pos, TwoPassKV())[rows]
        return F.kl_div(F.log_softmax(logits[rows].float(), -1), F.log_softmax(base.float(), -1), log_target=True,
                        reduction="batchmean")


def _soft_target_kl(logits: torch.Tensor, batch: Batch, base: torch.Tensor, sources: list[int]) -> torch.Tensor:
    """KL(base law at each target's source row || the noisy row's law), averaged over the target rows: the MASK row
    learns the base model's whole next-token distribution at its position, not only the argmax the data holds
    (on greedy self-distilled data the two argmaxes agree)."""
    rows = batch.targets != IGNORE
    where = torch.zeros(int(batch.source.max()) + 1, dtype=torch.long, device=logits.device)
    where[torch.tensor(sources, device=logits.device)] = torch.arange(len(sources), device=logits.device)
    b = torch.arange(len(logits), device=logits.device)[:, None].expand_as(rows)[rows]
    target = base[b, where[batch.source[rows]]]
    return F.kl_div(F.log_softmax(logits[rows].float(), -1), F.log_softmax(target.float(), -1), log_target=True,
                    reduction="batchmean")


def hits_by_slot(logits: torch.Tensor, targets: torch.Tensor, slot: torch.Tensor, n_slots: int):
    """(greedy hits, target rows) per slot 1..n_slots: the accuracy-by-slot report of a step."""
    with torch.no_grad():
        hit = ((logits.argmax(-1) == targets) & (targets != IGNORE)).cpu()
        slot = slot.clamp(max=n_slots).cpu()
        rows = (targets != IGNORE).cpu()
        correct = torch.zeros(n_slots + 1).index_add_(0, slot.flatten(), hit.flatten().float())[1:]
        counted = torch.zeros(n_slots + 1).index_add_(0, slot.flatten(), rows.flatten().float())[1:]
    return correct, counted


def _starts(lo: int, hi: int, k: int, gen: torch.Generator) -> list[int]:
    """k block starts in [lo, hi] (distinct while the range allows, then with repeats), sorted."""
    n = hi - lo + 1
    if n >= k:
        picks = torch.randperm(n, generator=gen)[:k]
    else:
        picks = torch.randint(n, (k,), generator=gen)
    return sorted((picks + lo).tolist())


class IDLM(Objective):
    def __init__(self, mask_id: int, gate_all: bool, curriculum: tuple[int, ...] = (2, 3, 4), clean_loss: str = "ce",
                 mask_loss: str = "ce"):
        self.mask_id, self.gate_all, self.curriculum, self.clean_loss = mask_id, gate_all, curriculum, clean_loss
        self.mask_loss = mask_loss

    def block_width(self, progress: float) -> int:
        stage = min(int(progress * len(self.curriculum)), len(self.curriculum) - 1)
        return self.curriculum[stage] - 1          # b = N - 1 MASKs

    def min_answer(self) -> int:
        return max(self.curriculum) + 1

    def n_slots(self) -> int:
        return max(self.curriculum) - 1

    def rows(self, seq, n_blocks, width, gen):
        toks = seq.tokens
        starts = _starts(seq.prompt_len, len(toks) - 1 - width, n_blocks, gen)
        targets = torch.tensor([toks[s + j + 1] for s in starts for j in range(width)])
        slots = torch.arange(1, width + 1).repeat(len(starts))
        sources = torch.tensor([s + j for s in starts for j in range(width)])
        return starts, torch.full((len(starts) * width,), self.mask_id, dtype=torch.long), targets, slots, sources


class Block(Objective):
    bidirectional = True

    def __init__(self, mask_id: int, gate_all: bool, block_size: int, shift: bool, clean_loss: str = "ce",
                 mask_loss: str = "ce"):
        self.mask_id, self.gate_all, self.size, self.shift = mask_id, gate_all, block_size, shift
        self.clean_loss, self.mask_loss = clean_loss, mask_loss

    def block_width(self, progress: float) -> int:
        return self.size

    def min_answer(self) -> int:
        return self.size + 1

    def n_slots(self) -> int:
        return self.size

    def rows(self, seq, n_blocks, width, gen):
        toks = seq.tokens
        starts = _starts(seq.prompt_len, len(toks) - width, n_blocks, gen)
        first = 1 if self.shift else 0          # right-shifted: slot 0 is the filled AR token
        tokens, targets, slots, sources = [], [], [], []
        for s in starts:
            block = toks[s:s + width]
            ratio = 1.0 - float(torch.rand((), generator=gen))          # t in (0, 1]
            masked = (torch.rand(width, generator=gen) < ratio).tolist()
            masked[:first] = [False] * first
            if not any(masked):
                masked[first + int(torch.randint(width - first, (), generator=gen))] = True
            tokens += [self.mask_id if m else t for m, t in zip(masked, block)]
            row_t = [IGNORE] * width
            row_slot = [0] * width
            row_source = [0] * width
            for j in range(first, width):
                if masked[j]:
                    row = j - 1 if self.shift else j
                    row_t[row], row_slot[row], row_source[row] = block[j], j + 1 - first, s + j - 1
            targets += row_t
            slots += row_slot
            sources += row_source
        return starts, torch.tensor(tokens), torch.tensor(targets), torch.tensor(slots), torch.tensor(sources)



T_QUARTERS = 4   # MDM reports its accuracy by the quarter of (0, 1] the mask ratio t falls in


@dataclass
class CanvasBatch(OnDevice):
    tokens: torch.Tensor         # [B, L] prompt | answer (EOS padding included) with a share t of it MASKed
    keys: torch.Tensor           # [B, L] the columns a row attends to (a truncated answer's batch padding is not one)
    targets: torch.Tensor        # [B, L] on the row that predicts a MASKed position (i-1, shifted): its token
    weights: torch.Tensor        # [B, L] 1/t on target rows, 0 elsewhere
    slot: torch.Tensor           # [B, L] the quarter of (0, 1] t falls in, 1..4 (accuracy by noise level), 0 = none
    n_answer: torch.Tensor       # [] answer positions in the batch (EOS padding included): the loss's denominator


class MDM(Objective):
    """Masked diffusion on an AR model (Dream's recipe): every answer position of a sequence is MASKed with the same
    probability t (drawn per sequence, stratified over the batch: t_b = eps + (1 - eps)((u + b/B) mod 1)), the
    sequence [prompt | masked answer] is read with bidirectional attention, and

        loss = sum over MASKed positions i of CE(row predicting i, x_i) / t, divided by the batch's answer positions

    (LLaDA's SFT loss: an unbiased estimate of the masked-diffusion bound per answer token). An answer that ended
    with an EOS is padded with that EOS up to the batch's longest sequence, and the padding is part of the answer
    (masked and predicted too), so the model learns to close a canvas longer than its answer with EOS, as `canvas`
    asks it to; an answer cut at the data's token limit is not padded (its canvas ended mid-text)."""
    gate_all = True
    trained_attention = "bidirectional"

    def __init__(self, mask_id: int, eos_ids, shift: bool = True, eps: float = 1e-3):
        self.mask_id, self.eos_ids, self.shift, self.eps = mask_id, set(eos_ids), shift, eps

    def block_width(self, progress: float) -> int:
        return 0   # no blocks: the whole answer is the canvas

    def min_answer(self) -> int:
        return 1

    def n_slots(self) -> int:
        return T_QUARTERS

    def mask_ratios(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """n mask ratios in (eps, 1], one per sequence, stratified: one uniform draw spread evenly over (0, 1)
        (lower variance than n independent draws, the same distribution for each)."""
        u = (torch.rand((), generator=gen) + torch.arange(n) / n) % 1.0
        return self.eps + (1 - self.eps) * (1 - u)

    def make_batch(self, seqs: list[Sequence], rows_per_seq: int, progress: float,
                   gen: torch.Generator) -> CanvasBatch:
        B, L = len(seqs), max(len(s.tokens) for s in seqs)
        t = self.mask_ratios(B, gen)
        tokens = torch.zeros(B, L, dtype=torch.long)
        keys = torch.zeros(B, L, dtype=torch.bool)
        targets = torch.full((B, L), IGNORE, dtype=torch.long)
        weights = torch.zeros(B, L)
        slot = torch.zeros(B, L, dtype=torch.long)
        n_answer = 0
        for b, s in enumerate(seqs):
            toks = s.tokens + [s.tokens[-1]] * (L - len(s.tokens)) if s.tokens[-1] in self.eos_ids else s.tokens
            n, P = len(toks), s.prompt_len
            answer = torch.tensor(toks[P:])
            masked = torch.rand(n - P, generator=gen) < t[b]
            tokens[b, :n] = torch.tensor(toks)
            tokens[b, P:n] = torch.where(masked, self.mask_id, answer)
            keys[b, :n] = True
            rows = torch.arange(P, n)[masked] - (1 if self.shift else 0)
            targets[b, rows] = answer[masked]
            weights[b, rows] = 1.0 / t[b]
            slot[b, rows] = 1 + min(T_QUARTERS - 1, int(t[b] * T_QUARTERS))
            n_answer += n - P
        return CanvasBatch(tokens, keys, targets, weights, slot, torch.tensor(float(n_answer)))

    def loss(self, model, batch: CanvasBatch, n_slots: int) -> Losses:
        batch = batch.to(model.lm_head.weight.device)
        B, L = batch.tokens.shape
        rows = (batch.targets != IGNORE).any(0).nonzero()[:, 0]   # the head runs on rows some sequence predicts
        positions = torch.arange(L, device=batch.tokens.device)[None].expand(B, L)
        attend = batch.keys[:, None, None, :].expand(B, 1, L, L)   # every row sees every real column
        logits = model(batch.tokens, positions, TwoPassKV(), mask=attend,   # (a recording TwoPassKV: no cache)
                       lora_gate=torch.ones_like(batch.keys), logits_rows=rows)
        targets, weights = batch.targets[:, rows], batch.weights[:, rows]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
        task = (ce * weights.flatten()).sum() / batch.n_answer.clamp(min=1)
        correct, counted = hits_by_slot(logits, targets, batch.slot[:, rows], n_slots)
        return Losses(task, float(task.detach()), None, correct, counted)

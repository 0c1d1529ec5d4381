"""Batched greedy decoding: B prompts in one stationary batch for `ar`, `isd` and `r-isd`.

One KV cache with a batch dimension, one committed length per sequence: ISD accepts a different number
of drafts in every sequence, so sequences advance at their own rates. Every round of every sequence is
one row of a fixed-width forward [B, W], W = 2N-1 (AR is ISD with stride N = 1: one clean row, no MASK
rows, W = 1):
  verify  [pending, d1..d(N-1), M x (N-1)]    the rounds of studio.engine.strategies.isd, unchanged
  cold    [pending, M x (N-1), M x (N-1)]     padded to W; the padding comes last, so under causal
                                             attention no real row sees it, and its outputs are ignored
Sequence b writes row t at slot length[b] + t (a SlotView with [B, T] slots), attends to its committed
slots and its own rows up to t, and commits what batch-1 ISD commits: the pending token and the
accepted drafts, never a MASK row. The rules are the greedy ones (docs/verification.md, temperature 0:
accept iff draft == argmax, else the argmax is the correction), so each sequence goes through the rounds
of its batch-1 run: the same tokens, forwards and acceptance (up to float reduction order; tests check
equality on tiny models of each family).

Prompts are left-padded to one length, so the prefill (which folds in the first cold round, as batch 1
does) reads the same logits rows for every sequence; positions start at 0 at each sequence's first real
token, and pad slots are masked out of every row (a pad row sees only itself, so its values stay finite
and never reach a real row). A finished sequence (EOS or max_new_tokens) stops at once and leaves the
batch once a quarter of it is done, so long answers do not drag dead rows along.

Every sequence records the events of its batch-1 run (docs/events.md): the same kinds in the same order
within a step, with the same step, pos, tok, role, n_tokens (its own tokens, not its row's padding),
lora_rows, kv lengths (its own, not counting the left padding), greedy p and q (an accepted draft has
p = 1, the rejected one p = 0; q = 1, the drafts being argmaxes) and emit texts (batch-1's `Output`
makes them, with its stop rules). Two fields differ because the sequences share their forwards: `ms` is
the batch's clock (time since the batch's prefill began) and a forward's `wall_ms` is that of the whole
batched forward. A result's footer is computed from its events by studio.events.metrics, as every
run's is, so TPF and acceptance are counted one way everywhere; its timings are on the batch's clock.
`greedy_batch` (AR, token ids only) is what `train data` generates with.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from studio import events as ev
from studio.engine.kv_cache import SlotView
from studio.engine.gated_lora import RowGate
from studio.engine.strategies.base import Output, entropy
from studio.engine.strategies.isd import ISD, expected_tpf
from studio.errors import BadInput

BATCHED = ("ar", "isd", "r-isd")
PRIOR_ACCEPTANCE = 0.5   # what the cost-aware planner expects of a draft slot before any verdict (drafting.py)

Row = tuple[list[int], list[bool]]     # one sequence's tokens in a batched forward, and their LoRA gate
_Rows = tuple[list[int], list[float]]  # what a forward gives one sequence: each row's argmax and entropy


@dataclass
class SequenceResult:
    """One sequence of a batch, as a `RunResult` without a header: the events its batch-1 run records, the
    footer `studio.events.metrics` computes from them (timings on the batch's clock), and its tokens."""
    events: list[dict]
    footer: dict
    token_ids: list[int]


class _IdsOnly:
    """The tokenizer of a batch whose caller wants token ids only (`greedy_batch`): no round decodes any text,
    and the emit events carry empty texts."""

    @staticmethod
    def decode(ids) -> str:
        return ""

    @staticmethod
    def token_text(token_id: int) -> str:
        return ""


def _has_adapter(model) -> bool:
    # as batch 1 counts them, a forward's lora_rows are its gated rows when an adapter is attached, else 0
    return any(getattr(m, "lora_A", None) is not None for m in model.modules())


class _Sequence:
    """One sequence: batch-1 ISD's decoding state (`pending`, `drafts`), its output under batch-1's stop rules,
    its slots in the batch's cache, and the events its batch-1 run would record."""

    def __init__(self, prompt: list[int], output: Output, tokenizer, n_mask: int, gate_clean_rows: bool,
                 pad: int, lora: bool, clock: Callable[[], float]):
        self.prompt, self.out, self.tokenizer = prompt, output, tokenizer
        self.n_mask, self.gate_clean_rows, self.lora, self.clock = n_mask, gate_clean_rows, lora, clock
        self.pad = pad                   # left-padding slots before the prompt
        self.length = pad                # committed slots, left padding included
        self.pending = 0                 # the last emitted token: the next round writes its K/V first
        self.drafts: list[int] = []      # proposals the next round verifies ([]: a cold round)
        self.step = 0                    # forwards after the prefill: batch-1's step numbers
        self.events: list[dict] = []

    @property
    def live(self) -> bool:
        return not self.out.finished

    # -- rows -----------------------------------------------------------------------------------------------
    def prefill_row(self, mask_id: int | None) -> Row:
        """[padding, prompt, M x (N-1)]: the prefill with the first cold round folded in."""
        return [0] * self.pad + self.prompt + [mask_id] * self.n_mask, self._gate(self.pad, len(self.prompt))

    def round_row(self, mask_id: int | None, width: int) -> Row:
        """[pending, drafts, M x (N-1), padding to `width`]."""
        tokens = [self.pending] + self.drafts + [mask_id] * self.n_mask
        return tokens + [mask_id] * (width - len(tokens)), self._gate(0, 1 + len(self.drafts), width)

    def _gate(self, left: int, n_clean: int, width: int = 0) -> list[bool]:
        """LoRA on the MASK rows, on the clean rows as `gate_clean_rows` says, never on padding."""
        gate = [False] * left + [self.gate_clean_rows] * n_clean + [True] * self.n_mask
        return gate + [False] * (width - len(gate))

    # -- what a forward's row gives -------------------------------------------------------------------------
    def take_prefill(self, rows: "_Rows", gate: list[bool], wall_ms: float) -> None:
        """The argmax of the last prompt row and of the MASK rows."""
        self._forwarded("prefill", len(self.prompt), gate, wall_ms)
        self._absorb(rows, clean=len(self.prompt))

    def take_round(self, rows: "_Rows", gate: list[bool], wall_ms: float) -> None:
        """The argmax (and entropy) of every row of this sequence's round."""
        self.step += 1
        role = "verify" if self.drafts else "cold" if self.n_mask else "extend"
        self._forwarded(role, 1 + len(self.drafts), gate, wall_ms)
        self._absorb(rows, clean=1)

    def _forwarded(self, role: str, n_clean: int, gate: list[bool], wall_ms: float) -> None:
        self._event("forward", role=role, n_tokens=n_clean + self.n_mask,
                    lora_rows=sum(gate) if self.lora else 0, wall_ms=wall_ms)

    def _absorb(self, rows: "_Rows", clean: int) -> None:
        """Batch-1 ISD's round on this row's argmaxes (targets[0]: the last clean row's, then the drafts' and
        the MASK rows'): verify the drafts, commit the `clean` rows and the accepted drafts, take the MASK rows'
        proposals when every draft was accepted, emit the accepted drafts + the bonus or the correction. Each
        verdict carries the target's entropy at its row (`h`), as batch 1's do."""
        targets, h = rows
        k, n = len(self.drafts), len(self.out.token_ids)    # n: the output position of the first draft
        a = 0
        while a < k and self.drafts[a] == targets[a]:
            a += 1
        if a:
            self._event("accept", pos=list(range(n, n + a)), tok=self.drafts[:a], p=[1.0] * a, q=[1.0] * a,
                        h=h[:a])
        if a < k:
            self._event("reject", pos=n + a, tok=self.drafts[a], p=0.0, q=1.0, h=h[a])
            self._event("resample", pos=n + a, tok=targets[a])
        kv_len = self.length - self.pad
        self._event("kv", op="commit", from_len=kv_len, to_len=kv_len + clean + a)
        emitted = self.drafts[:a] + [targets[a]]
        self.pending, self.drafts = targets[a], []
        if a == k:
            if k:
                self._event("bonus", pos=n + k, tok=targets[k])
            if self.n_mask:
                self.drafts = targets[k + 1:k + 1 + self.n_mask]
                self._event("propose", pos=list(range(n + k + 1, n + k + 1 + self.n_mask)), tok=self.drafts,
                            q=[1.0] * self.n_mask, src="mask")
        self._emit(emitted)
        if self.live:    # a finished row runs on until compaction: its frozen length keeps its writes in the cache
            self.length += clean + a

    def _emit(self, tokens: list[int]) -> None:
        """What batch-1's `DecodeContext.emit` records: the tokens the stop rules take, and their text."""
        start = len(self.out.token_ids)
        taken, text = self.out.append(tokens)
        self._event("emit", pos=list(range(start, start + len(taken))), tok=taken, text=text,
                    pieces=[self.tokenizer.token_text(t) for t in taken])

    def _event(self, kind: str, **fields) -> None:
        self.events.append(ev.make(kind, self.step, self.clock(), **fields))

    def result(self) -> SequenceResult:
        """The events, and the footer batch 1 would write (timings from the events' batch clock)."""
        tally = ev.Tally().feed_all(self.events)
        prefill_ms = max(e["ms"] for e in self.events if e["step"] == 0)
        footer = dict(tally.footer(), stop_reason=self.out.stop_reason, prefill_s=prefill_ms / 1000,
                      wall_s=self.events[-1]["ms"] / 1000, tok_s=tally.decode_rate() or 0.0)
        return SequenceResult(self.events, footer, list(self.out.token_ids))


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

    def join(self, other: "_BatchForward", max_len: int) -> None:
        """Append `other`'s batch rows (their cache and padding) after this one's, every row now `max_len` slots."""
        self.kv = type(self.kv).stacked([self.kv, other.kv], max_len)
        self.pad = torch.cat([self.pad, other.pad])

    def __call__(self, batch: list[Row], starts: list[int],
                 rows: torch.Tensor | None = None) -> tuple[list[_Rows], float]:
        """The argmax and entropy of every row in `rows` (all if None) of one forward, per batch row, and its
        wall time in ms: batch row b's tokens written at slots starts[b].., under causal attention over its own
        real slots."""
        t = time.perf_counter()
        dev = self.device
        tokens = torch.tensor([tokens for tokens, _ in batch], device=dev)
        slots = torch.tensor(starts, device=dev)[:, None] + torch.arange(tokens.shape[1], device=dev)   # [B, T]
        n_visible = max(starts) + tokens.shape[1]
        cols, own = torch.arange(n_visible, device=dev), slots[..., None]
        mask = (cols <= own) & ((cols >= self.pad[:, None, None]) | (cols == own))                     # [B, T, S]
        positions = (slots - self.pad[:, None]).clamp(min=0)
        g = torch.tensor([gate for _, gate in batch], device=dev)
        logits = self.model.run(tokens, positions, SlotView(self.kv, slots, n_visible), mask[:, None],
                                RowGate(g) if bool(g.any()) else None, rows)
        targets = logits.argmax(-1).tolist()      # waits for the device: the wall time is the forward's
        wall_ms = (time.perf_counter() - t) * 1000.0
        entropies = [entropy(row) for row in logits]
        return list(zip(targets, entropies)), wall_ms


@torch.inference_mode()
def decode_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids, stride: int = 1,
                 mask_id: int | None = None, gate_clean_rows: bool = False, tokenizer=None) -> list[SequenceResult]:
    """Greedy ISD with stride `stride` (1: AR) on every prompt at once; one result per prompt, in order.
    `gate_clean_rows`: the LoRA gate of clean rows (`Strategy.clean_gate`; MASK rows are always gated).
    `tokenizer`: what the emit events' texts are decoded with (None: token ids only, empty texts)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("decode_batch needs non-empty prompts")
    if stride > 1 and mask_id is None:
        raise ValueError("ISD rounds (stride > 1) need a MASK token id")
    n_mask, width = stride - 1, 2 * stride - 1
    P = max(len(p) for p in prompts)
    forward = _BatchForward(model, model.new_cache(P + max_new_tokens + width, batch=len(prompts)),
                            [P - len(p) for p in prompts])
    text, lora, eos = tokenizer or _IdsOnly(), _has_adapter(model), frozenset(eos_ids)
    start = time.perf_counter()

    def clock() -> float:
        return (time.perf_counter() - start) * 1000.0
    seqs = [_Sequence(p, Output(text, max_new_tokens, eos), text, n_mask, gate_clean_rows, P - len(p), lora, clock)
            for p in prompts]
    # the last prompt row and the MASK rows give logits
    batch = [s.prefill_row(mask_id) for s in seqs]
    outs, wall_ms = forward(batch, [0] * len(seqs), rows=torch.arange(P - 1, P + n_mask, device=forward.device))
    for s, t, (_, gate) in zip(seqs, outs, batch):
        s.take_prefill(t, gate, wall_ms)
    rows = list(range(len(prompts)))       # the sequence in each batch row
    while True:
        live = [seqs[i].live for i in rows]
        if not any(live):
            break
        if live.count(False) * 4 >= len(rows):
            keep = [j for j, alive in enumerate(live) if alive]
            forward.select(keep)
            rows = [rows[j] for j in keep]
        running = [seqs[i] for i in rows]
        batch = [s.round_row(mask_id, width) for s in running]
        outs, wall_ms = forward(batch, [s.length for s in running])
        for s, t, (_, gate) in zip(running, outs, batch):
            if s.live:
                s.take_round(t, gate, wall_ms)
    return [s.result() for s in seqs]


def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids) -> list[list[int]]:
    """Greedy AR continuations of `prompts` (each up to and including its first EOS, or max_new_tokens)."""
    return [r.token_ids for r in decode_batch(model, prompts, max_new_tokens, eos_ids)]


def unbatchable(strategy, sampling) -> str | None:
    """Why `strategy` cannot decode in a batch, or None: batches run ar, isd and r-isd, greedy (the equality with
    batch 1 is a greedy guarantee) and lossless (exact acceptance: a relaxed rule's output depends on the draft)."""
    if strategy.name not in BATCHED:
        return f"batched decoding supports {', '.join(BATCHED)}, not {strategy.name!r}"
    if not sampling.greedy:
        return f"batched decoding is greedy only: temperature must be 0, got {sampling.temperature:g}"
    if not strategy.lossless():
        return "batched decoding verifies exactly: tau must be 0 and mode 'exact'"
    return None


def round_shape(strategy, sampling) -> int:
    """The stride of `strategy`'s batched rounds (ar: 1); BadInput when it cannot batch (`unbatchable`). A batch
    drafts every round in full from its MASK rows, as batch 1 does with `drafting="fixed"` and `lookup=0`: each row
    of a stationary batch pays the batch's width whatever it drafts, so a per-sequence plan would save nothing."""
    if why := unbatchable(strategy, sampling):
        raise BadInput(why)
    return strategy.params.stride if isinstance(strategy, ISD) else 1


def batch_stride(strategy, sampling, costs, batch: int, gate_clean_rows: bool) -> int:
    """The stride a batch of up to `batch` sequences decodes `strategy` with, decided when the batch starts: its own
    (`round_shape`) where a full round pays for its rows by the cost table `costs` at the planner's prior acceptance
    (`expected_tpf` tokens a sequence for batch x (2N-1) rows, against one for `batch` rows), else 1: AR rounds of
    the model the strategy decodes, which give its greedy tokens (it is lossless) at a fraction of the rows. On a
    2-core CPU a forward's cost grows with its rows, so drafts do not pay there even at batch 1; on a GPU far from
    its compute they do. The batch is judged at the most sequences whose full round the table measured (16 rows: 2
    of stride 4), never on rows it extrapolates. `costs` None: no table to judge by, the strategy's stride."""
    stride = round_shape(strategy, sampling)
    if stride == 1 or costs is None:
        return stride
    width = 2 * stride - 1
    b = max(1, min(batch, costs.max_rows // width))
    full = costs.forward_ms(b * width, gated=b * (stride - 1 + (stride if gate_clean_rows else 0)))
    ar = costs.forward_ms(b, gated=b if gate_clean_rows else 0)
    return stride if full / expected_tpf(PRIOR_ACCEPTANCE, stride) < ar else 1


def decode_strategy_batch(engine, strategy, sampling, prompts: list[list[int]],
                          max_new_tokens: int) -> list[SequenceResult]:
    """`strategy` (ar, isd, r-isd; greedy) on `prompts` in one stationary batch, with the adapter that strategy
    runs with (`Engine.for_strategy`); the events' texts are decoded with the engine's tokenizer, as batch 1's."""
    stride = round_shape(strategy, sampling)
    engine = engine.for_strategy(strategy.name)
    engine.activate()
    return decode_batch(engine.model, prompts, max_new_tokens, engine.eos_ids(), stride,
                        engine.config.mask_token_id, strategy.clean_gate(engine.lora), engine.tokenizer)


class ContinuousBatch:
    """Greedy ISD rounds of stride N (1: AR) for sequences that join and leave between rounds (the server's batch).

    A joining sequence is prefilled alone (its prompt and the first cold round in one forward, as batch-1 ISD and
    `decode_batch` do, with no padding), then its cache row joins the batch's; every round is one [B, 2N-1] forward
    of the sequences still running, each at its own slots; a finished or dropped sequence leaves at once. Each
    sequence goes through its batch-1 rounds, so its tokens are its solo run's, and its events carry its own clock
    (from its join). `engine`: the adapter view the strategy runs with (`Engine.for_strategy`); `stride`: 1 for AR
    rounds of the model `strategy` decodes (`batch_stride`), else None, the strategy's own."""

    def __init__(self, engine, strategy, sampling, stride: int | None = None):
        own = round_shape(strategy, sampling)
        if stride not in (None, 1, own):
            raise ValueError(f"a batch of {strategy.name} runs at stride {own} or 1, not {stride}")
        self.engine, self.stride = engine, own if stride is None else stride
        self.n_mask, self.width = self.stride - 1, 2 * self.stride - 1
        self.gate_clean_rows = strategy.clean_gate(engine.lora)
        self.mask_id, self.eos = engine.config.mask_token_id, frozenset(engine.eos_ids())
        self.lora = _has_adapter(engine.model)
        self.sequences: list[_Sequence] = []
        self._forward: _BatchForward | None = None
        self._max_len = 0

    @torch.inference_mode()
    def join(self, prompt: list[int], max_new_tokens: int, stop: tuple[str, ...] = ()) -> _Sequence:
        """Prefill a sequence and add it to the batch unless its prefill already finished it."""
        self.engine.activate()
        start, need = time.perf_counter(), len(prompt) + max_new_tokens + self.width
        tok = self.engine.tokenizer
        seq = _Sequence(prompt, Output(tok, max_new_tokens, self.eos, stop), tok, self.n_mask, self.gate_clean_rows,
                        0, self.lora, lambda: (time.perf_counter() - start) * 1000.0)
        alone = _BatchForward(self.engine.model, self.engine.model.new_cache(need), [0])
        row = seq.prefill_row(self.mask_id)
        outs, wall_ms = alone([row], [0], rows=torch.arange(len(prompt) - 1, len(prompt) + self.n_mask,
                                                              device=alone.device))
        seq.take_prefill(outs[0], row[1], wall_ms)
        if seq.live:
            self._max_len = max(self._max_len, need)
            if self._forward is None:
                self._forward = alone
            else:
                self._forward.join(alone, self._max_len)
            self.sequences.append(seq)
        return seq

    @torch.inference_mode()
    def step(self) -> list[_Sequence]:
        """One round of every sequence; returns those it finished (they have left the batch)."""
        if not self.sequences:
            return []
        self.engine.activate()
        batch = [s.round_row(self.mask_id, self.width) for s in self.sequences]
        outs, wall_ms = self._forward(batch, [s.length for s in self.sequences])
        for s, t, (_, gate) in zip(self.sequences, outs, batch):
            s.take_round(t, gate, wall_ms)
        finished = [s for s in self.sequences if not s.live]
        self._leave(finished)
        return finished

    def drop(self, seq: _Sequence, reason: str) -> None:
        """End a sequence between rounds (its output stops with `reason`)."""
        seq.out.stop_reason = reason
        self._leave([seq])

    def _leave(self, gone: list[_Sequence]) -> None:
        if not gone:
            return
        keep = [i for i, s in enumerate(self.sequences) if s not in gone]
        self.sequences = [self.sequences[i] for i in keep]
        if keep:
            self._forward.select(keep)
        else:
            self._forward, self._max_len = None, 0

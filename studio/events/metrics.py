"""Metrics from events: the one implementation of the definitions in docs/metrics.md. Footers, `run
--json`, the CLI's live line, the TUI and web panels, compare, bench and `train eval` all count here.

- forwards: `forward` events whose role is not "prefill"; TPF = emitted tokens / forwards (0.0 before any).
- acceptance: accepted / verified proposals (an `accept` event counts len(pos), a `reject` one). A step's
  accepted and rejected positions are one chain; a proposal's draft slot is its rank by `pos` in the chain.
  A strategy that verified several independent chains in one forward would need a chain id; none does.
- decode rate: tokens emitted after the prefill step / the time from the prefill's end to the last event,
  on the run's own clock (`ms`, which stops while the run is not advancing, so drawing is never in it).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


def position_slots(positions) -> dict[int, int]:
    """Each verified position's slot in its step: its rank among the step's positions (a chain's drafts in order; a
    draft tree's siblings share a position, and so a slot)."""
    return {p: k for k, p in enumerate(sorted(set(positions)))}


@dataclass
class Acceptance:
    """Acceptance counts by draft slot and by verify step."""
    verified_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    per_verify_step: dict[int, int] = field(default_factory=dict)   # step -> accepted drafts in it
    drafted_per_verify_step: dict[int, int] = field(default_factory=dict)  # step -> verified drafts

    def add_chain(self, step: int, chain: list[tuple[int, bool]]) -> None:
        """One step's verified proposals as (pos, accepted) pairs, in any order; a draft tree's siblings share a
        position, and so a slot."""
        slot = position_slots(p for p, _ in chain)
        for pos, ok in chain:
            k = slot[pos]
            while k >= len(self.verified_by_pos):
                self.verified_by_pos.append(0)
                self.accepted_by_pos.append(0)
            self.verified_by_pos[k] += 1
            self.accepted_by_pos[k] += ok
        self.per_verify_step[step] = sum(ok for _, ok in chain)
        self.drafted_per_verify_step[step] = len(chain)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_by_pos)

    @property
    def verified(self) -> int:
        return sum(self.verified_by_pos)

    @property
    def rate(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def by_pos(self) -> list[float]:
        return [a / v for a, v in zip(self.accepted_by_pos, self.verified_by_pos)]

    @property
    def verify_steps(self) -> int:
        return len(self.per_verify_step)

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / verify steps (the bonus/correction token counted, vLLM convention)."""
        return 1 + self.accepted / self.verify_steps if self.verify_steps else None

    def histogram(self) -> dict[int, int]:
        """{accepted drafts in one verify step: number of verify steps} (AIPerf style), dense from 0."""
        counts = Counter(self.per_verify_step.values())
        top = max(counts, default=-1)
        return {k: counts.get(k, 0) for k in range(top + 1)}


class Tally:
    """The running metrics of one run, fed its events in order (one at a time or whole steps). Counts and
    acceptance by slot may also pool several runs fed one after another (`train eval`); the decode rate is one
    run's."""

    def __init__(self) -> None:
        self.n_tokens = 0
        self.decoded = 0     # tokens emitted after the prefill step (what tok/s counts)
        self.forwards = 0
        self.acceptance = Acceptance()
        self._texts: list[str] = []
        self._step: int | None = None
        self._chain: list[tuple[int, bool]] = []
        self._prefill_end_ms: float | None = None
        self._last_ms: float | None = None

    def feed(self, e: Mapping[str, Any]) -> None:
        if e["step"] != self._step:
            self.end_step()
            self._step = e["step"]
        t = e["t"]
        if t == "emit":
            self.n_tokens += len(e["tok"])
            self.decoded += len(e["tok"]) if e["step"] > 0 else 0
            self._texts.append(e["text"])
        elif t == "forward":
            self.forwards += e["role"] != "prefill"
        elif t == "accept":
            self._chain.extend((p, True) for p in e["pos"])
        elif t == "reject":
            self._chain.append((e["pos"], False))
        ms = e["ms"]
        if ms is not None:   # a read trace may hold null for a non-finite float
            if e["step"] == 0:
                self._prefill_end_ms = max(ms, self._prefill_end_ms or ms)
            self._last_ms = max(ms, self._last_ms or ms)

    def feed_all(self, events: Iterable[Mapping[str, Any]]) -> "Tally":
        for e in events:
            self.feed(e)
        self.end_step()
        return self

    def end_step(self) -> None:
        """Close the current step's chain (done by itself when a later step's event arrives)."""
        if self._chain:
            self.acceptance.add_chain(self._step, self._chain)
            self._chain = []

    @property
    def text(self) -> str:
        return "".join(self._texts)

    @property
    def tpf(self) -> float:
        return self.n_tokens / self.forwards if self.forwards else 0.0

    def decode_rate(self) -> float | None:
        """Tokens per second since the prefill ended (None until a decode step has taken time)."""
        if self._prefill_end_ms is None or self._last_ms is None or self._last_ms <= self._prefill_end_ms:
            return None
        return tok_per_s(self.decoded, (self._last_ms - self._prefill_end_ms) / 1000)

    def footer(self) -> dict[str, Any]:
        """The footer fields events determine; timing and stop_reason come from the run itself."""
        self.end_step()
        acc = self.acceptance
        return {"text": self.text, "n_tokens": self.n_tokens, "forwards": self.forwards, "tpf": self.tpf,
                "accept_rate": acc.rate, "accept_by_pos": acc.by_pos}


def summarize(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Footer metrics computed from events alone (see `Tally.footer`)."""
    return Tally().feed_all(events).footer()


def acceptance(events: Iterable[Mapping[str, Any]]) -> Acceptance:
    return Tally().feed_all(events).acceptance


def prefill_tokens(events: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """(prompt tokens the prefill wrote to the KV cache, prompt tokens it found there from a chat's earlier turns),
    from the KV moves of step 0: prompt tokens, not the width of the prefill forwards (which add MASK rows)."""
    moves = [e for e in events if e["t"] == "kv" and e["step"] == 0]
    if not moves:
        return 0, 0
    reused = moves[0]["from_len"]
    return moves[-1]["to_len"] - reused, reused


def tok_per_s(tokens: int, seconds: float) -> float:
    """The tok/s of every report: output tokens / decode seconds (prefill excluded); 0.0 for no time."""
    return tokens / seconds if seconds > 0 else 0.0

"""Per-step series derived from events (DESIGN §2.3 definitions, the same as `studio.events.summarize`).

No plotly here: the figures, the HTML report, Perfetto counters and the TUI all use these series.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


@dataclass
class StepPoint:
    step: int
    role: str | None          # the step's forward role (None: no forward event at this step)
    ms: float | None          # the step's last event time
    wall_ms: float | None     # forward time
    emitted: int              # tokens emitted at this step
    unmasked: int             # tokens unmasked at this step and not emitted at it (emitted later)
    progressed: bool          # the step emitted, unmasked, proposed or verified something
    tokens: int               # cumulative emitted tokens
    forwards: int             # cumulative forwards (prefill excluded, as in summarize)
    tpf: float | None         # running TPF = tokens / forwards (None before the first forward)
    accepted: int             # cumulative accepted drafts
    verified: int             # cumulative verified drafts
    accept_rate: float | None  # running acceptance (None before anything was verified)
    kv_len: int | None        # KV length after the step's last kv event


@dataclass
class Acceptance:
    verified_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    per_verify_step: dict[int, int] = field(default_factory=dict)   # step -> accepted drafts in it
    drafted_per_verify_step: dict[int, int] = field(default_factory=dict)  # step -> verified drafts

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


def acceptance(events: Iterable[Mapping[str, Any]]) -> Acceptance:
    """Acceptance counts; a chain is one step's accepted + rejected positions, slot = rank by pos."""
    tracker = Tracker()
    tracker.feed(events)
    return tracker.acceptance


def progress(events: Iterable[Mapping[str, Any]]) -> list[StepPoint]:
    """One point per step present in the events, in step order (events are in step order in a trace)."""
    tracker = Tracker()
    tracker.feed(events)
    return tracker.points


class Tracker:
    """The step series and acceptance counts, fed whole steps at a time as a run produces them (live
    views); `progress` and `acceptance` feed it a whole trace at once."""

    def __init__(self) -> None:
        self.points: list[StepPoint] = []
        self.acceptance = Acceptance()
        self._tokens = self._forwards = self._accepted = self._verified = 0
        self._kv_len: int | None = None

    def feed(self, events: Iterable[Mapping[str, Any]]) -> list[StepPoint]:
        """Add events of whole steps; returns the new points."""
        by_step: dict[int, list[Mapping[str, Any]]] = {}
        for e in events:
            by_step.setdefault(e["step"], []).append(e)
        new = [self._add_step(step, by_step[step]) for step in sorted(by_step)]
        self.points.extend(new)
        return new

    def _add_step(self, step: int, step_events: list[Mapping[str, Any]]) -> StepPoint:
        role = None
        wall = None
        ms = None
        emitted = 0
        unmasked: set[int] = set()
        emitted_pos: set[int] = set()
        chain: list[tuple[int, bool]] = []
        progressed = False
        for e in step_events:
            t = e["t"]
            if e["ms"] is not None and (ms is None or e["ms"] > ms):
                ms = e["ms"]
            if t == "forward":
                role = role or e["role"]
                self._forwards += e["role"] != "prefill"
                if e["wall_ms"] is not None:
                    wall = (wall or 0.0) + e["wall_ms"]
            elif t == "emit":
                emitted += len(e["tok"])
                emitted_pos.update(e["pos"])
                progressed = progressed or bool(e["tok"])
            elif t == "accept":
                chain.extend((p, True) for p in e["pos"])
                progressed = True
            elif t == "reject":
                chain.append((e["pos"], False))
                progressed = True
            elif t == "unmask":
                unmasked.update(e["pos"])
                progressed = progressed or bool(e["pos"])
            elif t in ("propose", "resample", "bonus"):
                progressed = True
            elif t == "kv":
                self._kv_len = e["to_len"]
        if chain:
            self._add_chain(step, sorted(chain))
        self._tokens += emitted
        acc, ver = self.acceptance.accepted, self.acceptance.verified
        return StepPoint(step, role, ms, wall, emitted, len(unmasked - emitted_pos), progressed, self._tokens,
                         self._forwards, self._tokens / self._forwards if self._forwards else None, acc, ver,
                         acc / ver if ver else None, self._kv_len)

    def _add_chain(self, step: int, chain: list[tuple[int, bool]]) -> None:
        a = self.acceptance
        for k, (_, ok) in enumerate(chain):
            if k == len(a.verified_by_pos):
                a.verified_by_pos.append(0)
                a.accepted_by_pos.append(0)
            a.verified_by_pos[k] += 1
            a.accepted_by_pos[k] += ok
        a.per_verify_step[step] = sum(ok for _, ok in chain)
        a.drafted_per_verify_step[step] = len(chain)


def stalled_steps(points: list[StepPoint]) -> list[StepPoint]:
    """Forward steps (prefill excluded) that made no progress at all (Fast-dLLM #42-style stalls)."""
    return [p for p in points if p.role not in (None, "prefill") and not p.progressed]


def kind_counts(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    return dict(Counter(e["t"] for e in events))


def diagnostics(events: list[Mapping[str, Any]], strategy: str | None = None) -> list[str]:
    """Plain-language flags a user would want to see (anchors §8.7): stalls, no parallelism, drop-off.
    `strategy` (the header's) silences the TPF ≈ 1 flag for plain AR, where it is expected."""
    notes: list[str] = []
    pts = progress(events)
    stalled = [p.step for p in stalled_steps(pts)]
    if stalled:
        shown = ", ".join(map(str, stalled[:12])) + (" …" if len(stalled) > 12 else "")
        notes.append(f"{len(stalled)} forward(s) made no progress: nothing emitted, unmasked, proposed or "
                     f"verified (steps {shown}).")
    if strategy != "ar" and pts and pts[-1].forwards >= 4 and pts[-1].tpf is not None and pts[-1].tpf < 1.1:
        notes.append(f"Parallelism collapsed: TPF {pts[-1].tpf:.2f} ≈ 1 token per forward "
                     "(plain AR speed at best).")
    acc = acceptance(events)
    if acc.verified and acc.accepted == 0:
        notes.append(f"No draft was accepted ({acc.verified} verified): the drafter and target disagree.")
    # slots numbered from 1 as in the acceptance-by-position figure; a slot verified fewer than 5 times
    # says nothing about a drop-off
    by = [(k, r) for k, (r, n) in enumerate(zip(acc.by_pos, acc.verified_by_pos), 1) if n >= 5]
    if len(by) >= 2 and by[0][0] == 1 and by[0][1] > 0.2 and by[-1][1] < by[0][1] / 2:
        notes.append(f"Acceptance falls off by draft slot: {by[0][1]:.0%} at slot 1, "
                     f"{by[-1][1]:.0%} at slot {by[-1][0]}.")
    return notes

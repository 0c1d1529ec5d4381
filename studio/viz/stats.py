"""Per-step series derived from events, counted by `studio.events.metrics` (docs/metrics.md).

No plotly here: the figures, the HTML report, Perfetto counters and the TUI all use these series.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from studio.events.metrics import Acceptance, Tally, acceptance


@dataclass
class StepPoint:
    step: int
    role: str | None          # the step's forward role (None: no forward event at this step)
    ms: float | None          # the step's last event time
    wall_ms: float | None     # forward time
    emitted: int              # tokens emitted at this step
    unmasked: int             # tokens unmasked at this step and emitted at a later one (counted as they are
                              # emitted: the padding after an early EOS, never emitted, never counts)
    progressed: bool          # the step emitted, unmasked, proposed or verified something
    tokens: int               # cumulative emitted tokens
    forwards: int             # cumulative forwards (prefill excluded, as in summarize)
    tpf: float | None         # running TPF = tokens / forwards (None before the first forward)
    accepted: int             # cumulative accepted drafts
    verified: int             # cumulative verified drafts
    accept_rate: float | None  # running acceptance (None before anything was verified)
    kv_len: int | None        # KV length after the step's last kv event
    refreshed: tuple[tuple[int, int], ...] = ()   # KV slot ranges [from, to) recomputed at this step
    plan: tuple[int, int, float] | None = None     # cost-aware drafting's plan for this step's forward:
                                                   # (drafts, max_drafts, expected gain over a plain AR step)


def progress(events: Iterable[Mapping[str, Any]]) -> list[StepPoint]:
    """One point per step present in the events, in step order (events are in step order in a trace)."""
    tracker = Tracker()
    tracker.feed(events)
    return tracker.points


class Tracker:
    """The step series of a run, fed whole steps at a time as it produces them (live views); `progress`
    feeds it a whole trace at once. Counts and acceptance are `studio.events.metrics.Tally`'s."""

    def __init__(self) -> None:
        self.points: list[StepPoint] = []
        self.tally = Tally()
        self._kv_len: int | None = None
        self._filled_at: dict[int, StepPoint] = {}   # pos -> the point of the step that unmasked it (not emitted)

    @property
    def acceptance(self) -> Acceptance:
        return self.tally.acceptance

    def feed(self, events: Iterable[Mapping[str, Any]]) -> list[StepPoint]:
        """Add events of whole steps; returns the new points."""
        by_step: dict[int, list[Mapping[str, Any]]] = {}
        for e in events:
            by_step.setdefault(e["step"], []).append(e)
        new = [self._add_step(step, by_step[step]) for step in sorted(by_step)]
        self.points.extend(new)
        return new

    def _add_step(self, step: int, step_events: list[Mapping[str, Any]]) -> StepPoint:
        role = wall = ms = None
        emitted = 0
        unmasked: set[int] = set()
        emitted_pos: set[int] = set()
        refreshed: list[tuple[int, int]] = []
        plan = None
        progressed = False
        for e in step_events:
            self.tally.feed(e)
            t = e["t"]
            if e["ms"] is not None and (ms is None or e["ms"] > ms):
                ms = e["ms"]
            if t == "forward":
                role = role or e["role"]
                if e["wall_ms"] is not None:
                    wall = (wall or 0.0) + e["wall_ms"]
            elif t == "emit":
                emitted += len(e["tok"])
                emitted_pos.update(e["pos"])
                progressed = progressed or bool(e["tok"])
            elif t == "unmask":
                unmasked.update(e["pos"])
                progressed = progressed or bool(e["pos"])
            elif t == "remask":   # filled tokens gone (noise or MASK again): not emitted later
                unmasked.difference_update(e["pos"])
                for p in e["pos"]:
                    self._filled_at.pop(p, None)
                progressed = True
            elif t in ("propose", "resample", "bonus", "accept", "reject", "edit"):
                progressed = True
            elif t == "route":   # S2D2's draft forward hands its drafts to the next forward's verifier
                progressed = progressed or e["verify"]
            elif t == "plan":
                plan = (e["drafts"], e["max_drafts"], e["gain"])
            elif t == "kv" and e["op"] == "refresh":   # a refresh recomputes slots; the length stays
                refreshed.append((e["from_len"], e["to_len"]))
            elif t == "kv":
                self._kv_len = e["to_len"]
        self.tally.end_step()
        tally, acc = self.tally, self.tally.acceptance
        for p in emitted_pos:   # tokens an earlier step unmasked, emitted now
            earlier = self._filled_at.pop(p, None)
            if earlier is not None:
                earlier.unmasked += 1
        point = StepPoint(step, role, ms, wall, emitted, 0, progressed, tally.n_tokens, tally.forwards,
                          tally.tpf if tally.forwards else None, acc.accepted, acc.verified,
                          acc.rate if acc.verified else None, self._kv_len, tuple(refreshed), plan)
        self._filled_at.update((p, point) for p in unmasked - emitted_pos)
        return point


def stalled_steps(points: list[StepPoint]) -> list[StepPoint]:
    """Forward steps (prefill excluded) that made no progress at all (Fast-dLLM #42-style stalls)."""
    return [p for p in points if p.role not in (None, "prefill") and not p.progressed]


def kind_counts(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    return dict(Counter(e["t"] for e in events))


def diagnostics(events: list[Mapping[str, Any]], strategy: str | None = None) -> list[str]:
    """Plain-language flags a user would want to see: stalls, no parallelism, drop-off.
    `strategy` (the header's) silences the TPF ≈ 1 flag for plain AR, where it is expected."""
    notes: list[str] = []
    pts = progress(events)
    stalled = [p.step for p in stalled_steps(pts)]
    if stalled:
        shown = ", ".join(map(str, stalled[:12])) + (" …" if len(stalled) > 12 else "")
        notes.append(f"{len(stalled)} forward(s) made no progress: nothing emitted, unmasked, proposed or "
                     f"verified (steps {shown}).")
    if strategy != "ar" and pts and pts[-1].forwards >= 4 and pts[-1].tpf is not None and pts[-1].tpf < 1.1:
        plans = [p.plan for p in pts if p.plan is not None]
        ar_steps = sum(p[0] == 0 for p in plans)
        if plans and ar_steps >= len(plans) / 2:   # the planner chose it: say why, not only that
            notes.append(f"TPF {pts[-1].tpf:.2f}: cost-aware drafting planned {ar_steps} of {len(plans)} forwards as "
                         "plain AR steps, because on this machine's forward costs the drafts it expected to be "
                         "accepted did not pay for their rows (drafting=fixed drafts every forward).")
        else:
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

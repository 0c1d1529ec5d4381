"""What a screen shows of one run, built from its events: the trajectory grid and the step series."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping

from studio.events import Trace
from studio.viz.grid import GridBuilder
from studio.viz.stats import Acceptance, StepPoint, Tracker, acceptance


FRAME_S = 1 / 15   # how often the live screens take the worker's steps (and may draw: see FramePacer)


class RunView:
    """The grid (`studio.viz.grid`) and series (`studio.viz.stats`) of one run, fed whole steps at a time
    as the worker hands them over, or a whole trace at once (replay)."""

    def __init__(self, token_text: Callable[[int], str] | None = None, header: Mapping[str, Any] | None = None):
        self.header = dict(header or {})
        self.events: list[dict] = []
        self._builder = GridBuilder(token_text)
        self._tracker = Tracker()

    @classmethod
    def of_trace(cls, trace: Trace) -> "RunView":
        from studio.viz.grid import build_grid
        view = cls(header=trace.header)
        view.events = list(trace.events)
        view._builder.grid = build_grid(trace.header, trace.events)   # the whole trace's token texts
        view._tracker.feed(trace.events)
        return view

    def feed(self, events: Iterable[Mapping[str, Any]]) -> None:
        events = list(events)
        self._builder.feed(events)
        self._tracker.feed(events)
        self.events.extend(events)

    @property
    def grid(self):
        return self._builder.grid

    @property
    def points(self) -> list[StepPoint]:
        return self._tracker.points

    @property
    def acceptance(self) -> Acceptance:
        return self._tracker.acceptance

    def upto(self, step: int) -> tuple[list[StepPoint], Acceptance]:
        """The series and acceptance counts as they stood after `step` (replay scrubbing)."""
        points = [p for p in self.points if p.step <= step]
        return points, acceptance(e for e in self.events if e["step"] <= step)


class FramePacer:
    """Draws at up to `fps` while keeping the UI thread within `budget` of one core.

    The UI thread and the decode thread share the GIL: every millisecond spent laying out and painting
    is one the decode thread may wait for. `due()` is asked once per frame tick; it says draw when the UI
    thread's recent CPU share (its own `thread_time` over wall time) is under budget, and at least every
    `max_gap_s` so the picture never freezes. A cheap screen draws every tick; an expensive one (a long
    answer, a wide grid) draws less often instead of slowing the decoding.
    """

    def __init__(self, budget: float = 0.05, max_gap_s: float = 0.25):
        self.budget, self.max_gap_s = budget, max_gap_s
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        self._last_draw = self._wall
        self.share = 0.0

    def due(self) -> bool:
        wall, cpu = time.perf_counter(), time.thread_time()
        if wall > self._wall:
            self.share = 0.5 * self.share + 0.5 * (cpu - self._cpu) / (wall - self._wall)
        self._wall, self._cpu = wall, cpu
        if self.share <= self.budget or wall - self._last_draw >= self.max_gap_s:
            self._last_draw = wall
            return True
        return False

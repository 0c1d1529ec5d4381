"""How the live screens keep pace with a decoding run: the frame period and the pacer that decides when to draw.
What they draw of a run is its `studio.viz.view.RunView`."""
from __future__ import annotations

import time

FRAME_S = 1 / 15   # how often the live screens take the worker's steps (and may draw: see FramePacer)


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

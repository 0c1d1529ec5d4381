"""Runs as the page sees them: a trajectory fed step by step, and the loop that turns a decoding worker into
frames at most `FPS` times a second.

Why it keeps up: the worker decodes on its own thread and never waits for the page;
each frame drains whatever steps arrived since the last one, renders only those steps' rows, and hands
the page the trajectory as a list that only grows. Gradio streams a generator's outputs as diffs against
the previous frame, so a frame carries the new rows only, and the page appends them without touching
the rows it already has (see `components.trajectory`). Nothing is re-rendered, nothing flickers, and however
fast the model decodes, the browser gets at most `FPS` small frames a second (gradio #5914/#6847 fell behind
at ~100 updates a second). Plotly figures are drawn once, when a run ends.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence

from studio.events import Trace
from studio.run.worker import Worker
from studio.viz.view import RunView
from studio.web import render

FPS = 10


class Trajectory:
    """One run on the page: its `RunView` and each step's row of HTML, rendered once, when its step is fed
    (a step's cells never change later, so a row rendered live equals one rendered from the trace)."""

    def __init__(self, view: RunView, title: str = ""):
        self.id = uuid.uuid4().hex   # a new trajectory replaces, never extends, the one on the page
        self.view, self.title = view, title
        self.rows = [render.row_html(view.grid, step) for step in view.grid.steps]

    @classmethod
    def live(cls, token_text: Callable[[int], str | None] | None = None, title: str = "",
             header: Mapping | None = None) -> Trajectory:
        """An empty trajectory that a run's steps will be fed into (its header: a canvas run's canvas is laid out
        from the first step)."""
        return cls(RunView(token_text, header), title)

    @classmethod
    def of_trace(cls, trace: Trace, title: str = "",
                 token_text: Callable[[int], str | None] | None = None) -> Trajectory:
        """A finished (or truncated) trace (see `RunView.of_trace` for where token texts come from)."""
        return cls(RunView.of_trace(trace, token_text), title)

    def feed(self, events: Sequence[Mapping]) -> None:
        for step in self.view.feed(events):
            self.rows.append(render.row_html(self.view.grid, step))

    def frame(self, n_rows: int | None = None, rewind: bool = False) -> dict:
        """The trajectory component's value: a new list each time (gradio diffs it against the last frame).
        `rewind`: the pane then shows its first step and the start of every row (a finished comparison's panes,
        which followed runs of different lengths, start level)."""
        return {"run": self.id, "rows": self.rows[:n_rows], **({"rewind": True} if rewind else {})}

    def metrics(self, n_rows: int | None = None) -> str:
        """The metrics of the run so far, or as they stood after its first `n_rows` steps (replay)."""
        if n_rows is None:
            return render.metrics_html(self.view.numbers, self.title)
        steps = self.view.grid.steps[:n_rows]
        return render.metrics_html(self.view.upto(steps[-1] if steps else -1), self.title)


def frames(worker: Worker, views: Sequence[Trajectory], pace_s: float = 0.0, fps: int = FPS) -> Iterator[bool]:
    """Feed `views[i]` with run i's steps as the worker produces them; yield at most `fps` times a second
    (False while decoding, True once at the end, after the last steps). `pace_s` > 0 (slow motion) lets
    the worker take one step every `pace_s` seconds (it must be in step mode); decoding time is measured
    by the runs themselves, so pacing does not change their tok/s."""
    period = 1.0 / fps
    tick = min(period, pace_s) if pace_s > 0 else period
    last_frame = next_step = time.monotonic()
    while True:
        now = time.monotonic()
        if pace_s > 0 and now >= next_step:
            worker.step()
            next_step = now + pace_s
        finished = worker.done   # before draining, so the last steps are in this frame
        for i, events in worker.drain():
            views[i].feed(events)
        if finished or now - last_frame >= period:
            last_frame = now
            yield finished
            if finished:
                return
        time.sleep(tick)

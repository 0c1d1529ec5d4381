"""Runs as the page sees them: a trajectory fed step by step, and the loop that turns a decoding worker into
frames at most `FPS` times a second.

Why it keeps up (viz_anchors §4.3): the worker decodes on its own thread and never waits for the page;
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
from typing import Callable, Iterator, Mapping, Sequence

from studio.events import Trace
from studio.viz.grid import Grid, GridBuilder
from studio.viz.stats import Tracker
from studio.web import render
from studio.run.worker import Worker

FPS = 10


class Trajectory:
    """One run's trajectory for the page: the grid and step series of `studio.viz`, and each step's row of
    HTML, rendered once, when its step is fed. `feed` takes the events of whole steps."""

    def __init__(self, token_text: Callable[[int], str | None] | None = None, title: str = ""):
        self.id = uuid.uuid4().hex   # a new trajectory replaces, never extends, the one on the page
        self.title = title
        self._builder = GridBuilder(token_text)
        self.tracker = Tracker()
        self.rows: list[str] = []
        self.text = ""   # the output so far
        self.footer: Mapping | None = None

    @classmethod
    def of_trace(cls, trace: Trace, title: str = "",
                 token_text: Callable[[int], str | None] | None = None) -> "Trajectory":
        """A finished (or truncated) trace, fed step by step exactly as it was decoded. Token texts come from
        the trace's emits, then from `token_text` (the tokenizer the trace was made with, when the page has
        it); without one, ids the trace never emitted (rejected drafts) have no text."""
        texts = {t: s for e in trace.events if e["t"] == "emit" for t, s in zip(e["tok"], e.get("pieces") or [])}
        view = cls(lambda t: texts[t] if t in texts else token_text(t) if token_text else None, title)
        by_step: dict[int, list] = {}
        for e in trace.events:
            by_step.setdefault(e["step"], []).append(e)
        for step in sorted(by_step):
            view.feed(by_step[step])
        view.footer = trace.footer
        return view

    @property
    def grid(self) -> Grid:
        return self._builder.grid

    def feed(self, events: Sequence[Mapping]) -> None:
        for step in self._builder.feed(events):
            self.rows.append(render.row_html(self.grid, step))
        self.tracker.feed(events)
        self.text += "".join(e["text"] for e in events if e["t"] == "emit")

    def frame(self, n_rows: int | None = None) -> dict:
        """The trajectory component's value: a new list each time (gradio diffs it against the last frame)."""
        return {"run": self.id, "rows": self.rows[:n_rows]}

    def metrics(self) -> str:
        return render.metrics_html(self.tracker.points, self.tracker.acceptance, self.footer, self.title)


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

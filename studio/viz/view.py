"""One run as the interfaces show it: its trajectory grid, its step series and its running metrics, fed whole
steps while it decodes or read from a trace. The TUI's screens and the web page both draw from a `RunView`;
what they add is only how they draw it (`studio.tui.live`, `studio.web.live`).

Every number (tokens, forwards, TPF, acceptance, tok/s) is a `studio.events.metrics.Tally`'s (docs/metrics.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from studio.events import Trace
from studio.events.metrics import Acceptance, Tally
from studio.viz.grid import Grid, GridBuilder
from studio.viz.stats import StepPoint, Tracker


@dataclass
class RunNumbers:
    """A run's numbers as they stood after some step: the step series, the Tally of the events so far, and the
    footer once the run has finished (its tok/s is then the run's own measure)."""
    points: list[StepPoint] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    footer: Mapping[str, Any] | None = None

    @property
    def last(self) -> StepPoint | None:
        return self.points[-1] if self.points else None

    @property
    def acceptance(self) -> Acceptance:
        return self.tally.acceptance

    @property
    def tpf(self) -> float | None:
        """Tokens per forward (None before the first forward after the prefill)."""
        return self.tally.tpf if self.tally.forwards else None

    def tok_s(self) -> float | None:
        """The footer's tok/s once finished, else the decode rate so far (None until a decode step took time)."""
        return self.footer["tok_s"] if self.footer else self.tally.decode_rate()


class RunView:
    """The grid (`studio.viz.grid`), series (`studio.viz.stats`) and Tally of one run.

    Live: `feed` the events of whole steps as a worker hands them over. Replay: `of_trace`, then `upto(step)`
    for the numbers as they stood after any step (the grid draws any step itself).
    """

    def __init__(self, token_text: Callable[[int], str | None] | None = None,
                 header: Mapping[str, Any] | None = None):
        self.header = dict(header or {})
        self.events: list[Mapping[str, Any]] = []
        self.footer: Mapping[str, Any] | None = None   # set when the run has finished
        self._builder = GridBuilder(token_text, header=header)
        self._tracker = Tracker()

    @classmethod
    def of_trace(cls, trace: Trace, token_text: Callable[[int], str | None] | None = None) -> "RunView":
        """A finished (or truncated) trace. Token texts come from the trace's emits (their `pieces`), then from
        `token_text`: by default the tokenizer the header names, when this machine has it
        (`model_cache.trace_token_text`); without one, ids the trace never emitted (rejected drafts) have no text."""
        if token_text is None:
            from studio.engine.model_cache import trace_token_text
            token_text = trace_token_text(trace.header)
        view = cls(header=trace.header)
        view._builder = GridBuilder.of_events(trace.events, token_text, trace.header)
        view.feed(trace.events)
        view.footer = trace.footer
        return view

    def feed(self, events: Iterable[Mapping[str, Any]]) -> list[int]:
        """Add the events of whole steps, in step order; returns the steps added."""
        events = list(events)
        self._tracker.feed(events)
        self.events.extend(events)
        return self._builder.feed(events)

    @property
    def grid(self) -> Grid:
        return self._builder.grid

    @property
    def is_canvas(self) -> bool:
        """A canvas run (masked diffusion): its legend is the canvas states'."""
        return self.grid.canvas is not None

    @property
    def points(self) -> list[StepPoint]:
        return self._tracker.points

    @property
    def tally(self) -> Tally:
        return self._tracker.tally

    @property
    def text(self) -> str:
        """The output so far."""
        return self.tally.text

    @property
    def numbers(self) -> RunNumbers:
        return RunNumbers(self.points, self.tally, self.footer)

    def upto(self, step: int) -> RunNumbers:
        """The numbers as they stood after `step` (replay scrubbing); the footer's only at the last step."""
        steps = self.grid.steps
        if steps and step >= steps[-1]:
            return self.numbers
        # counted again, not cut: a point's count of tokens emitted later grows when they are
        tracker = Tracker()
        tracker.feed(e for e in self.events if e["step"] <= step)
        return RunNumbers(tracker.points, tracker.tally)

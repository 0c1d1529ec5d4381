"""The replay screen: a trace file scrubbed step by step, or played at a chosen speed, with the same grid,
metrics panel and inspector as a live run. Reads the trace only (no model)."""
from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Header, Input, Static

from studio.errors import BadInput
from studio.events import Trace
from studio.tui.widgets import Inspector, KeyFooter, MetricsPanel, StatusBar, TokenGrid
from studio.tui.widgets.status import error_line
from studio.tui.widgets.metrics import bar
from studio.viz.palette import legend_text
from studio.viz.text import skipped_note
from studio.viz.view import RunView

SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
# one footer entry for each pair of keys ("., step", "+- speed"): 80 columns hold the screen's keys and the app's
STEP, SPEED = Binding.Group("step", compact=True), Binding.Group("speed", compact=True)
MIN_DELAY_S, MAX_DELAY_S = 0.03, 2.0   # a frame is never shorter or a pause longer than these


class ReplayScreen(Screen):
    BINDINGS = [
        Binding("space", "play", "play/pause", id="replay.play"),
        Binding("full_stop", "step(1)", "next step", group=STEP, id="replay.next"),
        Binding("comma", "step(-1)", "prev step", group=STEP, id="replay.prev"),
        Binding("right_square_bracket", "step(10)", "+10", show=False, id="replay.next10"),
        Binding("left_square_bracket", "step(-10)", "-10", show=False, id="replay.prev10"),
        Binding("plus,equals_sign", "speed(1)", "faster", group=SPEED, id="replay.faster"),
        Binding("minus", "speed(-1)", "slower", group=SPEED, id="replay.slower"),
        Binding("ctrl+o", "focus_path", "open", id="replay.open"),
    ]

    def __init__(self, trace: Trace | None = None):
        super().__init__(id="replay")
        self.view: RunView | None = None
        self.index = 0          # position in view.grid.steps
        self.speed_i = SPEEDS.index(1.0)
        self.playing = False
        self._timer = None
        self._initial = trace

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="replay-open"):
            yield Input(placeholder="trace file (.jsonl)", id="replay-path")
            yield Button("Open", id="replay-open-button")
        yield Static(id="replay-title")
        yield Static(id="scrubber")
        with Horizontal():
            with Vertical(id="replay-main"):
                with VerticalScroll(id="grid-box"):
                    yield TokenGrid(id="grid")
                yield Inspector(id="inspector")
            with VerticalScroll(id="side"):
                yield MetricsPanel(id="metrics")
        yield Static(legend_text(), id="legend")
        yield StatusBar(id="status")
        yield KeyFooter()

    def on_mount(self) -> None:
        self.title = "dlm-studio · replay"
        self.query_one("#grid-box").border_title = "tokens"
        if self._initial is not None:
            self.load(self._initial, str(self._initial.path or ""))
        else:
            self.query_one("#replay-path", Input).focus()
            self.status("open a trace: type its path, Enter")
            self.redraw()

    def status(self, text: str, error: bool = False) -> None:
        self.query_one(StatusBar).say(text, error)

    # -- loading ---------------------------------------------------------------------------------
    @on(Input.Submitted, "#replay-path")
    @on(Button.Pressed, "#replay-open-button")
    def open_path(self) -> None:
        from studio.events import read_trace
        path = self.query_one("#replay-path", Input).value.strip()
        try:
            trace = read_trace(path, allow_truncated=True)
        except BadInput as e:
            self.status(error_line(e), error=True)
            return
        self.load(trace, path)

    def load(self, trace: Trace, path: str) -> None:
        self.pause()
        self.view = RunView.of_trace(trace)
        self.index = 0
        h = trace.header
        model = h.get("model", {})
        title = Text.assemble(("replay ", "bold"), (str(h.get("strategy")), "bold cyan"),
                              f" · {model.get('name')} · seed {h.get('seed')} · {len(self.view.grid.steps)} steps")
        if trace.truncated:
            title.append("  · truncated trace (the run did not finish)", style="bold #D55E00")
        if trace.skipped:
            title.append(f"  · {trace.skipped} event(s) of a newer schema skipped", style="bold #D55E00")
        self.query_one("#replay-title", Static).update(title)
        self.query_one("#legend", Static).update(legend_text(self.view.is_canvas))
        self.query_one("#replay-path", Input).value = path
        grid = self.query_one(TokenGrid)
        grid.cursor = None
        grid.focus()
        self.redraw()
        warning = (" (truncated: no footer)" if trace.truncated else "") + (f" ({skipped_note(trace)})"
                                                                            if trace.skipped else "")
        self.status(f"{path or 'trace'}{warning} · space plays, . and , step, + and - change speed")

    # -- drawing ---------------------------------------------------------------------------------
    @property
    def step(self) -> int | None:
        return self.view.grid.steps[self.index] if self.view and self.view.grid.steps else None

    def redraw(self) -> None:
        view, step = self.view, self.step
        grid = self.query_one(TokenGrid)
        if view is None or step is None:
            grid.show(None)
            self.query_one(MetricsPanel).show(None)
            self.query_one(Inspector).show(None, None)
            self.query_one("#scrubber", Static).update("")
            return
        grid.show(view.grid, step)
        self.query_one(MetricsPanel).show(view.upto(step), str(view.header.get("strategy", "")))
        self.query_one(Inspector).show(view.grid, grid.cursor, step)
        n = len(view.grid.steps)
        frac = self.index / (n - 1) if n > 1 else 1.0
        state = "▶ playing" if self.playing else "❚❚ paused"
        self.query_one("#scrubber", Static).update(
            Text.assemble(f"step {step} ({self.index + 1}/{n}) ", ("▕" + bar(frac, 40) + "▏", "#56B4E9"),
                          f"  {state} ×{SPEEDS[self.speed_i]:g}"))

    def on_token_grid_cursor_moved(self, event: TokenGrid.CursorMoved) -> None:
        if self.view is not None:
            self.query_one(Inspector).show(self.view.grid, event.pos, self.step)

    # -- scrubbing and playing ---------------------------------------------------------------------
    def action_step(self, delta: int) -> None:
        if self.view is None or not self.view.grid.steps:
            return
        self.index = max(0, min(len(self.view.grid.steps) - 1, self.index + delta))
        self.redraw()

    def action_speed(self, delta: int) -> None:
        self.speed_i = max(0, min(len(SPEEDS) - 1, self.speed_i + delta))
        self.redraw()

    def action_play(self) -> None:
        if self.playing:
            self.pause()
        elif self.view is not None and self.view.grid.steps:
            if self.index == len(self.view.grid.steps) - 1:
                self.index = 0
            self.playing = True
            self._schedule()
        self.redraw()

    def pause(self) -> None:
        self.playing = False
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    def _schedule(self) -> None:
        """Wait for the next step as long as it took in the recorded run (÷ speed, clamped)."""
        rows = self.view.grid.rows
        steps = self.view.grid.steps
        now, nxt = rows[steps[self.index]].ms, rows[steps[min(self.index + 1, len(steps) - 1)]].ms
        gap = (nxt - now) / 1000 if now is not None and nxt is not None else 0.1
        delay = min(MAX_DELAY_S, max(MIN_DELAY_S, gap / SPEEDS[self.speed_i]))
        self._timer = self.set_timer(delay, self._tick)

    def _tick(self) -> None:
        if not self.playing:
            return
        self.index += 1
        if self.index >= len(self.view.grid.steps) - 1:
            self.index = len(self.view.grid.steps) - 1
            self.pause()
        else:
            self._schedule()
        self.redraw()

    def action_focus_path(self) -> None:
        self.query_one("#replay-path", Input).focus()

"""The compare screen: 2–4 strategies or presets on one prompt, in panes that advance in lock-step by
forward count (one `Worker` over every run, `session.drive`), then the comparison table of
`studio.run.compare` when all have finished. Runs use the chat's sampling settings and seed."""
from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Static

from studio.run.chat import ChatSession
from studio.errors import BadInput
from studio.tui.live import FRAME_S, FramePacer
from studio.tui.widgets import StatusBar, TokenGrid
from studio.tui.widgets.status import error_line
from studio.viz.palette import legend_text
from studio.viz.view import RunNumbers, RunView
from studio.run.worker import Worker

MAX_PANES = 4
DEFAULT_SPECS = "isd,jacobi-mr-cpu"


def pane_line(label: str, numbers: RunNumbers, done: bool) -> Text:
    """`✓ isd  fwd 10 tok 12 TPF 1.20 acc 17%`: the run's numbers so far (✓ once it has finished)."""
    out = Text("✓ " if done else "", style="bold #009E73")
    out.append(label, style="bold")
    if numbers.last is not None:
        tally, accept = numbers.tally, numbers.acceptance
        tpf = f"{numbers.tpf:.2f}" if numbers.tpf is not None else "—"
        acc = f"{accept.rate:.0%}" if accept.verified else "n/a"
        out.append(f"  fwd {tally.forwards} tok {tally.n_tokens} TPF {tpf} acc {acc}", style="dim")
    return out


class ComparePane(Vertical):
    DEFAULT_CSS = """
    ComparePane { width: 1fr; border: round $primary-darken-2; height: 1fr; }
    ComparePane > VerticalScroll { height: 1fr; }
    """

    def __init__(self, label: str, view: RunView):
        super().__init__()
        self.label, self.view = label, view

    def compose(self) -> ComposeResult:
        yield Static(pane_line(self.label, self.view.numbers, False), classes="pane-title")
        with VerticalScroll():
            yield TokenGrid()

    def redraw(self, done: bool) -> None:
        self.query_one(".pane-title", Static).update(pane_line(self.label, self.view.numbers, done), layout=False)
        grid = self.query_one(TokenGrid)
        grid.show(self.view.grid)
        grid.reveal_row(max(0, self.view.grid.n_pos - 1) // grid.per_row())


class CompareScreen(Screen):
    BINDINGS = [Binding("escape", "stop", "stop", id="compare.stop")]

    def __init__(self, session: ChatSession):
        super().__init__(id="compare")
        self.session = session
        self.worker: Worker | None = None
        self.views: list[RunView] = []
        self.labels: list[str] = []
        self._timer = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="compare-form"):
            yield Input(placeholder="prompt", id="compare-prompt")
            yield Input(value=DEFAULT_SPECS, placeholder="strategies or presets, comma-separated", id="compare-specs")
            yield Button("Run", id="compare-run", variant="primary")
            yield Button("Stop", id="compare-stop")
        yield Horizontal(id="panes")
        yield DataTable(id="compare-table", zebra_stripes=True)
        yield Static(legend_text(), id="legend")
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"dlm-studio · compare · {self.session.engine.name}"
        self.query_one("#compare-table").display = False
        self.query_one("#compare-prompt", Input).focus()
        self.status("ar runs first as the baseline; runs advance in lock-step by forward count")

    def status(self, text: str, error: bool = False) -> None:
        self.query_one(StatusBar).say(text, error)

    @on(Input.Submitted)
    @on(Button.Pressed, "#compare-run")
    def start(self) -> None:
        if self.worker is not None:
            self.status("a comparison is running: Esc stops it", error=True)
            return
        prompt = self.query_one("#compare-prompt", Input).value.strip()
        try:
            runs, labels = self._runs(prompt, self.query_one("#compare-specs", Input).value)
        except BadInput as e:
            self.status(error_line(e), error=True)
            return
        self.labels = labels
        self.views = [RunView(r.token_text, r.header) for r in runs]
        panes = self.query_one("#panes", Horizontal)
        panes.remove_children()
        panes.mount_all([ComparePane(label, view) for label, view in zip(labels, self.views)])
        self.query_one("#compare-table").display = False
        self.worker = Worker(runs).start()
        self._touched, self.pacer = set(), FramePacer()
        self._timer = self.set_interval(FRAME_S, self.frame)
        self.status(f"comparing {', '.join(labels)} …")

    def _runs(self, prompt: str, items: str):
        """(runs, labels): `studio.run.compare.make_runs` on the chat's settings; BadInput for a bad list."""
        from studio.run.compare import compare_configs, make_runs
        from studio.run.session import encode_prompt
        if not prompt:
            raise BadInput("type a prompt first")
        configs = compare_configs(items, self.session.choice)
        engine = self.session.engine
        ids = encode_prompt(engine, prompt, chat=self.session.conversation.chat)
        runs = make_runs(engine, prompt, ids, configs, most=MAX_PANES)
        return list(runs.values()), list(runs)

    def frame(self) -> None:
        worker = self.worker
        if worker is None:
            return
        finished = worker.done
        for i, events in worker.drain():
            self.views[i].feed(events)
            self._touched.add(i)
        panes = list(self.query(ComparePane))
        if self._touched and (finished or self.pacer.due()):
            for i in self._touched:
                panes[i].redraw(worker.runs[i].done)
            self._touched = set()
        if finished:
            self._timer.stop()
            self.worker = None
            for i, pane in enumerate(panes):
                pane.redraw(worker.runs[i].done)
            if worker.error is not None:
                self.status(error_line(worker.error), error=True)
            else:
                self.show_table(worker)

    def show_table(self, worker: Worker) -> None:
        from studio.run.compare import rows, same_as
        table = self.query_one("#compare-table", DataTable)
        table.clear(columns=True)
        table.add_columns("strategy", "tokens", "forwards", "TPF", "accept", "tok/s", "× ar", "same as", "stop")
        results = {label: run.result for label, run in zip(self.labels, worker.runs)}
        for r in rows(results):
            table.add_row(r["label"], str(r["n_tokens"]), str(r["forwards"]), f"{r['tpf']:.2f}",
                          "—" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}", f"{r['tok_s']:.1f}",
                          "—" if r["speed_vs_ar"] is None else f"{r['speed_vs_ar']:.2f}×", same_as(r), r["stop_reason"])
        table.display = True
        self.status("done: each run's output is compared with ar on the model it decodes (same prompt, seed and "
                    "sampling)")

    @on(Button.Pressed, "#compare-stop")
    def action_stop(self) -> None:
        if self.worker is not None:
            self.worker.cancel()
            self.status("stopping every run after its current step…")

"""The compare screen: 2–4 strategies or presets on one prompt, in panes that advance in lock-step by
forward count (one `Worker` over every run, `session.drive`), then the comparison table of
`studio.run.compare` when all have finished.

The screen owns its generation settings (temperature, top-k, top-p, seed, max tokens; greedy and the
`compare` command's defaults to start with): every run, presets included, uses the values in its form, never
the chat's, and the line under the panes states the settings the shown runs used."""
from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Header, Input, Label, Static

from studio.errors import BadInput
from studio.run.chat import ChatSession
from studio.run.config import RunConfig
from studio.run.worker import Worker
from studio.tui.live import FRAME_S, FramePacer
from studio.tui.widgets import KeyFooter, StatusBar, TokenGrid
from studio.tui.widgets.status import error_line
from studio.viz.palette import legend_kind, legend_text
from studio.viz.view import RunNumbers, RunView

MAX_PANES = 4
DEFAULT_SPECS = "isd,jacobi-mr-cpu"
# (RunConfig setting, label): the settings every run of a comparison shares
SETTINGS = [("temperature", "temperature"), ("top_k", "top-k"), ("top_p", "top-p"), ("seed", "seed"),
            ("max_new_tokens", "max tokens")]
# setting -> its least value: whole-number settings that `RunConfig.build` does not type-check (a seed of -2 or
# 1.5 tokens would get as far as the run)
WHOLE_NUMBERS = {"seed": 0, "max_new_tokens": 1}


def pane_title(label: str, done: bool) -> Text:
    """The pane's border title: `✓ isd` once the run has finished."""
    out = Text("✓ " if done else "", style="bold #009E73")
    out.append(label, style="bold")
    return out


def pane_numbers(numbers: RunNumbers) -> list[str]:
    """`["fwd 10", "tok 12", "TPF 1.20", "acc 17%"]`: the run's numbers so far (none before its first step)."""
    if numbers.last is None:
        return []
    tally, accept = numbers.tally, numbers.acceptance
    tpf = f"{numbers.tpf:.2f}" if numbers.tpf is not None else "—"
    acc = f"{accept.rate:.0%}" if accept.verified else "n/a"
    return [f"fwd {tally.forwards}", f"tok {tally.n_tokens}", f"TPF {tpf}", f"acc {acc}"]


def fit(parts: list[str], width: int) -> str:
    """`parts` two spaces apart, a new line where the next part would pass `width` (a part is never split)."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "  " + part
        else:
            lines.append(part)
    return "\n".join(lines)


def used_line(header: dict) -> Text:
    """What the runs shown use (every run the same): their settings, and what sampling means for "same as"."""
    from studio.run.compare import settings_text
    out = Text("these runs used: ", style="bold")
    out.append(settings_text(header))
    if header["params"]["temperature"] > 0:
        out.append(" · sampled: lossless strategies match ar in distribution, not token for token", style="dim")
    return out


class ComparePane(Vertical):
    """One run: its label (and ✓ when done) in the border, its numbers wrapped to the pane's width, its grid."""
    DEFAULT_CSS = """
    ComparePane { width: 1fr; border: round $primary-darken-2; height: 1fr; border-title-color: $text; }
    ComparePane > .pane-numbers { height: auto; color: $text-muted; }
    ComparePane > VerticalScroll { height: 1fr; }
    """

    def __init__(self, label: str, view: RunView):
        super().__init__()
        self.label, self.view = label, view
        self.border_title = pane_title(label, False)

    def compose(self) -> ComposeResult:
        yield Static("", classes="pane-numbers")
        with VerticalScroll():
            yield TokenGrid()

    def show_numbers(self) -> None:
        self.query_one(".pane-numbers", Static).update(fit(pane_numbers(self.view.numbers), self.content_size.width))

    def on_resize(self) -> None:
        self.show_numbers()

    def redraw(self, done: bool) -> None:
        self.border_title = pane_title(self.label, done)
        self.show_numbers()
        grid = self.query_one(TokenGrid)
        grid.show(self.view.grid)
        grid.reveal_row(max(0, self.view.grid.n_pos - 1) // grid.per_row())


class CompareSettings(Horizontal):
    """The settings every run of a comparison uses, one field each, starting at `RunConfig()`'s (greedy) with the
    session's answer length (`tui --max-new-tokens`)."""
    DEFAULT_CSS = """
    CompareSettings { height: 1; padding: 0 1; }
    CompareSettings Label { width: auto; padding: 0 1 0 0; }
    CompareSettings Input { width: 6; height: 1; margin: 0 1 0 0; }
    CompareSettings Input.-invalid { background: $error 40%; }
    """

    def __init__(self, max_new_tokens: int, **kwargs):
        super().__init__(**kwargs)
        self.max_new_tokens = max_new_tokens

    def compose(self) -> ComposeResult:
        _, defaults = RunConfig().build()
        shown = {"temperature": defaults.sampling.temperature, "top_k": defaults.sampling.top_k,
                 "top_p": defaults.sampling.top_p, "seed": defaults.seed, "max_new_tokens": self.max_new_tokens}
        for key, label in SETTINGS:
            yield Label(label)
            yield Input(str(shown[key]), id=f"compare-{key}", compact=True)

    def config(self) -> RunConfig:
        """A `RunConfig` with every field's value; BadInput for the first refused field, which is marked."""
        from studio.run.config import parse_value
        config = RunConfig()
        self.query(Input).remove_class("-invalid")
        for key, label in SETTINGS:
            field = self.query_one(f"#compare-{key}", Input)
            try:
                value = parse_value(field.value.strip())
                least = WHOLE_NUMBERS.get(key)
                if least is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                    raise BadInput(f"{label} must be a whole number >= {least}, got {field.value.strip()!r}")
                config = config.set(key, value)   # BadInput naming the setting ("temperature must be …")
            except BadInput:
                field.add_class("-invalid")
                raise
        return config


class CompareScreen(Screen):
    BINDINGS = [Binding("escape", "stop", "stop", id="compare.stop")]
    DEFAULT_CSS = """
    #compare-used { height: auto; padding: 0 1; }
    """

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
        yield CompareSettings(self.session.choice.build()[1].max_new_tokens, id="compare-settings")
        yield Horizontal(id="panes")
        yield Static("", id="compare-used")
        yield DataTable(id="compare-table", zebra_stripes=True)
        yield Static(legend_text(), id="legend")
        yield StatusBar(id="status")
        yield KeyFooter()

    def on_mount(self) -> None:
        self.title = f"dlm-studio · compare · {self.session.engine.name}"
        self.query_one("#compare-table").display = False
        self.query_one("#compare-prompt", Input).focus()
        self.status("ar runs first as the baseline; runs advance in lock-step by forward count; every run uses "
                    "the settings above")

    def status(self, text: str, error: bool = False) -> None:
        self.query_one(StatusBar).say(text, error)

    @on(Input.Submitted)
    @on(Button.Pressed, "#compare-run")
    def start(self) -> None:
        if self.worker is not None:
            self.status("a comparison is running: Esc stops it", error=True)
            return
        self.clear_result()   # also when refused: the last comparison's panes would pass for this one's result
        prompt = self.query_one("#compare-prompt", Input).value.strip()
        try:
            runs, labels = self._runs(prompt, self.query_one("#compare-specs", Input).value)
        except BadInput as e:
            self.status(error_line(e), error=True)
            return
        self.labels = labels
        self.views = [RunView(r.token_text, r.header) for r in runs]
        self.query_one("#legend", Static).update(legend_text(legend_kind([v.is_canvas for v in self.views])))
        self.query_one("#panes", Horizontal).mount_all([ComparePane(label, view)
                                                        for label, view in zip(labels, self.views)])
        self.query_one("#compare-used", Static).update(used_line(runs[0].header))
        self.worker = Worker(runs).start()
        self._touched, self.pacer = set(), FramePacer()
        self._timer = self.set_interval(FRAME_S, self.frame)
        self.status(f"comparing {', '.join(labels)} …")

    def clear_result(self) -> None:
        """Remove the panes, the table and the settings line of the last comparison."""
        self.query_one("#panes", Horizontal).remove_children()
        self.query_one("#compare-table").display = False
        self.query_one("#compare-used", Static).update("")

    def _runs(self, prompt: str, items: str):
        """(runs, labels): `studio.run.compare.make_runs` on the form's settings; BadInput for a bad list,
        setting or prompt."""
        from studio.run.compare import compare_configs, make_runs
        from studio.run.session import encode_prompt
        if not prompt:
            raise BadInput("type a prompt first")
        configs = compare_configs(items, self.query_one(CompareSettings).config())
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
        # "same as" second: an 80-column terminal scrolls the last columns away, never the verdict
        table.add_columns("strategy", "same as", "TPF", "accept", "× ar", "tok/s", "tokens", "forwards", "stop")
        results = {label: run.result for label, run in zip(self.labels, worker.runs)}
        for r in rows(results):
            table.add_row(r["label"], same_as(r), f"{r['tpf']:.2f}",
                          "—" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}",
                          "—" if r["speed_vs_ar"] is None else f"{r['speed_vs_ar']:.2f}×", f"{r['tok_s']:.1f}",
                          str(r["n_tokens"]), str(r["forwards"]), r["stop_reason"])
        table.display = True
        self.status("done: each run's output is compared with ar on the model it decodes, on the tokens both "
                    "produced")

    @on(Button.Pressed, "#compare-stop")
    def action_stop(self) -> None:
        if self.worker is not None:
            self.worker.cancel()
            self.status("stopping every run after its current step…")


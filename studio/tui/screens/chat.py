"""The chat screen: a conversation whose current turn decodes live — the answer streams coloured by how
each token was produced, the token grid shows every step, the metrics panel and inspector follow it.

Each turn runs on a `Worker` thread; a timer (≈15 Hz) takes the drained steps, feeds the turn's
`RunView` and redraws the widgets that changed. Slash commands are those of `studio.run.chat`.
"""
from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Header, Input, Static

from studio.run.chat import ChatSession, Reply
from studio.errors import BadInput
from studio.tui.live import FRAME_S, FramePacer
from studio.tui.widgets import Inspector, KeyFooter, MetricsPanel, StatusBar, TokenGrid
from studio.tui.widgets.status import error_line
from studio.tui.widgets.live_text import LiveText
from studio.tui.widgets.controls import Controls, apply_change
from studio.viz.palette import legend_text
from studio.viz.text import rich_text, run_summary_line
from studio.viz.view import RunView
from studio.run.worker import Worker

SIDE_PANEL_MIN_WIDTH = 100   # narrower, the run panel (44 columns) would leave the answer a sliver
TEXT_EVERY = 3   # the answer, metrics and inspector on every 3rd drawn frame: numbers and prose cannot be
                 # read faster, and drawing them costs the decode thread its share of the GIL


class ChatMessage(LiveText):
    """One chat message (user, assistant, or a note from a command)."""
    DEFAULT_CSS = """
    ChatMessage { padding: 0 1; margin: 0 0 1 0; }
    ChatMessage.user { background: $boost; }
    ChatMessage.note { color: $text-muted; }
    ChatMessage.error { color: $text-error; }
    """


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "stop", id="chat.stop"),
        Binding("ctrl+c", "interrupt", "stop", show=False, priority=True, id="chat.stop_ctrl_c"),
        Binding("ctrl+t", "toggle_step_mode", "steps", tooltip="step mode on/off", id="chat.step_mode"),
        Binding("ctrl+n", "step", "next", tooltip="next step (in step mode)", id="chat.step"),
        Binding("ctrl+g", "focus_grid", "grid", id="chat.grid"),
        Binding("ctrl+l", "focus_prompt", "prompt", show=False, id="chat.prompt"),
        Binding("f6", "toggle_side", "panel", id="chat.panel"),
    ]
    # below 100 columns the run panel folds away and below 32 rows the grid and inspector shrink (studio.tcss)
    HORIZONTAL_BREAKPOINTS: ClassVar = [(0, "-narrow"), (SIDE_PANEL_MIN_WIDTH, "-wide")]
    VERTICAL_BREAKPOINTS: ClassVar = [(0, "-short"), (32, "-tall")]

    def __init__(self, session: ChatSession):
        super().__init__(id="chat")
        self.session = session
        self.worker: Worker | None = None
        self.measuring = False   # a turn waits for the forward costs it plans with (measure_then_send)
        self._waiting: ChatMessage | None = None   # its message, shown in the conversation meanwhile
        self.view: RunView | None = None
        self.answer: ChatMessage | None = None
        self.step_mode = False
        self._timer = None
        self._prefill_shown: tuple[int, int] | None = None   # the prefill progress the status shows
        self._stopping = False
        self._frames, self._pending, self.pacer = 0, False, FramePacer()

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            with Vertical(id="chat-main"):
                yield VerticalScroll(id="conversation")
                with VerticalScroll(id="grid-box"):
                    yield TokenGrid(id="grid")
                yield Inspector(id="inspector")
                yield Input(placeholder="message, or /help", id="prompt")
            with VerticalScroll(id="side"):
                yield Controls(self.session.choice, self.session.engine.config, id="controls")
                yield MetricsPanel(id="metrics")
        yield Static(legend_text(), id="legend")
        yield StatusBar(id="status")
        yield KeyFooter()

    def on_mount(self) -> None:
        self.query_one("#grid-box").border_title = "tokens"
        self.query_one("#side").border_title = "run"
        self.query_one(Controls).sync(self.session.choice, self.session.engine)
        self.query_one(Inspector).show(None, None)
        self.query_one(MetricsPanel).show(None)
        self.title = f"dlm-studio · {self.session.engine.title}"
        self.query_one("#prompt", Input).focus()
        self.status(f"model {self.session.engine.name} · {self.session.choice.describe()} · /help for commands")

    # -- status ----------------------------------------------------------------------------------
    def status(self, text: str, error: bool = False) -> None:
        self.query_one(StatusBar).say(text, error)

    @property
    def running(self) -> bool:
        return self.worker is not None

    def note(self, text: str, error: bool = False) -> None:
        """A line in the conversation's log: wrapped and whole, where the status line is cut at the width."""
        conv = self.query_one("#conversation", VerticalScroll)
        conv.mount(ChatMessage(Text(text), classes="note error" if error else "note"))
        conv.scroll_end(animate=False)

    def fail(self, text: str) -> None:
        """An error: the status line says it in red, the log keeps it whole."""
        self.status(text, error=True)
        self.note(text, error=True)

    # -- input -----------------------------------------------------------------------------------
    @on(Input.Submitted, "#prompt")
    def submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.measuring:   # the text stays in the input, as while a generation runs
            self.status("measuring this machine's forward costs: the turn starts when they are in", error=True)
            return
        if self.running:   # the text stays in the input, to send once the answer is done
            self.status("a generation is running: Esc stops it", error=True)
            return
        if text.startswith("/"):
            event.input.value = ""   # back in the input if the command is refused (_command_done)
            self.run_command(text)
        elif self.session.costs_pending():
            self.measuring = True
            event.input.value = ""   # shown as sent; back in the input if the turn cannot start (_measured)
            self._waiting = self._mount_user(text)
            self.measure_then_send(text)
        elif self.send(text):
            event.input.value = ""   # only a message that became a turn leaves the input

    @work(thread=True, exclusive=True, group="command")
    def measure_then_send(self, text: str) -> None:
        """A cost-aware strategy's first turn on a model, device and dtype measures the forward costs it plans with
        (20-30 s on a 2-core CPU): off the UI thread, said in the status, and then the turn starts."""
        from studio.engine.cost_model import measuring_line
        self.app.call_from_thread(self.status, measuring_line(self.session.engine))
        error = None
        try:
            self.session.measure_costs()
        except Exception as e:  # noqa: BLE001 - a failed measurement is a message, never the end of the app
            error = e
        self.app.call_from_thread(self._measured, text, error)

    def _measured(self, text: str, error: Exception | None) -> None:
        self.measuring = False
        if error is None and self.send(text):
            return
        if self._waiting is not None:   # not sent after all: the message goes back to the input
            self._waiting.remove()
            self._waiting = None
        prompt = self.query_one("#prompt", Input)
        if not prompt.value:
            prompt.value = text
        if error is not None:
            self.fail(f"not sent: {error_line(error)}")

    @work(thread=True, exclusive=True, group="command")
    def run_command(self, line: str) -> None:
        """Commands run off the UI thread: /model loads a model, which takes seconds."""
        self.app.call_from_thread(self.status, f"{line} …")
        try:
            reply = self.session.command(line)
        except Exception as e:  # noqa: BLE001 - a failed command is a message, never the end of the app
            reply = Reply(f"error: {error_line(e)}", error=True)
        self.app.call_from_thread(self._command_done, line, reply)

    def _command_done(self, line: str, reply) -> None:
        if reply.quit:
            self.app.exit()
            return
        prompt = self.query_one("#prompt", Input)
        prompt.focus()
        # a refusal or a file written says so in the status line; any other command, that it worked
        said = reply.error or line.split()[0] == "/save"
        self.status(reply.message.splitlines()[0] if said else f"{line.split()[0]}: ok", error=reply.error)
        if not reply.error and line.split()[0] in ("/reset", "/model"):
            self.query_one("#conversation", VerticalScroll).remove_children()
        self.note(reply.message, error=reply.error)
        if reply.error:
            if not prompt.value:   # a refused command comes back to be mended (unless the user typed on)
                prompt.value = line
            return
        self.query_one(Controls).sync(self.session.choice, self.session.engine)
        self.title = f"dlm-studio · {self.session.engine.title}"

    def send(self, text: str) -> bool:
        """Start a turn with `text`; False (and why, in the status and the log) when the session refuses it."""
        try:
            run = self.session.start_turn(text)
        except BadInput as e:
            self.fail(f"not sent: {error_line(e)}")
            return False
        conv = self.query_one("#conversation", VerticalScroll)
        if self._waiting is None:
            self._mount_user(text)
        self._waiting = None
        self.answer = ChatMessage(Text("…", style="dim"), grow_by=4, classes="assistant")
        conv.mount(self.answer)
        conv.scroll_end(animate=False)
        self.view = RunView(run.token_text, run.header)
        self.query_one("#legend", Static).update(legend_text(self.view.is_canvas))
        self.redraw()   # the grid, metrics and inspector of the last turn go now, not at this turn's first step
        self._frames, self._pending, self.pacer = 0, False, FramePacer()
        self._prefill_shown, self._stopping = None, False
        self.worker = Worker([run], step_mode=self.step_mode).start()
        self._timer = self.set_interval(FRAME_S, self.frame)
        self.status(self._decoding_line())
        return True

    def _mount_user(self, text: str) -> ChatMessage:
        conv = self.query_one("#conversation", VerticalScroll)
        message = ChatMessage(Text(text), classes="user")
        conv.mount(message)
        conv.scroll_end(animate=False)
        return message

    def _decoding_line(self) -> str:
        return f"{self.session.choice.label}: decoding… (Esc stops{', ctrl+n steps' if self.step_mode else ''})"

    # -- frames ----------------------------------------------------------------------------------
    def frame(self) -> None:
        """Take what the worker decoded since the last frame and redraw what it changed."""
        worker = self.worker
        if worker is None:
            return
        finished = worker.done
        batches = worker.drain()
        for _, events in batches:
            self.view.feed(events)
        stepped = any(events for _, events in batches)   # a prefill chunk hands out no events (yet)
        if stepped or finished:
            self._prefill_done()
        else:
            self._show_prefill(worker.runs[0])
        self._pending = self._pending or stepped
        if self._pending and (finished or self.step_mode or self.pacer.due()):
            self._pending = False
            self._frames += 1
            self.redraw(all_widgets=finished or self.step_mode or self._frames % TEXT_EVERY == 1)
        if finished:
            self.turn_done(worker)

    def _show_prefill(self, run) -> None:
        """A long prompt is prefilled in chunks before the first step (nothing to draw yet): the status and the
        answer say how much of the prompt is in."""
        progress = run.prefill_progress
        if progress is None or progress == self._prefill_shown or not (run.prefilling or self._prefill_shown):
            return
        self._prefill_shown = progress
        line = "prefilling {:,} / {:,} prompt tokens".format(*progress)
        self.answer.show_text(Text(f"{line}…", style="dim"))
        if not self._stopping:
            self.status(f"{line} (Esc stops)")

    def _prefill_done(self) -> None:
        if self._prefill_shown is not None and not self._stopping:
            self.status(self._decoding_line())
        self._prefill_shown = None

    def redraw(self, all_widgets: bool = True) -> None:
        view = self.view
        grid = self.query_one(TokenGrid)
        grid.show(view.grid)
        if grid.cursor is None and not grid.has_focus:
            grid.reveal_row(max(0, view.grid.n_pos - 1) // grid.per_row())
        if not all_widgets:
            return
        self.query_one(MetricsPanel).show(view.numbers, self.session.choice.label)
        self.query_one(Inspector).show(view.grid, grid.cursor)
        if self.answer is not None:
            text = rich_text(view.grid)
            if self.answer.show_text(text if text.plain else Text("…", style="dim")):
                self.query_one("#conversation", VerticalScroll).scroll_end(animate=False)

    def turn_done(self, worker: Worker) -> None:
        self._timer.stop()
        self.worker = None
        run = worker.runs[0]
        if self.answer is not None:
            text = rich_text(self.view.grid)
            self.answer.show_text(text if text.plain else Text("(no output)", style="dim"), final=True)
        if worker.error is not None:
            self.fail(error_line(worker.error))
            return
        result = run.result
        self.view.footer = result.footer
        self.query_one(MetricsPanel).show(self.view.numbers, self.session.choice.label)
        line = run_summary_line(result.footer, self.session.choice.label, result.events)
        self.note(line)
        self.status(line)
        if not result.token_ids and result.footer["stop_reason"] == "cancelled":
            self._give_back(run.header["prompt"]["text"])

    def _give_back(self, text: str) -> None:
        """A turn cancelled before its first token is not in the conversation: its message returns to the input
        (unless something new was typed), to edit or resend; the prompt's KV computed so far is kept."""
        prompt = self.query_one("#prompt", Input)
        if not prompt.value:
            prompt.value = text
        self.note("not in the conversation (cancelled before the answer began): the message is back in the input")

    # -- actions ---------------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.worker is not None:
            self.worker.cancel()
            self._stopping = True
            self.status(f"stopping after this {'chunk' if self.worker.runs[0].prefilling else 'step'}…")

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "interrupt":   # ctrl+c stops a generation; otherwise it goes on to the app (copy, quit hint)
            return self.running
        return True

    def action_interrupt(self) -> None:
        self.action_stop()

    def action_toggle_step_mode(self) -> None:
        self.set_step_mode(not self.step_mode)

    def set_step_mode(self, on: bool) -> None:
        self.step_mode = on
        if self.worker is not None:
            self.worker.set_step_mode(on)
        self.query_one(Controls).show_step_mode(on)
        self.status("step mode on: ctrl+n advances one step" if on else "step mode off")

    def action_step(self) -> None:
        if self.worker is not None and self.step_mode:
            self.worker.step()

    def action_focus_grid(self) -> None:
        self.query_one(TokenGrid).focus()

    def action_focus_prompt(self) -> None:
        self.query_one("#prompt", Input).focus()

    def on_screen_resume(self) -> None:
        """Back on the chat (F2 from another screen, or help closed): typing goes to the input again."""
        self.query_one("#prompt", Input).focus()

    def action_toggle_side(self) -> None:
        """Show or hide the run panel; the choice holds for this width class (narrow: hidden by default)."""
        self.toggle_class("-side-shown" if self.has_class("-narrow") else "-side-hidden")

    # -- widgets ---------------------------------------------------------------------------------
    def on_token_grid_cursor_moved(self, event: TokenGrid.CursorMoved) -> None:
        grid = self.view.grid if self.view else None
        self.query_one(Inspector).show(grid, event.pos)

    def on_controls_changed(self, event: Controls.Changed) -> None:
        controls = self.query_one(Controls)
        if event.key == "strategy" and event.value == self.session.choice.label:
            return   # the picker showing what is already chosen (e.g. on mount)
        try:
            self.session.choice = apply_change(self.session.choice, event.key, event.value)
        except BadInput as e:
            controls.invalid(event.key)
            self.fail(error_line(e))
            return
        controls.sync(self.session.choice, self.session.engine)
        self.status(f"next turn: {self.session.choice.describe()}")

    def on_controls_step_mode(self, event: Controls.StepMode) -> None:
        self.set_step_mode(event.on)


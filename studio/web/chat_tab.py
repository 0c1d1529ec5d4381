"""The chat tab: a multi-turn conversation (a `ChatSession`: the chat's KV cache is reused between turns)
decoded with the strategy of the run form, the answer streaming in while the current turn's trajectory
and metrics grow beside it; a stop button, a token inspector, the turn's figures and downloads.

Each browser session has its own `ChatTab` state (conversation, current turn); only the model is
shared, behind the app's one-at-a-time engine queue.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr

from studio.errors import BadInput
from studio.run.chat import ChatSession
from studio.run.compare import as_trace
from studio.run.config import RunConfig
from studio.run.worker import Worker
from studio.viz.figures import acceptance_by_position_figure, tpf_figure
from studio.viz.text import run_summary_line
from studio.web import components, render
from studio.web.files import DOWNLOADS, Downloads
from studio.web.form import RunForm, form_message, read_choice
from studio.web.live import Trajectory, frames

if TYPE_CHECKING:
    from studio.run.session import Run

EXAMPLES = ["Name the planets of the solar system in order.", "Write a haiku about parallel decoding.",
            "Explain in three sentences what a KV cache is.", "List five fruits, one per line."]
BUSY = "a turn is being decoded: wait for it or press Stop (your message stays in the box)"


@dataclass
class Turn:
    """A turn of the chat: its run, the worker decoding it, what the page draws it with, and the history it answers
    (its message last)."""
    run: Run
    trajectory: Trajectory
    worker: Worker
    history: list[dict]

    @property
    def text(self) -> str:
        return self.history[-1]["content"]


class ChatTab:
    """One browser session's chat."""

    def __init__(self, session: ChatSession):
        self.session = session
        self.turn: Turn | None = None   # the turn on the page (decoding or done); None after a reset
        # A Send's handler starts its turn under this lock and a reset clears the page and the history under it,
        # so a reset never falls between a turn taking the history and registering its worker (that turn would
        # run on unseen, then put the old history back). `resets` counts them: a Send received before a reset
        # starts no turn after it.
        self.lock = threading.Lock()
        self.resets = 0

    def busy_with_another(self, text: str) -> bool:
        """Whether a turn is decoding and `text` was sent beside it (not the Send that started it: both
        handlers of that click see the same text)."""
        return self.turn is not None and not self.turn.worker.done and text != self.turn.text

    @property
    def trajectory(self) -> Trajectory | None:
        return self.turn.trajectory if self.turn else None

    def start_turn(self, text: str, step_mode: bool, resets: int) -> Turn | None:
        """Start decoding the answer to `text` (it becomes the tab's turn), unless the conversation was reset since
        the Send (`resets`: the count then). BadInput as `ChatSession.start_turn`."""
        with self.lock:
            if self.resets != resets:
                return None
            run = self.session.start_turn(text)
            history = list(self.session.conversation.messages) + [{"role": "user", "content": text}]
            self.turn = Turn(run, Trajectory.live(run.token_text, title=self.session.choice.label, header=run.header),
                             Worker([run], step_mode=step_mode).start(), history)
            return self.turn

    def reset(self) -> None:
        """A new conversation: the turn being decoded is cancelled, its page and the history forgotten."""
        with self.lock:
            self.resets += 1
            turn, self.turn = self.turn, None   # first: the running turn's handler stops updating the page
            if turn is not None:   # else the cancelled turn would join the history after the reset
                turn.worker.cancel()
                turn.worker.join()
            self.session.conversation.reset()

    def cancel(self) -> None:
        """Stop the turn being decoded (it ends at its next step)."""
        if self.turn is not None:
            self.turn.worker.cancel()


def build(engine, initial: RunConfig, chat_template: bool, downloads: Downloads, engine_queue: dict) -> None:
    """The tab's components and handlers (call inside a gr.Tab)."""
    page = _layout(initial, engine.config)
    _wire_send(page, engine, initial, chat_template, engine_queue)
    _wire_controls(page)
    _wire_inspector(page)
    _wire_download(page, downloads)


@dataclass
class _Page:
    """The tab's components (`_layout`) that its handlers read and write."""
    state: gr.State
    chatbot: gr.Chatbot
    message: gr.Textbox
    send: gr.Button
    stop: gr.Button
    reset: gr.Button
    status: gr.HTML
    form: RunForm
    pace: gr.Slider
    metrics: gr.HTML
    trajectory: gr.HTML
    position: gr.Number
    inspector: gr.HTML
    tpf_plot: gr.Plot
    acc_plot: gr.Plot
    fmt: gr.Dropdown
    prepare: gr.Button
    download: gr.File
    turn_panels: dict = None   # what belongs to one turn: cleared when a new turn starts or the conversation is reset

    def new_conversation(self) -> dict:
        return {self.chatbot: [], self.trajectory: components.EMPTY, self.metrics: render.metrics_html(),
                self.status: render.note_html("new conversation"), **self.turn_panels}


def _layout(initial: RunConfig, model_config) -> _Page:
    """The conversation, its controls and the run form on the left; the turn's metrics, trajectory, inspector,
    figures and downloads on the right."""
    state = gr.State(None)
    with gr.Row():
        with gr.Column(scale=2, min_width=360):
            chatbot = gr.Chatbot(label="Conversation", render_markdown=True, sanitize_html=True, allow_tags=False,
                                 feedback_options=None, height=380, elem_id="chat-log")
            message = gr.Textbox(label="Message", placeholder="Type a message: Enter sends, Shift+Enter adds a line",
                                 lines=1, max_lines=8, elem_id="chat-message")
            gr.Examples(EXAMPLES, inputs=message, label="Examples", elem_id="chat-examples")
            with gr.Row():
                send = gr.Button("Send", variant="primary", elem_id="chat-send")
                stop = gr.Button("Stop", variant="stop", elem_id="chat-stop")
                reset = gr.Button("New conversation", elem_id="chat-reset")
            status = gr.HTML(elem_id="chat-status", elem_classes="status")
            with gr.Accordion("Strategy and parameters", open=True):
                form = RunForm(initial, "chat", model_config)
                pace = gr.Slider(0, 500, value=0, step=10, label="Slow motion: ms per step (0 = full speed)",
                                 elem_id="chat-pace")
        with gr.Column(scale=3, min_width=420):
            metrics = gr.HTML(render.metrics_html(), elem_id="chat-metrics")
            components.legend()
            trajectory = components.trajectory("chat-trajectory")
            position = gr.Number(None, label="Inspect output position (or click a cell)", precision=0,
                                 elem_id="chat-position")
            inspector = gr.HTML(render.inspector_html(None, None), elem_id="chat-inspector")
            with gr.Accordion("Figures of the last turn", open=False):
                tpf_plot = gr.Plot(label="Tokens per forward", elem_id="chat-tpf")
                acc_plot = gr.Plot(label="Acceptance by draft position", elem_id="chat-acceptance")
            fmt, prepare, download = components.download_row("chat")
    page = _Page(state, chatbot, message, send, stop, reset, status, form, pace, metrics, trajectory, position,
                 inspector, tpf_plot, acc_plot, fmt, prepare, download)
    page.turn_panels = {inspector: render.inspector_html(None, None), position: None, form.message: "",
                        download: gr.File(None, visible=False), tpf_plot: None, acc_plot: None}
    return page


def _wire_send(page: _Page, engine, initial: RunConfig, chat_template: bool, engine_queue: dict) -> None:
    """Send (or Enter): the turn decodes in the engine's queue, its answer, trajectory and metrics streaming in; a
    Send while this session's own turn decodes says why nothing starts."""
    p = page

    def on_send(text: str, tab: ChatTab | None, pace_ms: float, **values):
        tab = tab or ChatTab(ChatSession(engine, initial, chat=chat_template))
        resets = tab.resets
        turn = yield from _start(p, tab, text, pace_ms, values, resets)
        if turn is None:
            return
        run, traj, worker, history = turn.run, turn.trajectory, turn.worker, turn.history
        yield {p.state: tab, p.message: "", p.status: "", p.trajectory: traj.frame(), p.metrics: traj.metrics(),
               p.chatbot: render.chat_messages(history + [{"role": "assistant", "content": ""}]), **p.turn_panels}
        try:
            for finished in frames(worker, [traj], (pace_ms or 0) / 1000):
                if finished or tab.turn is not turn:
                    break
                yield {p.chatbot: render.chat_messages(history + [{"role": "assistant", "content": traj.view.text}]),
                       p.trajectory: traj.frame(), p.metrics: traj.metrics()}
        finally:
            worker.cancel()   # a closed page ends the run at its next step, before the engine is free again
            worker.join()
        if tab.turn is not turn:
            # the conversation was reset during the turn; gradio shows a handler's last frame again when it ends
            # (with the values this handler last gave each output), so that frame is the new conversation's page
            yield p.new_conversation()
            return
        if worker.error is not None:
            yield {p.status: render.error_html(worker.error), p.trajectory: traj.frame(),
                   p.chatbot: render.chat_messages(tab.session.conversation.messages)}
            return
        yield _finished_turn(p, tab, run, traj)

    # a queued request shows its place in the queue (gradio's tracker, on the status line); a Send while this
    # session's own turn decodes says why nothing starts (the front end ignores a trigger that is pending)
    gr.on([p.send.click, p.message.submit], on_send, inputs=[p.message, p.state, p.pace],
          inputs_kwargs=p.form.kwargs(), outputs=[p.state, p.chatbot, p.message, p.status, p.trajectory, p.metrics,
                                                  *p.turn_panels],
          api_name="chat", show_progress="full", show_progress_on=[p.status], **engine_queue)

    def on_busy_send(text: str, tab: ChatTab | None):
        return render.note_html(BUSY, "error") if tab is not None and tab.busy_with_another(text) else gr.skip()

    gr.on([p.send.click, p.message.submit], on_busy_send, [p.message, p.state], p.status, api_visibility="private",
          trigger_mode="multiple", show_progress="hidden", concurrency_limit=None)


def _start(p: _Page, tab: ChatTab, text: str, pace_ms: float, values: dict, resets: int):
    """The frames before a turn decodes (a refusal, the cost table being measured); returns the started turn, or
    None where none starts (what the page shows then already yielded)."""
    if not (text or "").strip():
        yield {p.status: render.note_html("type a message first", "error"), p.state: tab}
        return None
    try:
        tab.session.choice = read_choice(values)
    except BadInput as e:   # said beside Send too: the form's own line can be below the fold
        yield {p.form.message: render.note_html(str(e), "error"),
               p.status: render.note_html(f"not sent: {e}", "error"), p.state: tab}
        return None
    if tab.session.costs_pending():
        # the first cost-aware turn on a model waits for the table: the message shows as sent, the status says why
        # nothing is answered yet
        from studio.engine.cost_model import measuring_line
        pending = tab.session.conversation.messages + [{"role": "user", "content": text}]
        yield {p.status: render.note_html(measuring_line(tab.session.engine)), p.state: tab, p.message: "",
               p.chatbot: render.chat_messages(pending)}
        try:
            tab.session.measure_costs()
        except Exception as e:  # noqa: BLE001 - the message comes back to be sent again
            yield {p.status: render.error_html(e), p.message: text,
                   p.chatbot: render.chat_messages(tab.session.conversation.messages)}
            return None
    try:
        turn = tab.start_turn(text, step_mode=(pace_ms or 0) > 0, resets=resets)
    except BadInput as e:   # the message stays in the box (or comes back to it)
        yield {p.status: render.note_html(form_message(str(e)), "error"), p.form.message: "", p.state: tab,
               p.message: text, p.chatbot: render.chat_messages(tab.session.conversation.messages)}
        return None
    if turn is None:   # the conversation was reset after this Send: the page stays as the reset left it
        yield {p.state: tab, **p.new_conversation()}
    return turn


def _finished_turn(p: _Page, tab: ChatTab, run: Run, traj: Trajectory) -> dict:
    """The page once a turn has finished: its answer in the conversation, its summary line and figures."""
    result = run.result
    traj.view.footer = result.footer
    return {p.chatbot: render.chat_messages(tab.session.conversation.messages), p.trajectory: traj.frame(),
            p.metrics: traj.metrics(),
            p.status: render.note_html(run_summary_line(result.footer, tab.session.choice.label, result.events)),
            p.tpf_plot: tpf_figure(result.header, result.events, result.footer),
            p.acc_plot: acceptance_by_position_figure(result.header, result.events, result.footer)}


def _wire_controls(p: _Page) -> None:
    """Stop, New conversation and the chatbot's own Clear icon (beside the engine's queue)."""

    def on_stop(tab: ChatTab | None) -> None:
        if tab is not None:
            tab.cancel()

    p.stop.click(on_stop, p.state, None, api_name="stop_chat", concurrency_limit=None)

    def on_reset(tab: ChatTab | None):
        """A new conversation: the turn being decoded is cancelled and never shown again, the history forgotten."""
        if tab is not None:
            tab.reset()
        return p.new_conversation()

    reset_outputs = [p.chatbot, p.trajectory, p.metrics, p.status, *p.turn_panels]
    p.reset.click(on_reset, p.state, reset_outputs, api_name="reset_chat", concurrency_limit=None)
    # the chatbot's own Clear icon: a new conversation too (else the next turn would still see the history)
    p.chatbot.clear(on_reset, p.state, reset_outputs, api_visibility="private", concurrency_limit=None)


def _wire_inspector(p: _Page) -> None:
    """The token inspector: a position typed in, or a cell clicked in the trajectory."""

    def on_inspect(tab: ChatTab | None, pos: int | None):
        return render.inspector_html(tab.trajectory.view.grid if tab and tab.trajectory else None, pos)

    p.position.input(on_inspect, [p.state, p.position], p.inspector, api_name="inspect_chat", concurrency_limit=None)

    def on_cell(tab: ChatTab | None, evt: gr.EventData):
        pos = components.clicked_position(evt)
        return pos, on_inspect(tab, pos)

    p.trajectory.inspect(on_cell, p.state, [p.position, p.inspector], api_name="inspect_chat_cell",
                         concurrency_limit=None)


def _wire_download(p: _Page, downloads: Downloads) -> None:
    """The last finished turn's trace, in the format picked."""

    def on_download(tab: ChatTab | None, label: str):
        if tab is None or not tab.session.turns:
            return None, render.note_html("nothing to download yet: no turn has finished", "error")
        result = tab.session.turns[-1]
        path = downloads.write(as_trace(result), DOWNLOADS[label], f"chat-{result.header['strategy']}")
        return gr.File(str(path), visible=True), ""

    p.prepare.click(on_download, [p.state, p.fmt], [p.download, p.status], api_name="download_chat",
                    concurrency_limit=None)

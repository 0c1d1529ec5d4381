"""The chat tab: a multi-turn conversation (a `ChatSession`: the chat's KV cache is reused between turns)
decoded with the strategy of the run form, the answer streaming in while the current turn's trajectory
and metrics grow beside it; a stop button, a token inspector, the turn's figures and downloads.

Each browser session has its own `ChatTab` state (conversation, worker, trajectory); only the model is
shared, behind the app's one-at-a-time engine queue.
"""
from __future__ import annotations

import gradio as gr

from studio.run.chat import ChatSession
from studio.run.config import RunConfig
from studio.run.compare import as_trace
from studio.errors import BadInput
from studio.viz.figures import acceptance_by_position_figure, tpf_figure
from studio.viz.text import run_summary_line
from studio.web import components, render
from studio.web.files import DOWNLOADS, Downloads
from studio.web.form import RunForm, read_choice
from studio.web.live import Trajectory, frames
from studio.run.worker import Worker


class ChatTab:
    """One browser session's chat."""

    def __init__(self, session: ChatSession):
        self.session = session
        self.worker: Worker | None = None
        self.trajectory: Trajectory | None = None

    def cancel(self, wait: bool = False) -> None:
        """Stop the turn being decoded (it ends at its next step); `wait`: until it has ended."""
        if self.worker is not None:
            self.worker.cancel()
            if wait:
                self.worker.join()


def build(engine, initial: RunConfig, chat_template: bool, downloads: Downloads, engine_queue: dict) -> None:
    """The tab's components and handlers (call inside a gr.Tab)."""
    state = gr.State(None)
    with gr.Row():
        with gr.Column(scale=2, min_width=360):
            chatbot = gr.Chatbot(label="Conversation", render_markdown=False, sanitize_html=True, allow_tags=False,
                                 feedback_options=None, height=380, elem_id="chat-log")
            message = gr.Textbox(label="Message", placeholder="Type a message and press Enter", lines=2,
                                 elem_id="chat-message")
            with gr.Row():
                send = gr.Button("Send", variant="primary", elem_id="chat-send")
                stop = gr.Button("Stop", variant="stop", elem_id="chat-stop")
                reset = gr.Button("New conversation", elem_id="chat-reset")
            status = gr.HTML(elem_id="chat-status")
            with gr.Accordion("Strategy and parameters", open=True):
                form = RunForm(initial, "chat")
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

    def on_send(text: str, tab: ChatTab | None, pace_ms: float, **values):
        tab = tab or ChatTab(ChatSession(engine, initial, chat=chat_template))
        try:
            tab.session.choice = read_choice(values)
        except BadInput as e:
            yield {form.message: render.note_html(str(e), "error"), state: tab}
            return
        try:
            run = tab.session.start_turn(text)
        except BadInput as e:
            yield {status: render.note_html(str(e), "error"), form.message: "", state: tab}
            return
        history = list(tab.session.conversation.messages) + [{"role": "user", "content": text}]
        tab.trajectory = traj = Trajectory.live(run.token_text, title=tab.session.choice.label)
        tab.worker = worker = Worker([run], step_mode=(pace_ms or 0) > 0).start()
        yield {state: tab, message: "", form.message: "", status: "", trajectory: traj.frame(),
               metrics: traj.metrics(),
               chatbot: render.chat_messages(history + [{"role": "assistant", "content": ""}])}
        try:
            for finished in frames(worker, [traj], (pace_ms or 0) / 1000):
                if finished:
                    break
                yield {chatbot: render.chat_messages(history + [{"role": "assistant", "content": traj.view.text}]),
                       trajectory: traj.frame(), metrics: traj.metrics()}
        finally:
            worker.cancel()   # a closed page ends the run at its next step, before the engine is free again
            worker.join()
        if worker.error is not None:
            yield {status: render.error_html(worker.error), trajectory: traj.frame(),
                   chatbot: render.chat_messages(tab.session.conversation.messages)}
            return
        result = run.result
        traj.view.footer = result.footer
        yield {chatbot: render.chat_messages(tab.session.conversation.messages), trajectory: traj.frame(),
               metrics: traj.metrics(),
               status: render.note_html(run_summary_line(result.footer, tab.session.choice.label, result.events)),
               tpf_plot: tpf_figure(result.header, result.events, result.footer),
               acc_plot: acceptance_by_position_figure(result.header, result.events, result.footer)}

    gr.on([send.click, message.submit], on_send, inputs=[message, state, pace], inputs_kwargs=form.kwargs(),
          outputs=[state, chatbot, message, status, trajectory, metrics, tpf_plot, acc_plot, form.message],
          api_name="chat", show_progress="hidden", **engine_queue)

    def on_stop(tab: ChatTab | None) -> None:
        if tab is not None:
            tab.cancel()

    stop.click(on_stop, state, None, api_name="stop_chat", concurrency_limit=None)

    def on_reset(tab: ChatTab | None):
        if tab is not None:
            tab.cancel(wait=True)   # else the cancelled turn would join the history after the reset
            tab.session.conversation.reset()
            tab.trajectory = None
        return ([], components.EMPTY, render.metrics_html(), render.inspector_html(None, None),
                render.note_html("new conversation"))

    reset.click(on_reset, state, [chatbot, trajectory, metrics, inspector, status], api_name="reset_chat",
                concurrency_limit=None)

    def on_inspect(tab: ChatTab | None, pos: int | None):
        return render.inspector_html(tab.trajectory.view.grid if tab and tab.trajectory else None, pos)

    position.input(on_inspect, [state, position], inspector, api_name="inspect_chat", concurrency_limit=None)

    def on_cell(tab: ChatTab | None, evt: gr.EventData):
        pos = components.clicked_position(evt)
        return pos, on_inspect(tab, pos)

    trajectory.inspect(on_cell, state, [position, inspector], api_name="inspect_chat_cell", concurrency_limit=None)

    def on_download(tab: ChatTab | None, label: str):
        if tab is None or not tab.session.turns:
            return None, render.note_html("nothing to download yet: no turn has finished", "error")
        result = tab.session.turns[-1]
        path = downloads.write(as_trace(result), DOWNLOADS[label], f"chat-{result.header['strategy']}")
        return gr.File(str(path), visible=True), ""

    prepare.click(on_download, [state, fmt], [download, status], api_name="download_chat", concurrency_limit=None)

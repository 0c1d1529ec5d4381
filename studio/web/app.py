"""The Gradio app: three tabs over one engine, and how it is served.

Load and safety (docs/ui.md#web): the server binds 127.0.0.1 unless told otherwise and never makes a share
link; uploads are size-limited; the page loads nothing from outside (system fonts, no analytics). The
model is one object shared by every browser tab, so every handler that decodes runs in one queue,
`engine`, one request at a time; each request builds its own runs and keeps its state in its own
session, so two tabs never see each other's conversation or runs. Everything else (stop, inspect,
replay, downloads) runs beside it and never touches the model.
"""
from __future__ import annotations


import gradio as gr

from studio.run.config import RunConfig
from studio.web import analysis_tab, chat_tab, compare_tab, render, traces_tab
from studio.web.files import MAX_UPLOAD_BYTES, Downloads

ENGINE_QUEUE = {"concurrency_id": "engine", "concurrency_limit": 1}
THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "monospace"])


def build_app(engine, choice: RunConfig | None = None, chat_template: bool = True, costs=None) -> gr.Blocks:
    """The studio for `engine`; `choice`: what the chat form starts with; `chat_template`: wrap messages in
    the model's chat template (False: concatenate them, the CLI's --raw); `costs`: the device table
    (studio.traces.projection) the compare table projects its runs onto (None: no projected column)."""
    choice = choice or RunConfig()
    choice.build()
    downloads = Downloads()
    with gr.Blocks(title="dlm-studio", analytics_enabled=False) as app:
        gr.HTML(f'<div class="studio-head"><b>dlm-studio</b> · {render.esc(engine.title)} · '
                f"{render.esc(engine.config.arch)} · parallel decoding, every step visible</div>")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat", elem_id="tab-chat"):
                chat_tab.build(engine, choice, chat_template, downloads, ENGINE_QUEUE)
            with gr.Tab("Compare", id="compare", elem_id="tab-compare"):
                compare_tab.build(engine, chat_template, downloads, ENGINE_QUEUE, costs)
            with gr.Tab("Traces", id="traces", elem_id="tab-traces"):
                traces_tab.build(engine, downloads)
            with gr.Tab("Analysis", id="analysis", elem_id="tab-analysis"):
                analysis_tab.build()
    app.downloads = downloads   # keeps the download folder alive as long as the app
    app.queue(default_concurrency_limit=1, max_size=64)
    return app


def serve(app: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, block: bool = True):
    """Start the server (no share link, ever); `block=False` returns (app, local_url, share_url) at once."""
    return app.launch(server_name=host, server_port=port, share=False, ssr_mode=False, css=render.CSS, theme=THEME,
                      max_file_size=MAX_UPLOAD_BYTES, prevent_thread_lock=not block, quiet=True,
                      show_error=False, footer_links=["api"])

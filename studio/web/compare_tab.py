"""The compare tab: 2–4 strategies or presets on one prompt, seed and sampling setting (`ar` always runs: it
is the baseline), advanced in lock-step by forward count by one worker, their trajectories growing side
by side; then `studio.run.compare`'s table, the comparison figure and the HTML report to download."""
from __future__ import annotations

from dataclasses import dataclass, field

import gradio as gr

from studio.errors import BadInput
from studio.run.compare import as_trace, compare_configs, make_runs, rows, write_html
from studio.run.config import RunConfig
from studio.run.session import MAX_NEW_TOKENS, costs_pending, encode_prompt
from studio.run.worker import Worker
from studio.viz.figures import comparison_figure
from studio.web import components, render
from studio.web.files import Downloads
from studio.web.form import form_message, pick_choices, read_settings, settings_fields
from studio.web.live import Trajectory, frames

MAX_RUNS = 4


@dataclass
class CompareTab:
    """One browser session's comparison."""
    worker: Worker | None = None
    views: list[Trajectory] = field(default_factory=list)

    def cancel(self) -> None:
        if self.worker is not None:
            self.worker.cancel()


COMPARE_SETTINGS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": MAX_NEW_TOKENS, "seed": 0}   # greedy


def start_runs(engine, prompt: str, names: list[str], settings: dict, chat_template: bool):
    """(labels, runs) of a comparison (`studio.run.compare.make_runs`) with `settings` (the settings fields by
    key); BadInput, in the form's words, before anything runs when the prompt, a name or a setting is wrong."""
    if not (prompt or "").strip():
        raise BadInput("type a prompt first")
    try:
        configs = compare_configs(",".join(names or []), RunConfig(**read_settings(settings)))
        ids = encode_prompt(engine, prompt, chat=chat_template)
        runs = make_runs(engine, prompt, ids, configs, most=MAX_RUNS)
    except BadInput as e:
        raise BadInput(form_message(str(e))) from None
    return list(runs), list(runs.values())


def measuring_first(engine, names: list[str], settings: dict) -> str | None:
    """The status line of a comparison whose cost-aware runs first measure the model's forward costs (seconds, once
    per model, device and dtype); None when none has to, or the form is wrong (`start_runs` says how)."""
    from studio.engine.cost_model import measuring_line
    try:
        configs = compare_configs(",".join(names or []), RunConfig(**read_settings(settings)))
        pending = any(costs_pending(engine, config.build()[0]) for config in configs.values())
    except BadInput:
        return None
    return measuring_line(engine) if pending else None


def build(engine, chat_template: bool, downloads: Downloads, engine_queue: dict, costs=None) -> None:
    page = _layout(engine.config)
    _wire_run(page, engine, chat_template, downloads, engine_queue, costs)
    _wire_stop_and_inspect(page)


@dataclass
class _Page:
    """The tab's components (`_layout`) that its handlers read and write."""
    state: gr.State
    prompt: gr.Textbox
    names: gr.Dropdown
    settings: dict
    pace: gr.Slider
    start: gr.Button
    stop: gr.Button
    status: gr.HTML
    columns: list
    metrics: list
    trajectories: list
    inspector: gr.HTML
    table: gr.HTML
    figure: gr.Plot
    report: gr.File
    cleared: dict = None   # the last comparison's panes: cleared when another starts or is refused

    def frame(self, views: list[Trajectory], rewind: bool = False) -> dict:
        out = {}
        for i, v in enumerate(views):
            out[self.metrics[i]] = v.metrics()
            out[self.trajectories[i]] = v.frame(rewind=rewind)
        return out


def _layout(model_config) -> _Page:
    """The prompt, the runs and their settings, the controls; a column per run (metrics over trajectory); the
    inspector, the table, the figure and the report."""
    state = gr.State(None)
    prompt = gr.Textbox(label="Prompt", placeholder="Type a prompt: Enter runs the comparison", lines=1, max_lines=8,
                        elem_id="cmp-prompt")
    names = gr.Dropdown(pick_choices(model_config), value=["ar", "isd"], multiselect=True, max_choices=MAX_RUNS,
                        label=f"Strategies or presets (2–{MAX_RUNS} runs; ar is always the baseline)",
                        elem_id="cmp-names")
    with gr.Row():
        settings = settings_fields(COMPARE_SETTINGS, "cmp")
    pace = gr.Slider(0, 500, value=0, step=10, label="Slow motion: ms per step (0 = full speed)", elem_id="cmp-pace")
    with gr.Row():
        start = gr.Button("Run comparison", variant="primary", elem_id="cmp-run")
        stop = gr.Button("Stop", variant="stop", elem_id="cmp-stop")
    status = gr.HTML(elem_id="cmp-status", elem_classes="status")
    components.legend()
    columns, metrics, trajectories = [], [], []
    with gr.Row():
        for i in range(MAX_RUNS):
            with gr.Column(visible=i < 2, min_width=240) as col:
                metrics.append(gr.HTML(elem_id=f"cmp-metrics-{i}"))
                trajectories.append(components.trajectory(f"cmp-trajectory-{i}"))
            columns.append(col)
    inspector = gr.HTML(render.inspector_html(None, None), elem_id="cmp-inspector")
    table = gr.HTML(elem_id="cmp-table")
    figure = gr.Plot(label="Comparison", visible=False, elem_id="cmp-figure")
    report = gr.File(label="HTML report", interactive=False, visible=False, elem_id="cmp-report")
    page = _Page(state, prompt, names, settings, pace, start, stop, status, columns, metrics, trajectories, inspector,
                 table, figure, report)
    page.cleared = {table: "", figure: gr.Plot(None, visible=False), report: gr.File(None, visible=False),
                    inspector: render.inspector_html(None, None), **{m: "" for m in metrics},
                    **{t: components.EMPTY for t in trajectories}}
    return page


def _wire_run(p: _Page, engine, chat_template: bool, downloads: Downloads, engine_queue: dict, costs) -> None:
    """Run comparison (or Enter): the runs decode in the engine's queue, side by side; then the table, the figure
    and the report."""

    def on_run(text, run_names, pace_ms, tab: CompareTab | None, **setting_values):
        tab = tab or CompareTab()
        measuring = measuring_first(engine, run_names, setting_values)
        if measuring:
            yield {p.state: tab, p.status: render.note_html(measuring), **p.cleared}
        try:
            labels, runs = start_runs(engine, text, run_names, setting_values, chat_template)
        except BadInput as e:
            tab.views = []
            yield {p.status: render.note_html(str(e), "error"), p.state: tab, **p.cleared}
            return
        tab.views = views = [Trajectory.live(run.token_text, title=label, header=run.header)
                             for label, run in zip(labels, runs)]
        tab.worker = worker = Worker(runs, step_mode=(pace_ms or 0) > 0).start()
        shown = {col: gr.Column(visible=i < len(runs)) for i, col in enumerate(p.columns)}
        yield {p.state: tab, p.status: render.note_html("running " + ", ".join(labels) + " in lock-step"),
               **p.cleared, **shown, **{p.trajectories[i]: v.frame() for i, v in enumerate(views)}}
        try:
            for finished in frames(worker, views, (pace_ms or 0) / 1000):
                if finished:
                    break
                yield p.frame(views)
        finally:
            worker.cancel()
            worker.join()
        if worker.error is not None:
            yield {p.status: render.error_html(worker.error), **p.frame(views)}
            return
        results = {label: run.result for label, run in zip(labels, runs)}
        for traj, run in zip(views, runs):
            traj.view.footer = run.result.footer
        path = downloads.folder() / "compare-report.html"
        write_html(results, path, title=f"compare: {text[:60]}")
        yield {**p.frame(views, rewind=True), p.status: render.note_html("done"),
               p.table: render.comparison_html(rows(results, costs), costs),
               p.figure: gr.Plot(comparison_figure([as_trace(r) for r in results.values()], labels), visible=True),
               p.report: gr.File(str(path), visible=True)}

    gr.on([p.start.click, p.prompt.submit], on_run, [p.prompt, p.names, p.pace, p.state], inputs_kwargs=p.settings,
          outputs=[p.state, p.status, p.table, p.figure, p.report, p.inspector, *p.columns, *p.metrics,
                   *p.trajectories],
          api_name="compare", show_progress="full", show_progress_on=[p.status], **engine_queue)


def _wire_stop_and_inspect(p: _Page) -> None:
    """Stop (beside the engine's queue), and a cell clicked in a run's trajectory explained in the inspector."""

    def on_stop(tab: CompareTab | None) -> None:
        if tab is not None:
            tab.cancel()

    p.stop.click(on_stop, p.state, None, api_name="stop_compare", concurrency_limit=None)

    for i, traj in enumerate(p.trajectories):
        def on_cell(tab: CompareTab | None, evt: gr.EventData, i=i):
            traj = tab.views[i] if tab and i < len(tab.views) else None
            return render.inspector_html(traj.view.grid if traj else None, components.clicked_position(evt),
                                         traj.title if traj else "")
        traj.inspect(on_cell, p.state, p.inspector, api_name=f"inspect_compare_{i}", concurrency_limit=None)

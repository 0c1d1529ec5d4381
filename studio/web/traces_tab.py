"""The traces tab: upload one or more `.jsonl` traces (read by the trace reader only; a bad file is a message),
replay one with a step slider and play/pause, inspect a position, see its figures (and the comparison
figure when several are loaded), download it as JSONL, Parquet, Perfetto or an HTML report."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import gradio as gr

from studio.errors import BadInput
from studio.events import Trace
from studio.viz.figures import (
    acceptance_by_position_figure,
    comparison_figure,
    tpf_figure,
    trace_metrics,
)
from studio.viz.text import skipped_note
from studio.web import components, render
from studio.web.files import DOWNLOADS, Downloads, read_upload
from studio.web.live import FPS, Trajectory


@dataclass
class Replay:
    name: str
    trace: Trace
    trajectory: Trajectory

    @property
    def n_steps(self) -> int:
        return len(self.trajectory.rows)


@dataclass
class TracesTab:
    """One browser session's loaded traces."""
    replays: list[Replay] = field(default_factory=list)
    current: Replay | None = None
    playing: int = 0    # bumped to stop the playing loop (pause, seek, another trace)


def build(engine, downloads: Downloads) -> None:
    page = _layout()
    _wire_loading(page, engine)
    _wire_replay(page)
    _wire_inspector(page)
    _wire_download(page, downloads)


@dataclass
class _Page:
    """The tab's components (`_layout`) that its handlers read and write."""
    state: gr.State
    upload: gr.File
    status: gr.HTML
    pick: gr.Dropdown
    info: gr.HTML
    play: gr.Button
    pause: gr.Button
    step: gr.Slider
    speed: gr.Slider
    metrics: gr.HTML
    trajectory: gr.HTML
    inspector: gr.HTML
    tpf_plot: gr.Plot
    acc_plot: gr.Plot
    cmp_plot: gr.Plot
    fmt: gr.Dropdown
    prepare: gr.Button
    download: gr.File

    @property
    def shown_outputs(self) -> list:
        """What showing a trace (`show`) sets."""
        return [self.info, self.step, self.trajectory, self.metrics, self.inspector, self.tpf_plot, self.acc_plot,
                self.download]

    def show(self, replay: Replay) -> dict:
        t = replay.trace
        n = replay.n_steps
        return {self.info: render.trace_info_html(replay.name, t.header, trace_metrics(t),
                                                  skipped_note(t) if t.skipped else ""),
                self.step: gr.Slider(0, n, value=n, step=1), self.trajectory: replay.trajectory.frame(),
                self.metrics: replay.trajectory.metrics(n),
                self.inspector: render.inspector_html(replay.trajectory.view.grid, None),
                self.tpf_plot: tpf_figure(t.header, t.events, t.footer),
                self.acc_plot: acceptance_by_position_figure(t.header, t.events, t.footer),
                self.download: gr.File(None, visible=False)}   # a download is of the trace it was prepared from


def _layout() -> _Page:
    """Upload and pick, the replay controls, the trajectory with its metrics and inspector, figures, downloads."""
    state = gr.State(None)
    upload = gr.File(label="Upload trace(s) (.jsonl)", file_count="multiple", file_types=[".jsonl"],
                     elem_id="trace-upload")
    status = gr.HTML(elem_id="trace-status")
    pick = gr.Dropdown([], label="Trace", elem_id="trace-pick", interactive=True)
    info = gr.HTML(elem_id="trace-info")
    with gr.Row():
        play = gr.Button("Play", elem_id="trace-play", min_width=90)
        pause = gr.Button("Pause", elem_id="trace-pause", min_width=90)
        step = gr.Slider(0, 1, value=0, step=1, label="Steps shown", elem_id="trace-step", scale=4)
        speed = gr.Slider(1, 60, value=8, step=1, label="Steps per second", elem_id="trace-speed", scale=2)
    metrics = gr.HTML(elem_id="trace-metrics")
    components.legend()
    trajectory = components.trajectory("trace-trajectory")
    inspector = gr.HTML(render.inspector_html(None, None), elem_id="trace-inspector")
    with gr.Accordion("Figures", open=False):
        tpf_plot = gr.Plot(label="Tokens per forward", elem_id="trace-tpf")
        acc_plot = gr.Plot(label="Acceptance by draft position", elem_id="trace-acceptance")
        cmp_plot = gr.Plot(label="All loaded traces", visible=False, elem_id="trace-comparison")
    fmt, prepare, download = components.download_row("trace")
    return _Page(state, upload, status, pick, info, play, pause, step, speed, metrics, trajectory, inspector,
                 tpf_plot, acc_plot, cmp_plot, fmt, prepare, download)


def _wire_loading(p: _Page, engine) -> None:
    """An upload loads its traces (a bad file is a message) and shows the first; the dropdown picks another."""

    def on_upload(paths: list[str] | None, tab: TracesTab | None):
        tab = tab or TracesTab()
        problems, loaded = [], []
        for path in paths or []:
            try:
                name, trace = read_upload(path)
            except BadInput as e:
                problems.append(str(e))
                continue
            decode = engine.tokenizer.token_text if _same_tokenizer(trace.header, engine) else None
            loaded.append(Replay(name, trace, Trajectory.of_trace(trace, name, decode)))
        if not loaded:
            return {p.state: tab, p.status: render.note_html("; ".join(problems) or "no file", "error")}
        tab.replays, tab.current = loaded, loaded[0]
        tab.playing += 1
        note = f"loaded {len(loaded)} trace(s)" + (f"; skipped: {'; '.join(problems)}" if problems else "")
        names = [r.name for r in loaded]
        several = len(loaded) > 1
        return {p.state: tab, p.status: render.note_html(note, "error" if problems else "info"),
                p.pick: gr.Dropdown(choices=[(n, i) for i, n in enumerate(names)], value=0),
                p.cmp_plot: gr.Plot(comparison_figure([r.trace for r in loaded], names) if several else None,
                                    visible=several),
                **p.show(tab.current)}

    p.upload.upload(on_upload, [p.upload, p.state], [p.state, p.status, p.pick, p.cmp_plot, *p.shown_outputs],
                    api_name="load_traces", concurrency_limit=None)

    def on_pick(index: int, tab: TracesTab | None):
        if tab is None or not isinstance(index, int) or not 0 <= index < len(tab.replays):
            return {}
        tab.current = tab.replays[index]
        tab.playing += 1
        return p.show(tab.current)

    p.pick.input(on_pick, [p.pick, p.state], p.shown_outputs, api_name="show_trace", concurrency_limit=None)


def _wire_replay(p: _Page) -> None:
    """The step slider (seek), Play and Pause."""

    def on_seek(shown: int, tab: TracesTab | None):
        if tab is None or tab.current is None:
            return {}
        tab.playing += 1
        shown = max(0, min(int(shown), tab.current.n_steps))
        return {p.trajectory: tab.current.trajectory.frame(shown), p.metrics: tab.current.trajectory.metrics(shown)}

    # a drag ends in `release`; a number typed into the slider's box (Enter, or leaving it) arrives as `input`, which
    # a replay's own frames never send
    gr.on([p.step.release, p.step.input], on_seek, [p.step, p.state], [p.trajectory, p.metrics],
          api_name="replay_seek", concurrency_limit=None, trigger_mode="always_last")

    def on_play(shown: int, steps_per_s: float, tab: TracesTab | None):
        """Advance the replay from the slider's position (from the start when at the end), `steps_per_s`
        steps a second in at most FPS frames a second, until the end or until paused."""
        if tab is None or tab.current is None:
            return
        tab.playing += 1
        me, replay = tab.playing, tab.current
        shown = 0 if shown >= replay.n_steps else int(shown)
        per_frame = max(1, math.ceil(steps_per_s / FPS))
        while shown < replay.n_steps and tab.playing == me:
            shown = min(replay.n_steps, shown + per_frame)
            yield {p.trajectory: replay.trajectory.frame(shown), p.step: shown,
                   p.metrics: replay.trajectory.metrics(shown)}
            time.sleep(per_frame / steps_per_s)

    p.play.click(on_play, [p.step, p.speed, p.state], [p.trajectory, p.step, p.metrics], api_name="play",
                 show_progress="hidden", concurrency_limit=None)

    def on_pause(tab: TracesTab | None) -> None:
        if tab is not None:
            tab.playing += 1

    p.pause.click(on_pause, p.state, None, api_name="pause", concurrency_limit=None)


def _wire_inspector(p: _Page) -> None:
    """A cell clicked in the trajectory explains itself in the inspector."""

    def on_cell(tab: TracesTab | None, evt: gr.EventData):
        replay = tab.current if tab else None
        return render.inspector_html(replay.trajectory.view.grid if replay else None, components.clicked_position(evt),
                                     replay.name if replay else "")

    p.trajectory.inspect(on_cell, p.state, p.inspector, api_name="inspect_trace", concurrency_limit=None)


def _wire_download(p: _Page, downloads: Downloads) -> None:
    """The trace shown, in the format picked."""

    def on_download(tab: TracesTab | None, label: str):
        if tab is None or tab.current is None:
            return None, render.note_html("upload a trace first", "error")
        replay = tab.current
        path = downloads.write(replay.trace, DOWNLOADS[label], replay.name.removesuffix(".jsonl"))
        return gr.File(str(path), visible=True), ""

    p.prepare.click(on_download, [p.state, p.fmt], [p.download, p.status], api_name="download_trace",
                    concurrency_limit=None)


def _same_tokenizer(header: dict, engine) -> bool:
    """Whether a trace was made with this page's tokenizer (then it can name the ids the trace never emitted)."""
    ours = engine.tokenizer_meta()
    return all(header["tokenizer"].get(k) == ours[k] for k in ("name", "vocab_size"))

"""The Analysis tab: upload traces (and, for the calibration of a canvas run's confidence, the exact run's trace)
and see what `dlm-studio trace analyze` shows: acceptance by slot, position, target entropy and draft probability,
the calibration, tokens per forward by role, where the time went; or a `bench --task --sweep --json` report and see
its accuracy-TPF curves with each strategy's AUP. Files are read by the trace reader or as JSON only (a bad one is
a message); every text from a file is escaped by the figures."""
from __future__ import annotations

import json

import gradio as gr

from studio.errors import BadInput
from studio.files import read_user_text
from studio.traces import analysis
from studio.traces.export.analysis_html import analysis_body
from studio.web import render
from studio.web.files import read_upload


def build() -> None:
    uploads = gr.File(label="Traces to analyse (.jsonl)", file_count="multiple", file_types=[".jsonl"],
                      elem_id="analysis-upload")
    reference = gr.File(label="Reference run (optional: the exact run the unmasking confidence is checked against)",
                        file_count="single", file_types=[".jsonl"], elem_id="analysis-reference")
    status = gr.HTML(elem_id="analysis-status")
    report = gr.HTML(elem_id="analysis-report")
    bench = gr.File(label="A bench report (.json, from bench --task T --sweep KEY=V1,V2 --json): its accuracy-TPF "
                    "curves", file_count="single", file_types=[".json"], elem_id="analysis-bench")
    bench_status = gr.HTML(elem_id="analysis-bench-status")
    curves = gr.Plot(label="Accuracy under parallelism", visible=False, elem_id="analysis-curves")

    def on_change(paths: list[str] | None, reference_path: str | None):
        problems, loaded = [], []
        for path in paths or []:
            try:
                loaded.append(read_upload(path))
            except BadInput as e:
                problems.append(str(e))
        ref = None
        if reference_path:
            try:
                ref = read_upload(reference_path)[1]
            except BadInput as e:
                problems.append(f"reference: {e}")
        if not loaded:
            return render.note_html("; ".join(problems) or "upload one or more traces", "error" if problems
                                    else "info"), ""
        names = [name.removesuffix(".jsonl") for name, _ in loaded]
        body = analysis_body(names, [analysis.analyze(t, ref) for _, t in loaded])
        note = f"analysed {len(loaded)} trace(s)" + (f"; skipped: {'; '.join(problems)}" if problems else "")
        return render.note_html(note, "error" if problems else "info"), f'<div class="analysis">{body}</div>'

    gr.on([uploads.change, reference.change], on_change, [uploads, reference], [status, report],
          api_name="analyze_traces", concurrency_limit=None)

    def on_bench(path: str | None):
        from studio.viz.figures import parallelism_figure
        if not path:
            return "", gr.Plot(None, visible=False)
        name = path.rsplit("/", 1)[-1]
        try:
            report = json.loads(read_user_text(path, what="bench report"))
            figure = parallelism_figure(report)
        except BadInput:
            return render.note_html(f"{name}: not UTF-8 text", "error"), gr.Plot(None, visible=False)
        except ValueError:
            return render.note_html(f"{name}: not JSON", "error"), gr.Plot(None, visible=False)
        except (KeyError, TypeError, AttributeError):
            return (render.note_html(f"{name}: no accuracy curves (a report of bench --task T --sweep ... --json)",
                                     "error"), gr.Plot(None, visible=False))
        return (render.note_html(f"{name}: {len(report['aup'])} curve(s) on {report['task']['name']}"),
                gr.Plot(figure, visible=True))

    bench.change(on_bench, bench, [bench_status, curves], api_name="bench_curves", concurrency_limit=None)

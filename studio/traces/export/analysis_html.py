"""The HTML page of `trace analyze`: a table of the runs' headline numbers, then every analysis figure
(studio.viz.analysis_figures), self-contained and script-free like the trace report; every trace text escaped."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Mapping, Sequence

from studio.files import atomic_write
from studio.traces.export.style import CSS
from studio.viz.analysis_figures import analysis_svgs


def analysis_page(labels: Sequence[str], analyses: Sequence[Mapping[str, Any]], title: str = "trace analysis") -> str:
    esc = html.escape
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{CSS} .grid2 svg {{ max-width: 100%; height: auto; }}</style>"
            f"</head><body><main><h1>{esc(title)}</h1><div class='sub'>dlm-studio trace analyze: {len(labels)} "
            f"run(s); every number from the traces' events</div>{analysis_body(labels, analyses)}</main></body></html>")


def analysis_body(labels: Sequence[str], analyses: Sequence[Mapping[str, Any]]) -> str:
    """The runs' headline table and every figure, as one HTML fragment (the page's body; the web Analysis tab)."""
    esc = html.escape
    rows = "".join(
        f"<tr><td>{esc(label)}</td><td>{esc(str(a['strategy']))}</td><td class='num'>{a['tokens']}</td>"
        f"<td class='num'>{a['forwards']}</td><td class='num'>{_num(a['tpf'], '.2f')}</td>"
        f"<td class='num'>{a['verified']}</td><td class='num'>{_num(a['rate'], '.0%')}</td></tr>"
        for label, a in zip(labels, analyses))
    table = ("<table class='cmp'><tr><th>run</th><th>strategy</th><th>tokens</th><th>forwards</th><th>TPF</th>"
             f"<th>verified</th><th>accepted</th></tr>{rows}</table>")
    figures = "".join(f"<div class='card'>{svg}</div>" for svg in analysis_svgs(labels, analyses))
    return f"<div class='card'>{table}</div><div class='grid2'>{figures}</div>"


def write_analysis_html(labels: Sequence[str], analyses: Sequence[Mapping[str, Any]], path, title: str) -> Path:
    path = Path(path)
    with atomic_write(path) as f:   # renamed into place: never half a page
        f.write(analysis_page(labels, analyses, title))
    return path


def _num(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)

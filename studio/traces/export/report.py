"""HTML export: a self-contained report, one light file that opens offline (its figures are static SVG,
`studio.viz.svg`: no script at all). For several runs a comparison table and figures come first, then for
each run its header, metrics, diagnostics, the generated text coloured by provenance, and its figures.
"""
from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from studio.events import SCHEMA, Trace
from studio.traces.export.common import ensure_writable, open_for_write
from studio.traces.export.style import CSS
from studio.viz import svg
from studio.viz.grid import build_grid, show_text
from studio.viz.palette import DECORATION, INK, PALETTE, State, legend_kind, legend_text, tint
from studio.viz.stats import acceptance, diagnostics, kind_counts


def _esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _num(v: Any, fmt: str) -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and not math.isfinite(v):
        return "—"
    return format(v, fmt)


def _state_css() -> str:
    rules = []
    for s in State:
        col = PALETTE[s][0]
        bg = "transparent" if s in (State.EMPTY, State.COMMITTED) else tint(col, 0.62)
        deco = DECORATION[s]
        line = f"text-decoration: {deco}; text-decoration-color: {col};" if deco != "none" else ""
        rules.append(f".st-{s.value} {{ background: {bg}; {line} }}")
        rules.append(f".sw.st-{s.value} {{ background: {col}; color: {INK[s]}; text-decoration: none; }}")
    return "\n".join(rules)


def _text_legend() -> str:
    items = []
    for s in (State.COMMITTED, State.ACCEPTED, State.BONUS, State.RESAMPLED, State.UNMASKED, State.EDITED):
        glyph = PALETTE[s][1]
        sample = {State.COMMITTED: "plain target token", State.ACCEPTED: "accepted draft",
                  State.BONUS: "bonus token", State.RESAMPLED: "correction after a reject",
                  State.UNMASKED: "filled by diffusion", State.EDITED: "edited (T2T)"}[s]
        items.append(f'<span><span class="sw st-{s.value}">{glyph}</span><span class="st-{s.value}">{_esc(sample)}</span>'
                     f"</span>")
    return '<div class="legend">' + "".join(items) + "</div>"


def _generated_html(grid: Any) -> str:
    parts = []
    for seg in grid.segments:
        ps = seg.positions
        tips = [f"pos {ps[0]}" if len(ps) == 1 else f"pos {ps[0]}–{ps[-1]}" if ps else "", f"step {seg.step}",
                seg.state.value]
        if len(ps) == 1:
            c = grid.final.get(ps[0])
            if c is not None:
                tips.append(f"token {c.tok} {show_text(c.text)}")
                for k, v in (("p", c.p), ("q", c.q), ("conf", c.conf)):
                    if v is not None:
                        tips.append(f"{k}={v:.3g}")
        parts.append(f'<span class="st-{seg.state.value}" title="{_esc(" · ".join(x for x in tips if x))}">'
                     f"{_esc(seg.text)}</span>")
    return "".join(parts) or '<span class="sub">(no tokens)</span>'


def _header_table(h: Mapping[str, Any]) -> str:
    model, tok, prompt = h.get("model", {}), h.get("tokenizer", {}), h.get("prompt", {})
    params = "".join(f'<span class="chip mono">{_esc(k)}={_esc(json.dumps(v))}</span>'
                     for k, v in (h.get("params") or {}).items())
    rows = [
        ("strategy", f"<b>{_esc(h.get('strategy'))}</b>"),
        ("model", f"{_esc(model.get('name'))} ({_esc(model.get('arch'))}, {_esc(model.get('dtype'))}, "
                  f"{_esc(model.get('device'))})" + (f" + adapter <code>{_esc(model.get('adapter'))}</code>"
                                                      if model.get("adapter") else "")),
        ("tokenizer", f"{_esc(tok.get('name'))} · vocab {_esc(tok.get('vocab_size'))} · eos {_esc(tok.get('eos_ids'))}"
                      f" · mask {_esc(tok.get('mask_id'))}"),
        ("seed", _esc(h.get("seed"))),
        ("params", params or "—"),
        ("prompt", f'<div class="prompt mono">{_esc(prompt.get("text"))}</div>'
                   f'<span class="sub">{len(prompt.get("token_ids") or [])} tokens</span>'),
        ("run", " · ".join(x for x in (f'<span class="mono">{_esc(h["run_id"])}</span>' if h.get("run_id") else "",
                                       _esc(h.get("created")), _esc(h.get("schema"))) if x)
         or '<span class="sub">not saved as a trace file</span>'),
    ]
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _metrics_table(m: Mapping[str, Any], counts: Mapping[str, int]) -> str:
    abp = m.get("accept_by_pos") or []
    rows = [
        ("stop reason", _esc(m.get("stop_reason"))),
        ("tokens", _num(m.get("n_tokens"), "d")),
        ("forwards", _num(m.get("forwards"), "d")),
        ("TPF (tokens / forward)", _num(m.get("tpf"), ".3f")),
        ("acceptance rate", _num(m.get("accept_rate"), ".1%")
         + (f' <span class="sub">({m["verified"]} verified)</span>' if m.get("verified") else "")),
        ("mean acceptance length", _num(m.get("mean_acceptance_length"), ".2f")),
        ("acceptance by slot", " ".join(f"{x:.0%}" for x in abp) or "—"),
        ("decode speed (tok/s)", _num(m.get("tok_s"), ".1f")),
        ("wall time (s)", _num(m.get("wall_s"), ".3f")),
        ("prefill (s)", _num(m.get("prefill_s"), ".3f")),
    ]
    body = "".join(f'<tr><th>{k}</th><td class="num">{v}</td></tr>' for k, v in rows)
    ev = " ".join(f'<span class="chip">{_esc(k)} {n}</span>' for k, n in sorted(counts.items()))
    return f'<table class="metrics">{body}<tr><th>events</th><td>{ev}</td></tr></table>'


def _comparison_table(traces: Sequence[Trace], labels: Sequence[str], metrics: Sequence[Mapping[str, Any]]) -> str:
    base = next((i for i, t in enumerate(traces) if t.header.get("strategy") == "ar"), None)
    head = ["run", "tokens", "forwards", "TPF", "acceptance", "mean AL", "tok/s", "wall s", "stop"]
    if base is not None:
        head += ["speed vs ar", "same text as ar"]
    rows = []
    for lab, m in zip(labels, metrics):
        cells = [f"<b>{_esc(lab)}</b>", _num(m.get("n_tokens"), "d"), _num(m.get("forwards"), "d"),
                 _num(m.get("tpf"), ".3f"), _num(m.get("accept_rate"), ".1%"),
                 _num(m.get("mean_acceptance_length"), ".2f"), _num(m.get("tok_s"), ".1f"),
                 _num(m.get("wall_s"), ".3f"), _esc(m.get("stop_reason"))]
        if base is not None:
            b = metrics[base]
            sp = (m["tok_s"] / b["tok_s"]) if m.get("tok_s") and b.get("tok_s") else None
            cells.append(_num(sp, ".2f") + ("×" if sp is not None else ""))
            cells.append("yes" if m.get("text") == b.get("text") else "no")
        rows.append("<tr>" + "".join(f'<td class="{"num" if j else ""}">{c}</td>' for j, c in enumerate(cells))
                    + "</tr>")
    return ('<table class="cmp"><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows)
            + "</table>")


def _figures(*figures: str) -> str:
    return '<div class="fig">' + "".join(figures) + "</div>"


def _run_html(t: Trace, m: Mapping[str, Any], token_text: Any) -> list[str]:
    """One run's part of the report: its header, metrics, diagnostics, generated text and figures."""
    grid = build_grid(t.header, t.events, token_text)
    body = []
    if t.footer is None:
        body.append('<div class="banner">This trace is <b>truncated</b> (no footer: the run did not finish). '
                    "Metrics below are computed from the events that were written; timings are unknown.</div>")
    body.append('<div class="grid2"><div class="card"><h3>Run</h3>' + _header_table(t.header) + "</div>"
                '<div class="card"><h3>Metrics</h3>' + _metrics_table(m, kind_counts(t.events)) + "</div></div>")
    notes = diagnostics(t.events, t.header.get("strategy"))
    if notes:
        body.append('<div class="card"><h3>Diagnostics</h3><ul class="notes">'
                    + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul></div>")
    body.append('<div class="card"><h3>Generated text</h3>' + _text_legend()
                + f'<div class="gen">{_generated_html(grid)}</div></div>')
    body.append('<div class="fig wide">' + svg.trajectory_svg(grid) + "</div>")
    body.append(_figures(svg.tpf_svg(t.events, t.footer)))
    if acceptance(t.events).verified:
        body.append(_figures(svg.acceptance_svg(t.events), svg.acceptance_length_svg(t.events)))
    else:
        body.append(f'<div class="card sub">No drafts were verified in this run ({_esc(t.header.get("strategy"))}),'
                    " so there are no acceptance figures.</div>")
    return body


def html_report(traces: Sequence[Trace] | Trace, path: str | os.PathLike, title: str | None = None, *,
                token_text: Any = None, labels: Sequence[str] | None = None) -> Path:
    """The report of one run or a comparison of several (see the module docstring). `labels` names the
    runs (default: the strategy names, numbered when one repeats), e.g. the preset names a comparison ran."""
    from studio.viz.figures import trace_metrics, unique_labels   # studio.viz.figures imports plotly

    if isinstance(traces, Trace):
        traces = [traces]
    traces = list(traces)
    path = Path(path)
    ensure_writable(path)
    if labels is None:
        labels = unique_labels(traces)
    elif len(labels) != len(traces):
        raise ValueError(f"{len(labels)} labels for {len(traces)} traces")
    labels = list(labels)
    if title is None:
        title = ("dlm-studio trace: " + labels[0]) if len(traces) == 1 else f"dlm-studio comparison: {', '.join(labels)}"
    metrics = [trace_metrics(t) for t in traces]
    body: list[str] = [f"<h1>{_esc(title)}</h1>",
                       f'<div class="sub">{len(traces)} run(s) · schema {_esc(SCHEMA)} · glyph legend: '
                       f"{_esc(legend_text(legend_kind(['canvas' in t.header for t in traces])))}</div>"]
    if len(traces) > 1:
        body += ["<h2>Comparison</h2>", '<div class="card">', _comparison_table(traces, labels, metrics), "</div>",
                 _figures(*svg.comparison_svgs(traces, labels, metrics))]
    for lab, t, m in zip(labels, traces, metrics):
        if len(traces) > 1:
            body.append(f"<h2>{_esc(lab)}</h2>")
        body += _run_html(t, m, token_text)
    body.append("<footer>Generated by dlm-studio from the JSONL event trace alone. Hover a trajectory cell for its "
                "token, p, q, min(1, p/q) and confidence, and a bar for its numbers.</footer>")
    doc = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
           f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_esc(title)}</title>'
           f"<style>{CSS}\n{_state_css()}</style></head><body><main>{''.join(body)}</main></body></html>\n")
    with open_for_write(path) as f:
        f.write(doc)
    return path

"""Plotly figures of a trace: trajectory heatmap, TPF over steps, acceptance by draft slot, acceptance
length histogram, and a comparison of several runs. Inputs are trace parts (header, events, footer)
or `studio.events.Trace` objects only; nothing here imports the engine.
"""
from __future__ import annotations

import html
import math
from pathlib import PurePath
from typing import Any, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from studio.events import summarize
from studio.viz.grid import Cell, Grid, TokenText, build_grid, visible_token
from studio.viz.palette import (CANVAS_LABELS, CANVAS_STATES, DRAFT_STATES, HELD_GLYPH, HOLDS, OKABE_ITO, PALETTE,
                                RUN_COLORS, State, fill, tint)
from studio.viz.stats import acceptance, progress, stalled_steps

FONT = "Inter, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
_BASE_LAYOUT = dict(template="plotly_white", font=dict(family=FONT, size=13, color="#222222"),
                    margin=dict(l=70, r=30, t=60, b=50), hoverlabel=dict(font=dict(family="monospace", size=12)))

# Heatmap levels: each (state, held) gets one discrete colour.
_LEVELS: list[tuple[State, bool]] = [(State.PROPOSED, False), (State.ACCEPTED, False), (State.REJECTED, False),
                                     (State.RESAMPLED, False), (State.BONUS, False), (State.UNMASKED, False),
                                     (State.UNMASKED, True), (State.COMMITTED, False), (State.EDITED, False),
                                     (State.EDITED, True), (State.NOISE, False), (State.MASKED, False),
                                     (State.PADDING, False)]
_LEVEL = {k: i for i, k in enumerate(_LEVELS)}
# The bulk of a long run, drawn as a plain background layer (no glyph; hover only on small grids): positions
# committed at an earlier step, and a canvas's cells that nothing touched (still masked, or padding).
_BACKGROUND = (State.COMMITTED, State.MASKED, State.PADDING)
_ROLE_COLORS = {"prefill": "#9E9E9E", "cold": OKABE_ITO["sky_blue"], "verify": OKABE_ITO["blue"],
                "draft": OKABE_ITO["orange"], "target": OKABE_ITO["bluish_green"], "commit": "#616161",
                "jacobi": OKABE_ITO["reddish_purple"], "extend": OKABE_ITO["vermillion"]}


def short_token(text: str | None, tok: int | None = None, limit: int = 9) -> str:
    """A token for an axis label (`visible_token`, HTML-escaped)."""
    return html.escape(visible_token(text, tok, limit))


def run_label(header: Mapping[str, Any]) -> str:
    """`strategy · model + adapter`, the adapter by its folder's name (a trace holds its path on the machine
    that ran it)."""
    model = header.get("model", {})
    adapter = f" + {PurePath(model['adapter']).name}" if model.get("adapter") else ""
    return f"{header.get('strategy', '?')} · {model.get('name', '?')}{adapter}"


def _title(text: str, header: Mapping[str, Any] | None) -> dict[str, Any]:
    sub = f"<br><sup>{html.escape(run_label(header))}</sup>" if header else ""
    return dict(text=f"{text}{sub}", x=0.01, xanchor="left")


def _empty_note(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(size=14, color="#666666"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


# -- trajectory heatmap -----------------------------------------------------------------------------
def trajectory_figure(header: Mapping[str, Any] | None, events: Sequence[Mapping[str, Any]],
                      footer: Mapping[str, Any] | None = None, *, token_text: TokenText | None = None,
                      grid: Grid | None = None, max_glyph_cells: int = 8000,
                      max_hover_cells: int = 40_000) -> go.Figure:
    """Steps (rows, top to bottom) × output positions (columns); each cell coloured by its state,
    with the state's glyph in it and a hover with token, p, q, min(1, p/q), confidence."""
    g = grid or build_grid(header, events, token_text)
    fig = go.Figure()
    fig.update_layout(**_BASE_LAYOUT, title=_title("Decoding trajectory: steps × output positions", header))
    if not g.steps or not g.n_pos:
        return _empty_note(fig, "no tokens in this trace")
    n_rows = len(g.steps)
    row_px = 20 if n_rows <= 60 else max(4, min(20, 1300 // n_rows))
    show_glyphs = n_rows * g.n_pos <= max_glyph_cells and row_px >= 12
    _add_cell_layers(fig, g, row_px, show_glyphs, hover_background=n_rows * g.n_pos <= max_hover_cells)
    _add_state_legend(fig, g)
    last = g.steps[-1]
    for span in g.blocks:
        y1 = span.close_step if span.close_step is not None else last
        fig.add_shape(type="rect", x0=span.start - 0.5, x1=min(span.end, g.n_pos) - 0.5, y0=span.open_step - 0.5,
                      y1=y1 + 0.5, line=dict(color="#333333", width=1.5, dash="dot"), fillcolor="rgba(0,0,0,0)")
    _label_axes(fig, g)
    fig.update_layout(height=max(340, row_px * n_rows + 240), plot_bgcolor="#FFFFFF",
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0.0,
                                  font=dict(size=13), itemsizing="constant"),
                      margin=dict(l=90, r=45, t=130, b=110 if g.n_pos <= 80 and g.final else 50))
    return fig


def _cell_hover(c: Cell) -> str:
    return "<br>".join(html.escape(line) for line in c.describe())


def _cell_layers(g: Grid, show_glyphs: bool, hover_background: bool) -> dict[str, Any]:
    """The two layers' z levels, glyphs and hovers: the background (committed cells carried over from earlier
    steps, a canvas's untouched masked and padding cells: the bulk of a long run) and the cells where something
    happens (glyph + hover). The background's hover is left out of big grids (`hover_background` False)."""
    n_rows, n_pos = len(g.steps), g.n_pos
    row_of = {s: i for i, s in enumerate(g.steps)}
    heads = {s: f"<b>step {s}</b>" + (f" · {g.rows[s].role}" if g.rows[s].role else "") for s in g.steps}
    bg_z = np.full((n_rows, n_pos), np.nan, dtype=np.float32)  # float32: half the size in the HTML
    fg_z = np.full((n_rows, n_pos), np.nan, dtype=np.float32)
    text = [[""] * n_pos for _ in range(n_rows)]
    hover = [[""] * n_pos for _ in range(n_rows)]
    bg_hover = [[""] * n_pos for _ in range(n_rows)] if hover_background else None
    described: dict[int, str] = {}   # background cells are shared between steps: describe each once
    for (step, pos), c in g.cells.items():
        i = row_of[step]
        if c.state in _BACKGROUND and not c.emitted and not c.kinds:
            bg_z[i, pos] = _BACKGROUND.index(c.state)
            if bg_hover is not None:
                d = described.get(id(c))
                if d is None:
                    d = described[id(c)] = _cell_hover(c)
                bg_hover[i][pos] = f"{heads[step]} · pos {pos}<br>{d}"
            continue
        fg_z[i, pos] = _LEVEL[(c.state, c.held and c.state in HOLDS)]
        if show_glyphs:
            text[i][pos] = c.glyph
        hover[i][pos] = f"{heads[step]} · pos {pos}<br>" + _cell_hover(c)
    return dict(bg_z=bg_z, fg_z=fg_z, text=text, hover=hover, bg_hover=bg_hover)


def _add_cell_layers(fig: go.Figure, g: Grid, row_px: int, show_glyphs: bool, hover_background: bool) -> None:
    """The grid as two heatmaps, the background under the cells where something happens."""
    layers = _cell_layers(g, show_glyphs, hover_background)
    xs = list(range(g.n_pos))
    xgap = 1 if g.n_pos <= 300 else 0     # gaps would eat sub-pixel cells of long runs
    ygap = 1 if row_px >= 8 else 0
    nb = len(_BACKGROUND)
    bg_scale = [[(i + k) / nb, PALETTE[s][0]] for i, s in enumerate(_BACKGROUND) for k in (0, 1)]
    bg_hover = (dict(hovertext=layers["bg_hover"], hovertemplate="%{hovertext}<extra></extra>") if hover_background
                else dict(hoverinfo="skip"))
    fig.add_trace(go.Heatmap(
        z=layers["bg_z"], x=xs, y=g.steps, colorscale=bg_scale, zmin=-0.5, zmax=nb - 0.5,
        showscale=False, xgap=xgap, ygap=ygap, hoverongaps=False, name="committed", **bg_hover))
    n = len(_LEVELS)
    scale = []
    for i, (state, held) in enumerate(_LEVELS):
        col = fill(state, held)
        scale += [[i / n, col], [(i + 1) / n, col]]
    glyphs = (dict(text=layers["text"], texttemplate="%{text}", textfont=dict(size=13 if row_px >= 16 else 9))
              if show_glyphs else {})
    fig.add_trace(go.Heatmap(
        z=layers["fg_z"], x=xs, y=g.steps, **glyphs,
        hovertext=layers["hover"], hovertemplate="%{hovertext}<extra></extra>",
        colorscale=scale, zmin=-0.5, zmax=n - 0.5, showscale=False, xgap=xgap, ygap=ygap, hoverongaps=False,
        name="cells"))


def _add_state_legend(fig: go.Figure, g: Grid) -> None:
    """A legend with the glyphs (colour is never the only cue): a run's own states (a canvas run's or a drafting
    run's), and the held and canvas ones only where they occur."""
    present = {(c.state, c.held and c.state in HOLDS) for c in g.cells.values()}
    usual = {(s, False) for s in (CANVAS_STATES if g.canvas else DRAFT_STATES)}
    for state, held in _LEVELS:
        if (state, held) not in present and (state, held) not in usual:
            continue
        col = fill(state, held)
        glyph = HELD_GLYPH if held and state is State.UNMASKED else PALETTE[state][1]
        name = (f"{PALETTE[state][2].split(' (')[0]}, held in block" if held else
                CANVAS_LABELS.get(state, PALETTE[state][2]) if g.canvas else PALETTE[state][2])
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"{glyph}  {name}",
                                 marker=dict(symbol="square", size=15, color=col, line=dict(color="#555555", width=1)),
                                 hoverinfo="skip", showlegend=True))


def _label_axes(fig: go.Figure, g: Grid) -> None:
    """Step rows labelled with their forward role and the tokens they emitted (short runs), position columns with
    their final token (short outputs)."""
    if len(g.steps) <= 60:
        ticktext = [f"{s} {g.rows[s].role or ''}".rstrip() for s in g.steps]
        fig.update_yaxes(tickmode="array", tickvals=g.steps, ticktext=ticktext)
        for s in g.steps:
            k = len(g.rows[s].emitted)
            if k:
                fig.add_annotation(x=1.0, xref="paper", xanchor="left", y=s, yref="y", text=f" +{k}",
                                   showarrow=False, font=dict(size=11, color="#444444"))
    fig.update_yaxes(title_text="step (forward)", autorange="reversed", showgrid=False, zeroline=False)
    fig.update_xaxes(title_text="output position", showgrid=False, zeroline=False, side="bottom",
                     range=[-0.5, g.n_pos - 0.5])
    if g.n_pos <= 80 and g.final:
        # each column labelled with its position and final token (whitespace made visible)
        ticks = [f"{p} {short_token(g.final[p].text, g.final[p].tok)}" if p in g.final else str(p)
                 for p in range(g.n_pos)]
        fig.update_xaxes(tickmode="array", tickvals=list(range(g.n_pos)), ticktext=ticks, tickangle=-60,
                         tickfont=dict(family="DejaVu Sans Mono, Menlo, Consolas, monospace", size=11),
                         title_text="output position and final token")


# -- TPF over steps ---------------------------------------------------------------------------------
def tpf_figure(header: Mapping[str, Any] | None, events: Sequence[Mapping[str, Any]],
               footer: Mapping[str, Any] | None = None) -> go.Figure:
    """Tokens emitted by each forward (bars, coloured by forward role) and the running TPF (line).
    One y axis: both are tokens per forward (a step is one forward)."""
    pts = progress(events)
    fig = go.Figure()
    fig.update_layout(**_BASE_LAYOUT, title=_title("Tokens per forward", header))
    if not pts:
        return _empty_note(fig, "no events")
    roles = list(dict.fromkeys(p.role or "(none)" for p in pts))
    for role in roles:
        sel = [p for p in pts if (p.role or "(none)") == role]
        if not any(p.emitted for p in sel):
            continue  # e.g. diffusion draft forwards: their tokens show as "unmasked" below
        fig.add_trace(go.Bar(
            x=[p.step for p in sel], y=[p.emitted for p in sel], name=f"emitted by a {role} forward",
            marker=dict(color=_ROLE_COLORS.get(role, "#888888"), line=dict(width=0)),
            customdata=[[p.wall_ms or 0.0, p.tokens] for p in sel],
            hovertemplate="step %{x}<br>%{y} token(s) emitted<br>forward %{customdata[0]:.1f} ms"
                          "<br>total %{customdata[1]}<extra>" + role + "</extra>"))
    if any(p.unmasked for p in pts):
        fig.add_trace(go.Bar(
            x=[p.step for p in pts], y=[p.unmasked for p in pts], name="◆ unmasked in a block (emitted later)",
            marker=dict(color=tint(PALETTE[State.UNMASKED][0], 0.35), pattern=dict(shape="/", fgcolor="#FFFFFF"),
                        line=dict(width=0)),
            hovertemplate="step %{x}<br>%{y} token(s) unmasked, not yet emitted<extra></extra>"))
    stalled = stalled_steps(pts)
    if stalled:
        fig.add_trace(go.Scatter(x=[p.step for p in stalled], y=[0] * len(stalled), mode="markers",
                                 name="✗ forward with no progress", cliponaxis=False,
                                 marker=dict(symbol="x", size=12, color=OKABE_ITO["vermillion"],
                                             line=dict(width=1, color="#FFFFFF")),
                                 hovertemplate="step %{x}: a forward that changed nothing<extra></extra>"))
    run = [p for p in pts if p.tpf is not None]
    fig.add_trace(go.Scatter(x=[p.step for p in run], y=[p.tpf for p in run], mode="lines",
                             name="running TPF (tokens / forwards so far)", line=dict(color="#000000", width=2.5),
                             hovertemplate="step %{x}<br>running TPF %{y:.3f}<extra></extra>"))
    final = footer.get("tpf") if footer else (run[-1].tpf if run else None)
    if final is not None:   # its value in the title: a label on the line would sit on the bars
        fig.add_hline(y=final, line=dict(color="#000000", width=1, dash="dot"))
        fig.update_layout(title=_title(f"Tokens per forward · final TPF {final:.2f}", header))
    top = max([p.emitted + p.unmasked for p in pts] + [p.tpf for p in run] + [1])
    fig.update_yaxes(title_text="tokens per forward", range=[0, top * 1.18], rangemode="tozero")
    fig.update_xaxes(title_text="step (forward index)")
    fig.update_layout(height=420, barmode="stack", bargap=0.15, margin=dict(l=70, r=30, t=60, b=110),
                      legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="left", x=0.0))
    return fig


# -- acceptance -------------------------------------------------------------------------------------
def acceptance_by_position_figure(header: Mapping[str, Any] | None, events: Sequence[Mapping[str, Any]],
                                  footer: Mapping[str, Any] | None = None) -> go.Figure:
    """Acceptance rate per draft slot (slot k = k-th verified draft of a verify step)."""
    acc = acceptance(events)
    fig = go.Figure()
    fig.update_layout(**_BASE_LAYOUT, title=_title("Acceptance by draft position", header))
    if not acc.verified:
        return _empty_note(fig, "no drafts were verified in this run")
    xs = [f"slot {k + 1}" for k in range(len(acc.by_pos))]
    fig.add_trace(go.Bar(
        x=xs, y=acc.by_pos, marker=dict(color=PALETTE[State.ACCEPTED][0], line=dict(color="#333333", width=1)),
        text=[f"{r:.0%} ({a}/{v})" for r, a, v in zip(acc.by_pos, acc.accepted_by_pos, acc.verified_by_pos)],
        textposition="outside", hovertemplate="%{x}<br>accepted %{text}<extra></extra>", name="accept rate"))
    # the overall rate in the title: a label on its line would sit on the bars' labels
    fig.add_hline(y=acc.rate, line=dict(color="#000000", width=1, dash="dot"))
    fig.update_layout(title=_title(f"Acceptance by draft position · overall {acc.rate:.0%}", header))
    fig.update_yaxes(title_text="accepted / verified", range=[0, 1.15], tickformat=".0%")
    fig.update_xaxes(title_text="draft slot (in verification order)")
    fig.update_layout(height=340, showlegend=False)
    return fig


def acceptance_length_figure(header: Mapping[str, Any] | None, events: Sequence[Mapping[str, Any]],
                             footer: Mapping[str, Any] | None = None) -> go.Figure:
    """Histogram over verify steps of the number of drafts accepted in that step."""
    acc = acceptance(events)
    fig = go.Figure()
    al = acc.mean_acceptance_length
    fig.update_layout(**_BASE_LAYOUT, title=_title("Accepted drafts per verify step", header))
    if al is not None:
        fig.add_annotation(text=f"mean acceptance length {al:.2f}<br>(accepted + 1 correction/bonus)",
                           xref="paper", yref="paper", x=1.0, y=1.0, xanchor="right", yanchor="top",
                           showarrow=False, align="right", font=dict(size=12, color="#333333"))
    if not acc.verify_steps:
        return _empty_note(fig, "no verify steps in this run")
    hist = acc.histogram()
    fig.add_trace(go.Bar(x=list(hist), y=list(hist.values()), text=list(hist.values()), textposition="outside",
                         marker=dict(color=OKABE_ITO["blue"], line=dict(color="#333333", width=1)),
                         hovertemplate="%{x} accepted<br>%{y} verify step(s)<extra></extra>"))
    fig.update_xaxes(title_text="drafts accepted in one verify step", dtick=1)
    top = max(hist.values())
    fig.update_yaxes(title_text="verify steps", range=[0, top * 1.2 + 0.5], dtick=max(1, math.ceil(top / 6)))
    fig.update_layout(height=340, showlegend=False)
    return fig


# -- several runs -----------------------------------------------------------------------------------
def trace_metrics(trace: Any) -> dict[str, Any]:
    """Footer metrics (computed from events when the trace is truncated) plus mean acceptance length."""
    m = dict(summarize(trace.events))
    if trace.footer:
        m.update({k: v for k, v in trace.footer.items() if k != "kind"})
    else:
        m.update(stop_reason="truncated", wall_s=None, tok_s=None, prefill_s=None)
    acc = acceptance(trace.events)
    m["mean_acceptance_length"] = acc.mean_acceptance_length
    m["verified"] = acc.verified
    if not acc.verified:
        m["accept_rate"] = None  # nothing was verified: a rate of 0 would read as "every draft rejected"
    return m


def unique_labels(traces: Sequence[Any]) -> list[str]:
    labels = [t.header.get("strategy", "?") for t in traces]
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        if labels.count(lab) > 1:
            seen[lab] = seen.get(lab, 0) + 1
            lab = f"{lab} #{seen[lab]}"
        out.append(lab)
    return out


def comparison_figure(traces: Sequence[Any], labels: Sequence[str] | None = None) -> go.Figure:
    """TPF, acceptance and tok/s bars per run, and cumulative tokens vs forwards (one line per run).
    `labels` names the runs (default: the strategy names, numbered when one repeats)."""
    labels = list(labels) if labels is not None else unique_labels(traces)
    metrics = [trace_metrics(t) for t in traces]
    colors = [RUN_COLORS[i % len(RUN_COLORS)] for i in range(len(traces))]
    fig = make_subplots(rows=2, cols=2, vertical_spacing=0.16, horizontal_spacing=0.1,
                        subplot_titles=("Tokens per forward (TPF)", "Draft acceptance rate",
                                        "Decode speed (tok/s)", "Tokens vs forwards"))
    fig.update_layout(**_BASE_LAYOUT)
    fig.update_layout(title=dict(text="Comparison", x=0.01, xanchor="left"))

    def bars(key: str, row: int, col: int, fmt: str) -> None:
        ys = [m.get(key) for m in metrics]
        fig.add_trace(go.Bar(x=labels, y=[y if y is not None else 0 for y in ys], marker_color=colors,
                             text=["n/a" if y is None else format(y, fmt) for y in ys], textposition="outside",
                             showlegend=False, hovertemplate="%{x}<br>%{text}<extra>" + key + "</extra>"),
                      row=row, col=col)
        top = max([y for y in ys if y is not None] + [1e-9])
        fig.update_yaxes(range=[0, top * 1.25], row=row, col=col)

    bars("tpf", 1, 1, ".2f")
    bars("accept_rate", 1, 2, ".0%")
    bars("tok_s", 2, 1, ".1f")
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    top = 1
    for lab, t, c in zip(labels, traces, colors):
        pts = progress(t.events)
        xs = [0] + [p.forwards for p in pts]
        ys = [pts[0].tokens - pts[0].emitted if pts else 0] + [p.tokens for p in pts]
        top = max(top, xs[-1])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=lab, line=dict(color=c, width=2.5), line_shape="hv",
                                 hovertemplate=lab + "<br>%{x} forwards<br>%{y} tokens<extra></extra>"), row=2, col=2)
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="1 token / forward",
                             line=dict(color="#888888", dash="dot", width=1), hoverinfo="skip"), row=2, col=2)
    fig.update_xaxes(title_text="forwards (prefill excluded)", row=2, col=2)
    fig.update_yaxes(title_text="tokens emitted", row=2, col=2)
    fig.update_layout(height=720, legend=dict(orientation="h", yanchor="top", y=-0.08, xanchor="right", x=1.0))
    return fig


def accuracy_figure(report: dict) -> go.Figure:
    """`bench --task`: accuracy against speed vs ar, one point per strategy at its median speed (the min–max over
    questions in the hover and the table: on answers of a few tokens it spans far more than the medians differ) --
    the trade-off a lossy setting makes, and that lossless ones do not."""
    runs = report["strategies"]
    acc = [r["accuracy"] for r in runs]
    speed = [(r["speedup_vs_ar"] or {"median": 0})["median"] for r in runs] + [1.0]
    pad = 0.15 * (max(speed) - min(speed)) + 0.05   # room for the labels at either end
    fig = go.Figure()
    fig.update_layout(**_BASE_LAYOUT, title=f"Accuracy vs speed on {report['task']['name']}",
                      xaxis_title="speed vs ar (×, median over questions)", yaxis_title="accuracy",
                      xaxis_range=[min(speed) - pad, max(speed) + pad], yaxis_tickformat=".0%",
                      yaxis_range=[max(0.0, min(acc) - 0.15), min(1.05, max(acc) + 0.15)])
    places = ("top center", "bottom center", "middle right", "middle left")   # neighbours' labels apart
    for i, r in enumerate(runs):
        s = r["speedup_vs_ar"] or {"median": 0, "min": 0, "max": 0}
        fig.add_trace(go.Scatter(
            x=[s["median"]], y=[r["accuracy"]], mode="markers+text", name=r["label"], text=[r["label"]],
            textposition=places[i % len(places)], marker=dict(size=12, color=RUN_COLORS[i % len(RUN_COLORS)]),
            hovertemplate=(f"{r['label']}<br>%{{x:.2f}}× ar (questions: {s['min']:.2f}–{s['max']:.2f})"
                           "<br>accuracy %{y:.0%}<extra></extra>")))
    fig.add_vline(x=1.0, line_dash="dot", line_color="#555555")
    return fig


def parallelism_figure(report: dict) -> go.Figure:
    """`bench --task --sweep`: accuracy against tokens per forward, a curve per strategy through its settings (sorted
    by TPF), its AUP in the legend: the accuracy-parallelism trade-off d3LLM scores."""
    fig = go.Figure()
    fig.update_layout(**_BASE_LAYOUT, title=f"Accuracy under parallelism on {report['task']['name']}",
                      xaxis_title="tokens per forward (median over questions)", yaxis_title="accuracy",
                      yaxis_tickformat=".0%")
    for i, (curve, score) in enumerate(report["aup"].items()):
        runs = sorted((r for r in report["strategies"] if r["curve"] == curve), key=lambda r: r["tpf"]["median"])
        aup = "—" if score is None else f"{score:.2f}"
        fig.add_trace(go.Scatter(
            x=[r["tpf"]["median"] for r in runs], y=[r["accuracy"] for r in runs], mode="lines+markers+text",
            name=f"{curve} (AUP {aup})", text=[_setting(r["label"], curve) for r in runs], textposition="top center",
            customdata=[r["label"] for r in runs], marker=dict(size=10, color=RUN_COLORS[i % len(RUN_COLORS)]),
            hovertemplate="%{customdata}<br>TPF %{x:.2f}<br>accuracy %{y:.0%}<extra></extra>"))
    return fig


def _setting(label: str, curve: str) -> str:
    """What a swept run's label adds to its curve's: the setting a point of the curve stands for."""
    shared = set(curve.split(" · "))
    return " · ".join(part for part in label.split(" · ") if part not in shared)


def pareto_figure(points: Sequence[Mapping[str, Any]], chosen: int, title: str, x_title: str,
                  y_title: str) -> go.Figure:
    """`dlm-studio tune`: every trial (speed, quality), the Pareto front through the ones no other beats on both,
    and the chosen trial; a trial's parameters in its hover."""
    fig = go.Figure()
    fig.update_layout(**_BASE_LAYOUT, title=title, xaxis_title=x_title, yaxis_title=y_title)
    hover = [" · ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in p["params"].items())
             for p in points]
    fig.add_trace(go.Scatter(x=[p["speed"] for p in points], y=[p["quality"] for p in points], mode="markers",
                             name="trials", text=[f"trial {p['number']}: {h}" for p, h in zip(points, hover)],
                             marker=dict(size=9, color=RUN_COLORS[1]), hovertemplate="%{text}<extra></extra>"))
    front = sorted((p for p in points if p["front"]), key=lambda p: p["speed"])
    fig.add_trace(go.Scatter(x=[p["speed"] for p in front], y=[p["quality"] for p in front], mode="lines+markers",
                             name="Pareto front", line=dict(color=RUN_COLORS[0]), hoverinfo="skip"))
    best = next(p for p in points if p["number"] == chosen)
    fig.add_trace(go.Scatter(x=[best["speed"]], y=[best["quality"]], mode="markers", name=f"chosen: trial {chosen}",
                             marker=dict(size=16, symbol="star", color=RUN_COLORS[2]), hoverinfo="skip"))
    return fig


def bench_figure(report: dict) -> go.Figure:
    """`dlm-studio bench` at a glance: speed vs ar and TPF per strategy, bars at the median with
    min–max whiskers (the spread over prompts and repeats)."""
    runs = report["strategies"]
    labels = [r["label"] for r in runs]
    colors = [RUN_COLORS[i % len(RUN_COLORS)] for i in range(len(runs))]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("Speed vs ar (×, median with min–max whiskers)", "Tokens per forward"))
    fig.update_layout(**_BASE_LAYOUT)
    for col, key in ((1, "speedup_vs_ar"), (2, "tpf")):
        spreads = [r.get(key) or {"median": 0, "min": 0, "max": 0} for r in runs]
        med = [s["median"] for s in spreads]
        fig.add_trace(go.Bar(x=labels, y=med, marker_color=colors, showlegend=False,
                             text=[f"{m:.2f}" for m in med], textposition="outside",
                             error_y=dict(type="data", symmetric=False, array=[s["max"] - s["median"] for s in spreads],
                                          arrayminus=[s["median"] - s["min"] for s in spreads]),
                             hovertemplate="%{x}<br>%{text}<extra>" + key + "</extra>"), row=1, col=col)
    fig.add_hline(y=1.0, line_dash="dot", line_color="#555555", row=1, col=1)
    return fig

"""The HTML of the web studio's views, built from the grid model and step series of `studio.viz` (no
gradio here, so every view can be tested as a string).

Safety: every text that comes from a user, a model or a trace file (prompt, token, message, label) goes
through `esc` before it becomes HTML; everything else is numbers and fixed markup.

The trajectory is one `<div class="r">` per step, rendered once when its step arrives and never again (a
step's cells do not change later), so a live view only ever appends rows. Positions already committed
before the step are one grey bar, not a cell each, and so are the masked (or padding) cells a canvas run has
past its open block, so a row costs the size of its open window, not of the whole output or canvas.
"""
from __future__ import annotations

import html
import re
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

from studio.viz.grid import Cell, Grid, show_text
from studio.viz.palette import (DRAFT_STATES, FORWARD_ROLES, HELD_GLYPH, HOLDS, INK, PALETTE, State, fill, label,
                                legend_items)
from studio.viz.stats import Acceptance, StepPoint
from studio.viz.view import RunNumbers

CELL_PX = 16        # one output position in the trajectory
MAX_TAIL_CHARS = 40  # emitted text shown at the end of a step row


def esc(text: Any) -> str:
    return html.escape("" if text is None else str(text), quote=True)


def num(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


# -- the trajectory ---------------------------------------------------------------------------------
def row_html(grid: Grid, step: int) -> str:
    """One step of the trajectory: its head (step, forward role), the committed prefix as one bar, one cell
    per position of the open window (colour + glyph + hover text, block outlines), a canvas's quiet tail (masked
    or padding cells nothing touched) as one bar, a KV refresh's mark, the text it emitted."""
    row = grid.rows[step]
    done = _committed_before(grid, step)
    blocks = [b for b in grid.blocks if b.open_step <= step and (b.close_step is None or b.close_step >= step)]
    lo = min([done] + [b.start for b in blocks])
    hi = max([done] + [p + 1 for p in range(done, grid.n_pos) if grid.cell(step, p).state is not State.EMPTY]
             + [b.end for b in blocks])
    quiet = hi   # the tail [quiet, hi) of cells in one quiet state
    tail_state = grid.cell(step, hi - 1).state if hi > lo else None
    while quiet > max([lo] + [b.end for b in blocks]) and _quiet(grid.cell(step, quiet - 1), tail_state):
        quiet -= 1
    edges: dict[int, str] = {}
    for b in blocks:
        for p in range(b.start, b.end):
            edges[p] = " b" + (" bl" if p == b.start else "") + (" br" if p == b.end - 1 else "")
    role = row.role or ""
    head = f'<span class="h">{step}<i title="{esc(FORWARD_ROLES.get(role, role))}">{esc(role)}</i>{_plan(row.plan)}</span>'
    parts = [f'<div class="r" data-step="{step}">{head}']
    if lo:
        parts.append(f'<span class="cb" data-n="{lo}" style="width:{lo * CELL_PX}px" title="step {step} · '
                     f'positions 0–{lo - 1} committed earlier (click one to inspect it)"></span>')
    for p in range(lo, quiet):
        c = grid.cell(step, p)
        empty = c.state is State.EMPTY
        cls = f"c s-{c.state.value}" + (" held" if c.held else "") + (" em" if c.emitted else "") + edges.get(p, "")
        tip = "\n".join([f"step {step} · position {p}"] + (["empty"] if empty else c.describe()))
        tree = f'<sup class="br">{len(c.branches)}</sup>' if c.branches else ""   # a draft tree's branch point
        parts.append(f'<span class="{cls}" data-pos="{p}" title="{esc(tip)}">{"" if empty else c.glyph}{tree}</span>')
    if quiet < hi:
        n, what = hi - quiet, label(tail_state)
        parts.append(f'<span class="cb s-{tail_state.value}" data-lo="{quiet}" data-n="{n}" '
                     f'style="width:{n * CELL_PX}px" title="step {step} · positions {quiet}–{hi - 1} {esc(what)} '
                     f'(click one to inspect it)"></span>')
    for a, b in row.refreshes:
        parts.append(f'<span class="kvr" title="a KV cache refresh recomputed slots {a} to {b - 1}; the KV length '
                     f'does not change">⟳ refresh [{a},{b})</span>')
    if row.emitted:
        text = show_text(row.text)
        text = text if len(text) <= MAX_TAIL_CHARS else text[:MAX_TAIL_CHARS - 1] + "…"
        parts.append(f'<span class="t">+{len(row.emitted)} {esc(text)}</span>')
    parts.append("</div>")
    return "".join(parts)


def _plan(plan: dict | None) -> str:
    """A cost-aware step's plan after its role: the drafts it carried (0: an AR step), the rest in the tooltip."""
    if plan is None:
        return ""
    d, top, gain = plan["drafts"], plan["max_drafts"], plan["gain"]
    why = (f"an AR step (a block strategy commits its filled slots): no draft pays for its rows (of up to {top}) at "
           "the acceptance so far, or none could become output this close to the end" if d == 0 else
           f"planned {d} of up to {top} drafts for {gain:.2f}x the speed of a plain AR step, at the acceptance "
           "it reads optimistically")
    return f'<b class="pl" title="cost-aware drafting: {esc(why)}">d{d}</b>'


def _quiet(c: Cell, state: State | None) -> bool:
    """A canvas cell nothing touched at this step, still masked or padding (drawn in one bar with its like)."""
    return c.state is state and state in (State.MASKED, State.PADDING) and not c.kinds


def _committed_before(grid: Grid, step: int) -> int:
    """How many positions were emitted before `step` (output is emitted in order, so they are a prefix)."""
    final = grid.final
    return bisect_left(range(len(final)), step, key=lambda p: final[p].committed_step)


def legend_html() -> str:
    """Every state a trajectory shows: a drafting run's, then what a canvas run adds, the held tokens, a block and
    a cache refresh."""
    def item(state: State, glyph: str, text: str, held: bool = False) -> str:
        return f'<span><span class="c s-{state.value}{" held" if held else ""}">{glyph}</span>{esc(text)}</span>'

    items = [item(*i) for i in legend_items(False)]
    items.append(item(State.UNMASKED, HELD_GLYPH, "held in an open block", held=True))
    items.append('<span class="sub">canvas runs:</span>')
    items += [item(*i) for i in legend_items(True) if i[0] not in DRAFT_STATES]
    items.append('<span><span class="c bl br b"></span>open block</span>')
    items.append('<span><span class="kvr">⟳ refresh [a,b)</span>KV slots recomputed</span>')
    items.append('<span><b class="pl">d2</b>drafts cost-aware drafting planned for the forward (d0: an AR step)</span>')
    roles = "".join(f"<li><b>{esc(role)}</b>: {esc(what)}</li>" for role, what in FORWARD_ROLES.items())
    return ('<div class="legend">' + "".join(items) + "</div>"
            '<details class="roles"><summary>Forward roles (the word after each step number: cold, verify, …)'
            f"</summary><ul>{roles}</ul></details>")


# -- history of one position ----------------------------------------------------------------------------
def _rejected_draft(c) -> str:
    """The draft a correction replaced, with its own p and q (the p, q columns are the cell's own token's)."""
    if c.draft_tok is None:
        return ""
    return f"{_token(c.draft_tok, c.draft_text)} (p={num(c.draft_p, '.3g')}, q={num(c.draft_q, '.3g')})"


def inspector_html(grid: Grid | None, pos: int | None, run: str = "") -> str:
    """Every step that did something at output position `pos`, oldest first, and what it became. A canvas run's
    table has the model's guess (q) and why each step changed the cell (filled, edited, re-noised, padding), and
    the head says when the token was filled and edited, or that the cell is padding after an EOS."""
    if grid is None or not grid.steps or pos is None:
        return '<div class="note">Click a cell of the trajectory (or enter a position) to see its history.</div>'
    if not 0 <= pos < grid.n_pos:
        return f'<div class="note">Position must be between 0 and {grid.n_pos - 1}.</div>'
    canvas = grid.canvas is not None
    rows = []
    for step in grid.steps:
        c = grid.cell(step, pos)
        if c.state is State.EMPTY or (c.state is State.COMMITTED and not c.emitted) or (canvas and not c.kinds
                                                                                         and not c.held):
            continue   # nothing happened here at this step
        head = (step, esc(grid.rows[step].role or ""),
                f'<span class="c s-{c.state.value}">{c.glyph}</span> {esc(label(c.state))}', esc(_token(c.tok, c.text)))
        if canvas:
            cells = (*head, esc("; ".join(c.reasons(True))), num(c.q, ".3g"), num(c.conf, ".3g"),
                     esc(", ".join(c.kinds)))
        else:
            cells = (*head, esc(_rejected_draft(c)), num(c.p, ".3g"), num(c.q, ".3g"), num(c.ratio, ".3g"),
                     num(c.conf, ".3g"), esc(", ".join(c.kinds)))
        rows.append("<tr>" + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
    final = grid.final.get(pos)
    eos = grid.eos_before(pos)
    fate = (f"final token {esc(_token(final.tok, final.text))}, {esc(label(final.state))}, committed at step "
            f"{final.committed_step}" if final else
            f"padding after the EOS at position {eos}: never output" if eos is not None else "not emitted (yet)")
    history = "".join(f"<li>{esc(line)}</li>" for line in grid.fill_history(pos)) if canvas else ""
    head = (f"{esc(run) + ' · ' if run else ''}position {pos}: {fate}"
            + (f'<ul class="fills">{history}</ul>' if history else ""))
    columns = (("step", "forward", "state", "token", "why", "q (guess)", "conf", "events") if canvas else
               ("step", "forward", "state", "token", "rejected draft", "p", "q", "min(1,p/q)", "conf", "events"))
    table = ('<table class="tbl"><tr>' + "".join(f"<th>{c}</th>" for c in columns) + "</tr>" + "".join(rows)
             + "</table>")
    return f'<div class="inspector"><div class="head">{head}</div>{table if rows else ""}</div>'


def _token(tok: int | None, text: str | None) -> str:
    return "" if tok is None else f"{tok} {show_text(text)}"


# -- metrics ----------------------------------------------------------------------------------------
def metrics_html(numbers: RunNumbers | None = None, title: str = "") -> str:
    """A run's numbers so far (or at its end, with the footer's tok/s and stop reason) and two small charts:
    running TPF over steps and acceptance by draft slot. Cheap enough to redraw at every frame."""
    numbers = numbers or RunNumbers()
    tally, acc, footer = numbers.tally, numbers.acceptance, numbers.footer
    chips = [f"<b>{tally.n_tokens}</b> tokens", f"<b>{tally.forwards}</b> forwards",
             f"TPF <b>{num(numbers.tpf, '.2f')}</b>", f"accept <b>{num(acc.rate if acc.verified else None, '.0%')}</b>",
             f"<b>{num(numbers.tok_s(), '.1f')}</b> tok/s"]
    if footer:
        chips.append(f"stopped: <b>{esc(footer.get('stop_reason'))}</b>")
    head = f'<span class="ttl">{esc(title)}</span>' if title else ""
    return (f'<div class="metrics">{head}' + "".join(f"<span>{c}</span>" for c in chips) + "</div>"
            f'<div class="charts">{_tpf_svg(numbers.points)}{_acceptance_svg(acc)}</div>')


def _tpf_svg(points: Sequence[StepPoint], width: int = 240, height: int = 56, most: int = 120) -> str:
    run = [p for p in points if p.tpf is not None]
    stride = max(1, -(-len(run) // most))   # at most `most` points, whatever the run's length
    run = run[::stride] + ([run[-1]] if run and (len(run) - 1) % stride else [])
    top = max([p.tpf for p in run] + [1.0])
    xs = [4 + (width - 8) * i / max(1, len(run) - 1) for i in range(len(run))]
    line = " ".join(f"{x:.1f},{height - 4 - (height - 14) * p.tpf / top:.1f}" for x, p in zip(xs, run))
    return (f'<svg class="spark" width="{width}" height="{height}" role="img" aria-label="running TPF">'
            f'<title>running TPF over steps (max {top:.2f})</title>'
            f'<text x="2" y="10">TPF over steps · max {top:.2f}</text>'
            f'<polyline fill="none" stroke="#000" stroke-width="1.5" points="{line}"/></svg>')


def _acceptance_svg(acc: Acceptance, width: int = 240, height: int = 66) -> str:
    """A bar per draft slot (its acceptance given the slots before it), each named by its slot number below it."""
    rates = acc.by_pos
    if not rates:
        return (f'<svg class="spark" width="{width}" height="{height}"><text x="2" y="10">acceptance by draft slot: '
                "nothing verified</text></svg>")
    bar, top, floor = (width - 8) / len(rates), 16, height - 12   # bars between y=top and y=floor, labels below
    color = PALETTE[State.ACCEPTED][0]
    bars = "".join(
        f'<rect x="{4 + i * bar:.1f}" y="{floor - (floor - top) * r:.1f}" width="{max(1.0, bar - 2):.1f}" '
        f'height="{(floor - top) * r:.1f}" fill="{color}">'
        f'<title>slot {i + 1}: {a}/{v} accepted ({r:.0%})</title></rect>'
        f'<text class="slot" x="{4 + (i + 0.5) * bar - 1:.1f}" y="{height - 2}" text-anchor="middle">{i + 1}</text>'
        for i, (r, a, v) in enumerate(zip(rates, acc.accepted_by_pos, acc.verified_by_pos)))
    return (f'<svg class="spark" width="{width}" height="{height}" role="img" aria-label="acceptance by draft slot">'
            f'<text x="2" y="10">acceptance by draft slot · overall {acc.rate:.0%}</text>{bars}</svg>')


# -- tables -----------------------------------------------------------------------------------------
def comparison_html(table_rows: Sequence[Mapping[str, Any]], costs=None) -> str:
    """`studio.run.compare.rows` as a table, each run's text below it; with `costs` (the DeviceCosts the rows were
    projected with) the projected column and, under the table, whose costs they are."""
    from studio.run.compare import same_as
    from studio.traces import projection
    projected = [] if costs is None else [projection.label(costs)]
    head = "".join(f"<th>{esc(h)}</th>" for h in ("run", "tokens", "forwards", "TPF", "accept", "tok/s", "× ar",
                                                   *projected, "same as", "stop"))
    times = lambda x: "—" if x is None else f"{x:.2f}×"  # noqa: E731
    body = []
    for r in table_rows:
        cells = [] if costs is None else [times(r["projected_vs_ar"])]
        body.append("<tr>" + "".join(f"<td>{x}</td>" for x in (
            esc(r["label"]), r["n_tokens"], r["forwards"], num(r["tpf"], ".2f"), num(r["accept_rate"], ".0%"),
            num(r["tok_s"], ".1f"), times(r["speed_vs_ar"]), *cells, esc(same_as(r)), esc(r["stop_reason"])))
                    + "</tr>")
    note = "" if costs is None else f'<p class="note">{esc(projection.caption(costs.name, costs.origin))}</p>'
    texts = "".join(f'<div class="out"><b>{esc(r["label"])}</b> {esc(r["text"])}</div>' for r in table_rows)
    return f'<table class="tbl"><tr>{head}</tr>{"".join(body)}</table>{note}{texts}'


def trace_info_html(name: str, header: Mapping[str, Any], metrics: Mapping[str, Any], warning: str = "") -> str:
    """What a loaded trace is: file, strategy and parameters (a canvas run's canvas), model, prompt, its headline
    numbers, and a warning (events a newer schema added, skipped) when there is one."""
    model = header.get("model", {})
    params = ", ".join(f"{k}={v}" for k, v in header.get("params", {}).items())
    rows = [("file", name), ("strategy", f"{header.get('strategy')} ({params})"),
            ("model", " · ".join(str(model.get(k)) for k in ("name", "arch", "dtype"))
             + f" · adapter {model.get('adapter') or 'none'}"),
            ("prompt", header.get("prompt", {}).get("text", "")), ("seed", header.get("seed")),
            ("result", (f"{metrics.get('n_tokens')} tokens · {metrics.get('forwards')} forwards · "
                        f"TPF {num(metrics.get('tpf'), '.2f')} · stop: {metrics.get('stop_reason')}"))]
    canvas = header.get("canvas")
    if isinstance(canvas, Mapping):
        rows.insert(2, ("canvas", f"{canvas.get('length')} positions, filled in blocks of {canvas.get('block_size')}"))
    if warning:
        rows.append(("warning", warning))
    return '<table class="tbl kv">' + "".join(f"<tr><th>{k}</th><td>{esc(v)}</td></tr>" for k, v in rows) + "</table>"


def note_html(text: str, kind: str = "info") -> str:
    """A one-line message in the page (`kind`: info or error)."""
    return f'<div class="note {kind}">{esc(text)}</div>' if text else ""


def error_html(error: BaseException) -> str:
    """What a run that failed says in the page: bad input as its message, anything else as one line."""
    from studio.errors import BadInput
    text = str(error) if isinstance(error, BadInput) else f"internal error: {type(error).__name__}: {error}"
    return note_html(text.splitlines()[0] if text else type(error).__name__, "error")


def chat_messages(messages: Sequence[Mapping[str, str]]) -> list[dict]:
    """Conversation messages for gr.Chatbot (which renders markdown), every markup in them shown as text."""
    return [{"role": m["role"], "content": markdown_text(m["content"])} for m in messages]


_CODE = re.compile(r"(```.*?(?:```|$)|`[^`\n]+`)", re.DOTALL)   # code blocks and spans, even an unclosed block


def markdown_text(text: str) -> str:
    """`text` as markdown whose HTML is text: < > & are escaped outside code (inside code the markdown renderer
    escapes them itself, so escaping twice would show entities), and an image `![..](url)` is shown as text,
    never loaded (the page fetches nothing from outside)."""
    parts = _CODE.split(text or "")
    return "".join(part if i % 2 else html.escape(part, quote=False).replace("![", "!\\[")
                   for i, part in enumerate(parts))


# -- style ------------------------------------------------------------------------------------------
def _state_rules() -> str:
    rules = []
    for s in State:
        col = PALETTE[s][0]
        rules.append(f".c.s-{s.value}{{background:{col};color:{INK[s]}}}")
    rules += [f".c.s-{s.value}.held{{background:{fill(s, True)};color:#000}}" for s in HOLDS]
    rules.append(f".c.s-empty{{background:transparent}} .cb{{background:{PALETTE[State.COMMITTED][0]}}}")
    # a canvas's quiet tail: its colour, hatched like the TUI's ░ and ruled into cells, so it reads as the masked
    # (or padding) positions still ahead and how many, not as the row's background
    cells = f"repeating-linear-gradient(90deg,transparent 0 {CELL_PX - 1}px,#fff {CELL_PX - 1}px {CELL_PX}px)"
    rules += [f".cb.s-{s.value}{{background-color:{PALETTE[s][0]};background-image:{cells},"
              f"repeating-linear-gradient(135deg,transparent 0 3px,{INK[s]}55 3px 4px)}}"
              for s in (State.MASKED, State.PADDING)]
    return "\n".join(rules)


CSS = f"""
.analysis .card {{ background: #fff; color: #111; border: 1px solid #e3e3e3; border-radius: 8px; padding: 10px 14px;
                  margin: 8px 0; overflow-x: auto; }}
.analysis .grid2 {{ display: grid; grid-template-columns: 1fr 1fr; gap: 10px; }}
.analysis svg {{ max-width: 100%; height: auto; }}
@media (max-width: 1100px) {{ .analysis .grid2 {{ grid-template-columns: 1fr; }} }}
.analysis table.cmp td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.traj {{ font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 11px; }}
.traj .rows {{ position: relative; max-height: 440px; overflow: auto; border-radius: 6px;
              border: 1px solid var(--border-color-primary, #ddd); padding: 4px 4px 4px 0;
              background: #fff; color: #111; }}
.traj .steps {{ width: max-content; min-width: 100%; }}
.traj .steps:empty::before {{ content: "The trajectory appears here, one row per forward, as the run decodes.";
                             color: #777; font-family: system-ui, sans-serif; font-size: 12.5px; }}
.traj .r {{ display: flex; align-items: center; height: {CELL_PX + 2}px; white-space: nowrap; }}
.traj .h {{ flex: none; width: 16ch; padding-left: 4px; color: #555; overflow: hidden;   /* "1024 prefill d15" */
           position: sticky; left: 0; z-index: 1; background: #fff; }}
.traj .h i {{ font-style: normal; margin-left: 5px; color: #888; }}
.traj .h b.pl {{ font-weight: normal; margin-left: 4px; color: #0072B2; }}
.legend b.pl {{ font-weight: normal; margin-right: 4px; color: #0072B2; }}
.c {{ flex: none; display: inline-block; box-sizing: border-box; width: {CELL_PX}px; height: {CELL_PX}px;
      line-height: {CELL_PX - 2}px; text-align: center; border: 1px solid #fff; font-size: 10px; cursor: pointer; }}
.c.em {{ font-weight: bold; }}
.c {{ position: relative; }}
.c sup.br {{ position: absolute; top: -3px; right: 0; font-size: 8px; line-height: 8px; color: #000;
            background: #F0E442; border-radius: 2px; padding: 0 1px; }}   /* a draft tree's candidates here */
.c.b {{ border-top-color: #222; border-bottom-color: #222; }}
.c.bl {{ border-left-color: #222; }} .c.br {{ border-right-color: #222; }}
.cb {{ flex: none; display: inline-block; height: {CELL_PX - 2}px; margin: 1px 0; cursor: pointer; }}
.traj .t {{ margin-left: 8px; color: #333; }}
.kvr {{ flex: none; margin-left: 6px; padding: 0 4px; border-radius: 3px; font-size: 10px; color: #000;
        background: #FBE3B0; border: 1px solid #E69F00; }}   /* the TUI's refresh orange, lightened */
.c.s-noise {{ font-style: italic; }}
.legend {{ display: flex; flex-wrap: wrap; gap: 4px 12px; font-size: 12px; margin: 4px 0; }}
.legend > span {{ display: inline-flex; align-items: center; gap: 4px; }}
.roles {{ font-size: 12px; margin: 0 0 4px; color: #333; }}
.roles summary {{ cursor: pointer; color: #555; }}
.roles ul {{ margin: 2px 0 0 18px; padding: 0; columns: 2 320px; }}
.param-help {{ font-size: 0.85em; }} .param-help th {{ text-align: left; white-space: nowrap; padding-right: 1em; }}
.block.param {{ min-width: min(140px, 100%) !important; }}   /* a checkbox ignores min_width: no field is squeezed */
.block.status {{ min-height: 3em; }}   /* room for gradio's tracker: "queue: 1/2" while a request waits */
.metrics {{ display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 13px; align-items: baseline; }}
.metrics .ttl {{ font-weight: 600; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 10px; margin: 4px 0; }}
.spark {{ background: #fafafa; border: 1px solid #e3e3e3; border-radius: 4px; }}
.spark text {{ font-size: 10px; fill: #444; }}
.spark text.slot {{ font-size: 8px; fill: #666; }}
.tbl {{ border-collapse: collapse; font-size: 12.5px; margin: 4px 0; }}
.tbl th, .tbl td {{ border-bottom: 1px solid #e3e3e3; padding: 2px 8px; text-align: left; vertical-align: top; }}
.tbl.kv th {{ color: #555; font-weight: 500; }}
.inspector .head {{ font-weight: 600; margin: 4px 0; }}
.inspector .fills {{ font-weight: 400; margin: 2px 0 0 18px; padding: 0; }}
.legend .sub {{ color: #555; margin-left: 6px; }}
.note {{ font-size: 13px; padding: 4px 8px; border-radius: 4px; }}
.note.error {{ background: #fdecea; border: 1px solid #D55E00; }}
.note.info {{ color: #444; }}
.out {{ font-size: 12.5px; margin: 4px 0; white-space: pre-wrap; overflow-wrap: anywhere; max-height: 7.5em;
        overflow: auto; }}
{_state_rules()}
"""

"""Static SVG figures for the HTML report, drawn here without JavaScript: a report is one light file that
opens offline (plotly.js alone weighs ~4.6 MB, inlined in every file). The same figures as `figures`
(trajectory, TPF over steps, acceptance by draft slot, accepted drafts per verify step, a comparison of
runs), each an `<svg>` string; hover text is a mark's SVG `<title>` (a browser tooltip), and every text
from a trace goes through `html.escape`.
"""
from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from studio.viz.grid import Grid
from studio.viz.palette import OKABE_ITO, PALETTE, RUN_COLORS, State, fill, tint
from studio.viz.stats import acceptance, progress

ROLE_COLORS = {"prefill": "#9E9E9E", "cold": OKABE_ITO["sky_blue"], "verify": OKABE_ITO["blue"],
               "draft": OKABE_ITO["orange"], "target": OKABE_ITO["bluish_green"], "commit": "#616161",
               "jacobi": OKABE_ITO["reddish_purple"], "extend": OKABE_ITO["vermillion"]}
CHAR_PX = 6.2       # about the width of one 11 px character of the charts' sans-serif font
LEGEND_CHAR_PX = 6.6   # and of one 11.5 px legend character
LEGEND_ROW = 16     # px between legend rows
MAX_TIPS = 20_000   # trajectory cells with a hover text; beyond it the file would grow for little use


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _n(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


class Plot:
    """One chart: a title, a legend row, linear axes, and marks placed by data coordinates."""

    def __init__(self, title: str, x_range: tuple[float, float], y_range: tuple[float, float], *, width: int = 620,
                 height: int = 300, left: int = 58, right: int = 18, top: int = 56, bottom: int = 44):
        self.title, self.width, self.height = title, width, height
        self.box = (left, top, width - right, height - bottom)   # x0, y0, x1, y1 of the plot area in pixels
        self.x_range, self.y_range = x_range, y_range
        self.marks: list[str] = []
        self.legend_items: list[tuple[str, str]] = []

    def x(self, v: float) -> float:
        lo, hi = self.x_range
        return self.box[0] + (self.box[2] - self.box[0]) * (v - lo) / ((hi - lo) or 1)

    def y(self, v: float) -> float:
        lo, hi = self.y_range
        return self.box[3] - (self.box[3] - self.box[1]) * (v - lo) / ((hi - lo) or 1)

    def bar(self, x0: float, x1: float, y0: float, y1: float, fill: str, tip: str = "") -> None:
        left, right, top, bottom = self.x(x0), self.x(x1), self.y(y1), self.y(y0)
        title = f"<title>{esc(tip)}</title>" if tip else ""
        self.marks.append(f'<rect x="{_n(left)}" y="{_n(top)}" width="{_n(max(0.5, right - left))}" '
                          f'height="{_n(max(0.0, bottom - top))}" fill="{fill}">{title}</rect>')

    def label(self, x: float, y: float, text: str, size: int = 11, anchor: str = "middle") -> None:
        """A text just above data point (x, y)."""
        self.marks.append(f'<text x="{_n(self.x(x))}" y="{_n(self.y(y) - 4)}" font-size="{size}" '
                          f'text-anchor="{anchor}">{esc(text)}</text>')

    def line(self, points: Sequence[tuple[float, float]], color: str, width: float = 2, dash: str = "",
             tip: str = "") -> None:
        if not points:
            return
        pts = " ".join(f"{_n(self.x(a))},{_n(self.y(b))}" for a, b in points)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        title = f"<title>{esc(tip)}</title>" if tip else ""
        self.marks.append(f'<polyline fill="none" stroke="{color}" stroke-width="{width}"{extra} '
                          f'points="{pts}">{title}</polyline>')

    def note(self, text: str) -> None:
        """A line of grey text under the title (why a chart has nothing to draw): on a line of its own, a long reason
        never cuts the title."""
        self.marks.append(f'<text x="4" y="44" font-size="12" fill="#666">{esc(text)}</text>')

    def legend(self, name: str, color: str) -> None:
        self.legend_items.append((name, color))

    def axes(self, x_title: str, y_title: str, y_ticks: Sequence[tuple[float, str]],
             x_ticks: Sequence[tuple[float, str]] = ()) -> None:
        x0, y0, x1, y1 = self.box
        slant = _slanted_label_px(self, x_ticks)
        if slant:   # the chart grows downwards by what the longest label needs at 40 degrees
            self.height = max(self.height, int(y1 + 18 + 0.64 * slant + (16 if x_title else 0)))
        parts = [f'<line x1="{x0}" y1="{y1}" x2="{x1}" y2="{y1}" stroke="#888"/>']
        for v, text in y_ticks:
            y = _n(self.y(v))
            parts.append(f'<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#eee"/>'
                         f'<text x="{x0 - 6}" y="{y}" dy="4" font-size="11" text-anchor="end">{esc(text)}</text>')
        for v, text in x_ticks:
            x = _n(self.x(v))
            place = (f'x="{x}" y="{y1 + 12}" transform="rotate(-40 {x} {y1 + 12})" text-anchor="end"' if slant
                     else f'x="{x}" y="{y1 + 15}" text-anchor="middle"')
            parts.append(f'<text {place} font-size="11">{esc(text)}</text>')
        parts.append(f'<text x="{(x0 + x1) / 2}" y="{self.height - 6}" font-size="12" text-anchor="middle" '
                     f'fill="#444">{esc(x_title)}</text>')
        parts.append(f'<text transform="translate(13 {(y0 + y1) / 2}) rotate(-90)" font-size="12" '
                     f'text-anchor="middle" fill="#444">{esc(y_title)}</text>')
        self.marks[:0] = parts   # under the marks

    def svg(self) -> str:
        head = [f'<text x="4" y="18" font-size="15" font-weight="600">{esc(self.title)}</text>']
        x, y = 4.0, 30
        for name, color in self.legend_items:   # rows under the title: never over the marks
            width = 28 + LEGEND_CHAR_PX * len(name)
            if x > 4 and x + width - 12 > self.width:
                x, y = 4.0, y + LEGEND_ROW
            head.append(f'<rect x="{_n(x)}" y="{y}" width="11" height="11" fill="{color}"/>'
                        f'<text x="{_n(x + 15)}" y="{y + 10}" font-size="11.5">{esc(name)}</text>')
            x += width
        extra = y - 30   # the legend's rows after its first push the chart down
        marks = "".join(self.marks)
        if extra:
            marks = f'<g transform="translate(0 {extra})">{marks}</g>'
        height = self.height + extra
        return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {self.width} {height}" '
                f'width="{self.width}" height="{height}" role="img" aria-label="{esc(self.title)}" '
                f'font-family="system-ui, sans-serif">{"".join(head)}{marks}</svg>')


def _slanted_label_px(plot: Plot, x_ticks: Sequence[tuple[float, str]]) -> float:
    """The pixel width of the longest x tick label when labels side by side would overlap (they then slant), else 0."""
    if len(x_ticks) < 2:
        return 0.0
    xs = sorted(plot.x(v) for v, _ in x_ticks)
    gap = min(b - a for a, b in pairwise(xs))
    longest = CHAR_PX * max(len(text) for _, text in x_ticks)
    return longest if longest > gap - 4 else 0.0


def ticks(top: float, n: int = 4, percent: bool = False) -> list[tuple[float, str]]:
    """About `n` round ticks from 0 to `top`."""
    raw = top / n if top > 0 else 1
    step = next(s * 10 ** e for e in range(-3, 7) for s in (1, 2, 2.5, 5) if s * 10 ** e >= raw)
    out, v = [], 0.0
    while v <= top + 1e-9:
        out.append((v, f"{v:.0%}" if percent else f"{v:g}"))
        v = round(v + step, 10)
    return out


# -- one run ----------------------------------------------------------------------------------------
def tpf_svg(events: Sequence[Mapping[str, Any]], footer: Mapping[str, Any] | None = None) -> str:
    """Tokens emitted by each forward (bars by forward role, tokens unmasked but not yet emitted on top) and
    the running TPF (line); the final TPF is in the title, not over the bars."""
    pts = progress(events)
    run = [(p.step, p.tpf) for p in pts if p.tpf is not None]
    final = footer.get("tpf") if footer else (run[-1][1] if run else None)
    title = "Tokens per forward" + (f" · final TPF {final:.2f}" if final is not None else "")
    if not pts:
        return Plot(title + ": no events", (0, 1), (0, 1), height=80).svg()
    top = max([p.emitted + p.unmasked for p in pts] + [t for _, t in run] + [1]) * 1.1
    plot = Plot(title, (pts[0].step - 0.5, pts[-1].step + 0.5), (0, top))
    plot.axes("step (forward)", "tokens per forward", ticks(top), ticks(pts[-1].step, 6))
    held = tint(PALETTE[State.UNMASKED][0], 0.45)
    for p in pts:
        color = ROLE_COLORS.get(p.role or "", "#888888")
        plot.bar(p.step - 0.4, p.step + 0.4, 0, p.emitted, color, f"step {p.step} ({p.role}): {p.emitted} emitted")
        if p.unmasked:
            plot.bar(p.step - 0.4, p.step + 0.4, p.emitted, p.emitted + p.unmasked, held,
                     f"step {p.step}: {p.unmasked} unmasked, emitted later")
    for role in dict.fromkeys(p.role for p in pts if p.emitted):
        plot.legend(f"emitted by {role}", ROLE_COLORS.get(role or "", "#888888"))
    if any(p.unmasked for p in pts):
        plot.legend("unmasked, emitted later", held)
    plot.line(run, "#000000", tip="running TPF (tokens / forwards so far)")
    plot.legend("running TPF", "#000000")
    return plot.svg()


def acceptance_svg(events: Sequence[Mapping[str, Any]]) -> str:
    """Acceptance rate by draft slot (slot k = the k-th verified draft of a verify step), as percentages."""
    acc = acceptance(events)
    if not acc.verified:
        return Plot("Acceptance by draft slot: no drafts were verified", (0, 1), (0, 1), height=80).svg()
    n = len(acc.by_pos)
    plot = Plot(f"Acceptance by draft slot · overall {acc.rate:.0%}", (0.5, n + 0.5), (0, 1.12), top=40)
    plot.axes("draft slot (in verification order)", "accepted / verified", ticks(1.0, percent=True),
              [(k, str(k)) for k in range(1, n + 1, max(1, n // 12))])
    labelled = (plot.box[2] - plot.box[0]) / n >= 30   # a label per bar only where it fits
    for k, (rate, a, v) in enumerate(zip(acc.by_pos, acc.accepted_by_pos, acc.verified_by_pos), start=1):
        plot.bar(k - 0.38, k + 0.38, 0, rate, PALETTE[State.ACCEPTED][0], f"slot {k}: {a}/{v} accepted ({rate:.0%})")
        if labelled:
            plot.label(k, rate, f"{rate:.0%}")
    plot.line([(0.5, acc.rate), (n + 0.5, acc.rate)], "#000000", 1, "4 3", f"overall {acc.rate:.0%}")
    return plot.svg()


def acceptance_length_svg(events: Sequence[Mapping[str, Any]]) -> str:
    """How many drafts each verify step accepted (a histogram over verify steps)."""
    acc = acceptance(events)
    if not acc.verify_steps:
        return Plot("Accepted drafts per verify step: no verify steps", (0, 1), (0, 1), height=80).svg()
    hist = acc.histogram()
    mean = acc.mean_acceptance_length
    title = "Accepted drafts per verify step" + (f" · mean acceptance length {mean:.2f}" if mean is not None else "")
    keys = sorted(hist)
    top = max(hist.values()) * 1.15
    plot = Plot(title, (keys[0] - 0.5, keys[-1] + 0.5), (0, top), top=40)
    plot.axes("drafts accepted in one verify step", "verify steps", ticks(top), [(k, str(k)) for k in keys])
    for k in keys:
        plot.bar(k - 0.4, k + 0.4, 0, hist[k], OKABE_ITO["blue"], f"{k} accepted: {hist[k]} verify step(s)")
        plot.label(k, hist[k], str(hist[k]))
    return plot.svg()


def trajectory_svg(grid: Grid, width: int = 1200) -> str:
    """Steps (rows, top to bottom) × output positions (columns), each cell coloured by its state; positions
    committed earlier are one grey bar per row; open blocks are outlined; a cell's hover tells its history."""
    if not grid.steps or not grid.n_pos:
        return Plot("Decoding trajectory: no tokens", (0, 1), (0, 1), height=80).svg()
    n_rows, n_pos = len(grid.steps), grid.n_pos
    left = 92 if n_rows <= 120 else 48
    cw = max(1.0, min(14.0, (width - left - 10) / n_pos))
    rh = max(2.0, min(14.0, 2400 / n_rows))
    glyphs = cw >= 10 and rh >= 10
    row_of = {s: i for i, s in enumerate(grid.steps)}
    top = 30
    height = int(top + rh * n_rows + 34)
    tips = sum(1 for c in grid.cells.values() if not _background(c)) <= MAX_TIPS
    marks: list[str] = []
    carried: dict[tuple[int, State], list[int]] = {}   # (row, state) -> positions of background cells
    for (step, pos), c in sorted(grid.cells.items()):
        if _background(c):
            carried.setdefault((step, c.state), []).append(pos)
            continue
        x, y = left + pos * cw, top + row_of[step] * rh
        tip = f"<title>{esc(chr(10).join([f'step {step} · position {pos}', *c.describe()]))}</title>" if tips else ""
        marks.append(f'<rect x="{_n(x)}" y="{_n(y)}" width="{_n(cw)}" height="{_n(rh)}" fill="{fill(c.state, c.held)}" '
                     f'stroke="#fff" stroke-width="{0.5 if cw >= 4 else 0}">{tip}</rect>')
        if glyphs:
            marks.append(f'<text x="{_n(x + cw / 2)}" y="{_n(y + rh - 3)}" font-size="9" text-anchor="middle" '
                         f'pointer-events="none">{esc(c.glyph)}</text>')
        if glyphs and c.branches:   # a draft tree's branch point: its candidate count, as the web rows badge it
            marks.append(f'<text class="br" x="{_n(x + cw - 1)}" y="{_n(y + 5)}" font-size="6" text-anchor="end" '
                         f'font-weight="700" fill="#8a6d00" pointer-events="none">{len(c.branches)}</text>')
    for (step, state), positions in carried.items():
        y = top + row_of[step] * rh
        for start, end in _runs(positions):
            marks.append(f'<rect x="{_n(left + start * cw)}" y="{_n(y)}" width="{_n((end - start) * cw)}" '
                         f'height="{_n(rh)}" fill="{PALETTE[state][0]}"/>')
    for b in grid.blocks:
        close = b.close_step if b.close_step is not None else grid.steps[-1]
        y0, y1 = top + row_of.get(b.open_step, 0) * rh, top + (row_of.get(close, n_rows - 1) + 1) * rh
        wide = (min(b.end, n_pos) - b.start) * cw
        marks.append(f'<rect x="{_n(left + b.start * cw)}" y="{_n(y0)}" width="{_n(wide)}" height="{_n(y1 - y0)}" '
                     'fill="none" stroke="#333" stroke-dasharray="3 2"/>')
    heads = []
    if rh >= 9:
        heads = [f'<text x="4" y="{_n(top + i * rh + rh - 3)}" font-size="9.5" fill="#555">{s} '
                 f'{esc(grid.rows[s].role or "")}</text>' for i, s in enumerate(grid.steps)]
    step_px = max(1, round(60 / cw))
    axis = [f'<text x="{_n(left + p * cw)}" y="{height - 18}" font-size="10" fill="#555">{p}</text>'
            for p in range(0, n_pos, step_px)]
    total_w = int(max(left + cw * n_pos + 10, 440))   # room for the title over a short run
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {total_w} {height}" '
            f'width="{total_w}" height="{height}" role="img" aria-label="decoding trajectory" '
            f'font-family="system-ui, sans-serif">'
            f'<text x="4" y="18" font-size="15" font-weight="600">Decoding trajectory: steps × output positions'
            f"</text>{''.join(marks)}{''.join(heads)}{''.join(axis)}"
            f'<text x="{left}" y="{height - 4}" font-size="11" fill="#444">output position →</text></svg>')


def _background(c) -> bool:
    """A cell of the bulk of a run, drawn in runs of one colour: committed at an earlier step, or a canvas's cell
    nothing touched at this step (still masked, or padding)."""
    return c.state in (State.COMMITTED, State.MASKED, State.PADDING) and not c.emitted and not c.kinds


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as [start, end) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


# -- several runs -----------------------------------------------------------------------------------
def comparison_svgs(traces: Sequence[Any], labels: Sequence[str], metrics: Sequence[Mapping[str, Any]]) -> list[str]:
    """TPF, acceptance (a percentage) and tok/s per run as bars, and tokens vs forwards (one line per run)."""
    colors = [RUN_COLORS[i % len(RUN_COLORS)] for i in range(len(traces))]
    out = []
    for key, title, fmt, percent in (("tpf", "Tokens per forward (TPF)", ".2f", False),
                                     ("accept_rate", "Draft acceptance", ".0%", True),
                                     ("tok_s", "Decode speed (tok/s)", ".1f", False)):
        values = [m.get(key) for m in metrics]
        top = 1.0 if percent else max([v for v in values if v is not None] + [1e-9]) * 1.15
        plot = Plot(title, (-0.5, len(labels) - 0.5), (0, top * (1.12 if percent else 1)), width=400, height=260,
                    top=40)
        plot.axes("", "", ticks(top, percent=percent), [(i, lab) for i, lab in enumerate(labels)])
        for i, (v, color) in enumerate(zip(values, colors)):
            shown = "n/a" if v is None else format(v, fmt)
            plot.bar(i - 0.35, i + 0.35, 0, v or 0, color, f"{labels[i]}: {shown}")
            plot.label(i, v or 0, shown)
        out.append(plot.svg())
    lines = []
    for t in traces:
        pts = progress(t.events)
        lines.append([(0, pts[0].tokens - pts[0].emitted if pts else 0)] + [(p.forwards, p.tokens) for p in pts])
    most = max([x for line in lines for x, _ in line] + [1])
    tokens = max([y for line in lines for _, y in line] + [1]) * 1.05
    plot = Plot("Tokens vs forwards", (0, most), (0, tokens), width=400, height=260)
    plot.axes("forwards (prefill excluded)", "tokens emitted", ticks(tokens), ticks(most, 4))
    plot.line([(0, 0), (min(most, tokens), min(most, tokens))], "#888888", 1, "4 3", "1 token / forward")
    for lab, line, color in zip(labels, lines, colors):
        steps = [q for a, b in pairwise(line) for q in ((b[0], a[1]), b)]   # a step line
        plot.line(line[:1] + steps, color, 2.5, tip=lab)
        plot.legend(lab, color)
    out.append(plot.svg())
    return out

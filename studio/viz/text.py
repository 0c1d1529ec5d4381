"""Terminal renderers of the trajectory grid: plain text (pipes, logs, NO_COLOR) and Rich.

One line per step: step number, forward role, one glyph per output position, tokens emitted:

       3 verify   ■■■✓✓↻○○○·  +3 " apple, b"

Glyphs (see `studio.viz.palette`) carry the state on their own; Rich adds the palette colours.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from studio.events.metrics import prefill_tokens
from studio.viz.grid import Grid, show_text
from studio.viz.palette import (HELD_GLYPH, PALETTE, RICH_FG, RICH_STYLE, RICH_TEXT, TEXT_CUE, State, legend_items,
                                legend_text)

if TYPE_CHECKING:
    from rich.text import Text

ELLIPSIS = "…"


def _window(grid: Grid, step: int, width: int | None) -> tuple[int, int]:
    """Columns [lo, hi) to show for one step: everything when it fits, else around the step's activity."""
    n = grid.n_pos
    if width is None or n <= width:
        return 0, n
    width = max(width, 4)
    active = [p for p in range(n)
              if grid.cell(step, p).state not in (State.EMPTY, State.COMMITTED) or grid.cell(step, p).emitted]
    if active:
        lo = max(0, min(active) - 2)
    else:
        lo = n - width
    lo = min(lo, n - width)
    return lo, lo + width


def _head(grid: Grid, step: int) -> str:
    role = grid.rows[step].role or "-"
    return f"{step:>4} {role:<8} "


def _tail(grid: Grid, step: int, max_text: int) -> str:
    row = grid.rows[step]
    refresh = "".join(f"  ⟳ refresh [{a},{b})" for a, b in row.refreshes)
    if not row.emitted:
        return refresh
    text = show_text(row.text)
    if len(text) > max_text:
        text = text[: max_text - 1] + ELLIPSIS
    return f"  +{len(row.emitted)} {text}{refresh}"


def step_line(grid: Grid, step: int, width: int | None = None, max_text: int = 40) -> str:
    """One plain-text line for `step`; `width` caps the number of position columns."""
    lo, hi = _window(grid, step, width)
    glyphs = "".join(grid.cell(step, p).glyph for p in range(lo, hi))
    if lo > 0:
        glyphs = ELLIPSIS + glyphs[1:]
    return _head(grid, step) + glyphs + _tail(grid, step, max_text)


def render_plain(grid: Grid, width: int | None = None, legend: bool = True) -> str:
    lines = [step_line(grid, s, width) for s in grid.steps]
    if legend:
        lines.append("legend: " + legend_text(grid.canvas is not None))
    return "\n".join(lines)


def rich_step_line(grid: Grid, step: int, width: int | None = None, max_text: int = 40) -> "Text":
    from rich.text import Text

    lo, hi = _window(grid, step, width)
    out = Text(_head(grid, step), style="bold" if grid.rows[step].role else "dim")
    if lo > 0:
        out.append(ELLIPSIS, style="dim")
        lo += 1
    for p in range(lo, hi):
        c = grid.cell(step, p)
        style = RICH_STYLE[c.state] + (" underline" if c.emitted and c.state is not State.COMMITTED else "")
        if c.held:
            style = RICH_FG[c.state]
        out.append(c.glyph, style=style)
    tail = _tail(grid, step, max_text)
    if tail:
        out.append(tail, style="default")
    return out


def rich_text(grid: Grid, upto_step: int | None = None) -> "Text":
    """The generated text, each token coloured by how it was produced (provenance), up to a step."""
    from rich.text import Text

    out = Text()
    for seg in grid.segments:
        if upto_step is not None and seg.step > upto_step:
            break
        out.append(seg.text, style=RICH_TEXT[seg.state])
    return out


def rich_text_legend() -> "Text":
    """How `rich_text` marks provenance: style and colour."""
    from rich.text import Text

    out = Text("text: ", style="dim")
    for s, cue in TEXT_CUE.items():
        out.append(cue, style=RICH_TEXT[s])
        out.append("  ")
    return out


def rich_legend(canvas: bool | None = False, upcoming: bool = False) -> "Text":
    """The glyphs of a run's states (`palette.legend_items`), each in its style; `upcoming`: also the glyph of the
    positions a row has not reached (a replay draws every row to the run's last position)."""
    from rich.text import Text

    out = Text()
    items = legend_items(canvas) + ([(State.EMPTY, PALETTE[State.EMPTY][1], "not written yet")] if upcoming else [])
    for s, g, lab in items:
        out.append(g, style=RICH_FG[s] if g == HELD_GLYPH else RICH_STYLE[s])
        out.append(f" {lab}  ", style="default")
    return out


def skipped_note(trace) -> str:
    """What a viewer says of a trace whose newer minor version added event kinds this build skipped
    (`Trace.skipped`)."""
    return (f"{trace.skipped} event(s) of kinds {trace.header.get('schema')} added skipped: a newer dlm-studio "
            "shows them")


NOT_APPLICABLE = "n/a"


def acceptance_shown(rate: float, events: list[dict], spec: str = ".0%") -> str:
    """An acceptance rate as every text view shows it: n/a for a run that verified nothing (a canvas run, AR steps),
    whose 0 would read as every draft refused."""
    return format(rate, spec) if any(e["t"] in ("accept", "reject") for e in events) else NOT_APPLICABLE


def prefill_shown(seconds: float, events: list[dict], spec: str = ".2f") -> str:
    """A prefill's time as every text view shows it: n/a for a run without one (a canvas run: its prompt is part of
    every forward)."""
    return format(seconds, spec) + " s" if any(prefill_tokens(events)) else NOT_APPLICABLE


def run_summary_line(footer: dict, label: str, events: list[dict]) -> str:
    """The one-line summary printed after a run (and after each chat turn): tokens, forwards, TPF,
    acceptance (n/a when nothing was verified), tok/s, the prefill (prompt tokens computed, and those reused
    from a chat's cached history; none for a canvas run) and the stop reason; a run cancelled during its prefill says only that."""
    f = footer
    new, reused = prefill_tokens(events)
    prefill = f"{new} tokens" + (f" + {reused} reused" if reused else "")
    if f["stop_reason"] == "cancelled" and not any(e["t"] == "emit" or e["step"] > 0 for e in events):
        return f"[{label}] cancelled during the prefill: {prefill} of the prompt in {f['prefill_s']:.2f}s, no output"
    # a canvas run has no prefill: its prompt is part of every forward (or of its cache's rebuilds)
    prefilled = f"  prefill {prefill} {f['prefill_s']:.2f}s" if new or reused else ""
    return (f"[{label}] {f['n_tokens']} tokens  {f['forwards']} forwards  TPF {f['tpf']:.2f}  "
            f"accept {acceptance_shown(f['accept_rate'], events)}  {f['tok_s']:.1f} tok/s{prefilled}  "
            f"stop {f['stop_reason']}")

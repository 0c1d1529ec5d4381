"""Replay a trace in the terminal, step by step, from its events alone (no model).

Each step prints its grid row (glyph per position, see `studio.viz.text`); on a terminal a live panel
below shows the text growing (coloured by provenance) and a metrics line. Timing follows the trace's
`ms` stamps divided by `speed` (speed 2 = twice as fast; 0 = no sleeping), or a fixed `step_delay`.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from studio.events import Trace, read_trace
from studio.viz.grid import TokenText
from studio.viz.text import acceptance_shown, rich_legend, rich_step_line, rich_text, rich_text_legend
from studio.viz.view import RunView

MAX_SLEEP_S = 3.0  # one long step (a slow prefill) never stalls a replay for more than this


def _metrics_line(pt: Any, n_steps: int, final: bool = False) -> str:
    parts = [f"step {pt.step}/{n_steps - 1}", f"forwards {pt.forwards}", f"tokens {pt.tokens}",
             f"TPF {pt.tpf:.2f}" if pt.tpf is not None else "TPF –"]
    if pt.accept_rate is not None:
        parts.append(f"accept {pt.accept_rate:.0%} ({pt.accepted}/{pt.verified})")
    if pt.ms is not None:
        parts.append(f"t {pt.ms / 1000:.2f}s")
    return ("done · " if final else "") + " · ".join(parts)


def _recorded_delay(ms: float | None, prev_ms: float | None, speed: float) -> float:
    """Seconds to wait before a step stamped `ms` after one stamped `prev_ms`: the recorded gap divided by `speed`,
    at most MAX_SLEEP_S; none at speed 0 or when a stamp is missing."""
    if speed and speed > 0 and ms is not None and prev_ms is not None:
        return min(MAX_SLEEP_S, max(0.0, (ms - prev_ms) / 1000.0 / speed))
    return 0.0


def _summary(t: Trace, last: Any, n_steps: int) -> str:
    """The closing line: the footer's numbers, else the last step's (a truncated trace)."""
    if t.footer is not None:
        f = t.footer
        return (f"done · {f['stop_reason']} · {f['n_tokens']} tokens · {f['forwards']} forwards · "
                f"TPF {f['tpf']:.3f} · accept {acceptance_shown(f['accept_rate'], t.events, '.1%')}"
                + (f" · {f['tok_s']:.1f} tok/s" if f.get("tok_s") is not None else "")
                + (f" · {f['wall_s']:.2f}s" if f.get("wall_s") is not None else ""))
    if last is not None:
        return _metrics_line(last, n_steps, final=True) + " · truncated trace"
    return "empty trace"


def replay(trace: Trace | str, speed: float = 1.0, console: Any = None, step_delay: float | None = None, *,
           token_text: TokenText | None = None, width: int | None = None,
           sleep: Callable[[float], None] = time.sleep) -> str:
    """Re-render `trace` (a Trace or a path) step by step; returns the final text.

    speed: playback speed relative to the recorded timing (0 = as fast as possible).
    step_delay: if given, a fixed number of seconds per step instead of the recorded timing.
    """
    from rich.console import Console, Group
    from rich.live import Live
    from rich.panel import Panel
    from rich.text import Text

    t = trace if isinstance(trace, Trace) else read_trace(trace)
    console = console or Console()
    view = RunView.of_trace(t, token_text)
    grid = view.grid
    pts = {p.step: p for p in view.points}
    h = t.header
    model = h.get("model", {})
    title = Text.assemble(("replay ", "bold"), (str(h.get("strategy")), "bold cyan"),
                          f" · {model.get('name')} · seed {h.get('seed')} · {len(grid.steps)} steps")
    console.print(title)
    prompt = (h.get("prompt") or {}).get("text", "")
    if prompt:
        console.print(Text("prompt: ", style="dim") + Text(prompt if len(prompt) < 300 else prompt[:299] + "…"))
    console.print(rich_legend(grid.canvas is not None, upcoming=True))
    console.print(rich_text_legend())
    cols = width if width is not None else max(10, console.width - 40)

    def panel(step: int | None) -> Any:
        text = rich_text(grid, upto_step=step)
        pt = pts.get(step) if step is not None else None
        line = Text(_metrics_line(pt, len(grid.steps)) if pt else "", style="dim")
        return Group(Panel(text, title="output", title_align="left", border_style="grey50"), line)

    live_ok = console.is_terminal and not console.is_dumb_terminal
    prev_ms: float | None = None
    live = Live(panel(None), console=console, auto_refresh=False, transient=True) if live_ok else None
    try:
        if live:
            live.start()
        for step in grid.steps:
            pt = pts[step]
            delay = step_delay if step_delay is not None else _recorded_delay(pt.ms, prev_ms, speed)
            if pt.ms is not None:
                prev_ms = pt.ms
            if delay > 0:
                sleep(delay)
            line = rich_step_line(grid, step, width=cols)
            if live:
                live.console.print(line)
                live.update(panel(step), refresh=True)
            else:
                console.print(line, soft_wrap=True)
    finally:
        if live:
            live.stop()
    final_text = grid.text
    if t.footer is not None:
        final_text = t.footer.get("text", final_text)
    console.print(Panel(rich_text(grid) if grid.text == final_text else Text(final_text),
                        title="output", title_align="left", border_style="grey50"))
    last = pts[grid.steps[-1]] if grid.steps else None
    console.print(Text(_summary(t, last, len(grid.steps)), style="bold"))
    return final_text

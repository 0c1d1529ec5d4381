"""The metrics panel: forwards, tokens, TPF (with a sparkline of tokens per forward over the steps),
acceptance by draft position, tok/s, KV length and the current forward's role. Everything comes from the
step series of `studio.viz.stats` (the one metric definition, DESIGN §2.3).

One widget drawing one Text: it is redrawn every frame while a run decodes, and a single repaint (a
layout pass only when a new draft slot adds a line) keeps the UI thread's share of the GIL small.
"""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from studio.viz.stats import Acceptance, StepPoint

BAR = "▏▎▍▌▋▊▉█"
SPARK = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 10


def bar(frac: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of `frac` (0..1) in `width` cells, eighths included."""
    eighths = round(max(0.0, min(1.0, frac)) * width * 8)
    full, part = divmod(eighths, 8)
    return "█" * full + (BAR[part - 1] if part else "") + " " * (width - full - (1 if part else 0))


def sparkline(values: list[float], width: int) -> str:
    """The last `width` values as one line of eighth-height bars, scaled to their maximum."""
    values = values[-width:]
    top = max(values, default=0) or 1
    return "".join(SPARK[min(7, max(0, round(v / top * 7)))] for v in values)


def decode_tok_s(points: list[StepPoint]) -> float | None:
    """Tokens emitted after the prefill ÷ the run's decode time, both read off the step series (live)."""
    prefill = next((p for p in points if p.role == "prefill"), None)
    last = points[-1] if points else None
    if prefill is None or last is None or last is prefill or last.ms is None or prefill.ms is None:
        return None
    span = (last.ms - prefill.ms) / 1000
    return (last.tokens - prefill.tokens) / span if span > 0 else None


def acceptance_text(accept: Acceptance) -> Text:
    """Acceptance overall and by draft slot, as bars (nothing verified: says so)."""
    if not accept.verified:
        return Text("acceptance: n/a (nothing verified)", style="dim")
    out = Text()
    out.append("acceptance ", style="dim").append(f"{accept.rate:.0%}  ({accept.accepted}/{accept.verified})")
    for k, (rate, n) in enumerate(zip(accept.by_pos, accept.verified_by_pos), 1):
        out.append(f"\nslot {k:<2} ", style="dim").append(bar(rate), style="#009E73")
        out.append(f" {rate:4.0%}  n={n}", style="dim")
    return out


def metrics_text(points: list[StepPoint], accept: Acceptance, label: str, width: int) -> Text:
    last = points[-1] if points else None
    out = Text()
    if label:
        out.append(f"{label}\n", style="bold")
    if last is None:
        out.append("no steps yet", style="dim")
        return out
    tok_s = decode_tok_s(points)
    prefill = next((p for p in points if p.role == "prefill"), None)
    out.append(f"step {last.step}  ·  {last.role or '—'}\n")
    out.append("forwards ", style="dim").append(f"{last.forwards:<6}")
    out.append("tokens ", style="dim").append(f"{last.tokens}\n")
    out.append("TPF      ", style="dim").append(f"{last.tpf:.2f}\n" if last.tpf is not None else "—\n")
    out.append("tok/s    ", style="dim").append(f"{tok_s:.1f}\n" if tok_s is not None else "—\n")
    out.append("KV       ", style="dim").append(f"{last.kv_len if last.kv_len is not None else '—'}")
    if prefill is not None and prefill.wall_ms is not None:
        out.append(f"  (prefill {prefill.wall_ms:.0f} ms)", style="dim")
    per_step = [p.emitted for p in points if p.role not in (None, "prefill")]
    out.append(f"\ntokens per forward, by step (max {max(per_step, default=0)})\n", style="dim")
    out.append(sparkline(per_step, width) or " ", style="#0072B2")
    out.append("\n\n")
    out.append_text(acceptance_text(accept))
    return out


class MetricsPanel(Widget):
    DEFAULT_CSS = """
    MetricsPanel { height: auto; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self._text = Text()
        self._lines = 0

    def show(self, points: list[StepPoint], accept: Acceptance | None = None, label: str = "") -> None:
        self._text = metrics_text(points, accept or Acceptance(), label, max(8, self.size.width))
        lines = self._text.plain.count("\n") + 1
        self.refresh(layout=lines != self._lines)
        self._lines = lines

    def render(self) -> Text:
        return self._text

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(1, self._text.plain.count("\n") + 1)

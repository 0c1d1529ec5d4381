"""The metrics panel: forwards, tokens, TPF (with a sparkline of tokens per forward over the steps),
acceptance by draft position, tok/s, KV length and the current forward's role. Everything comes from the
step series of `studio.viz.stats` (the one metric definition, DESIGN §2.3)."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from studio.tui.widgets.live_text import LiveText

from studio.viz.stats import Acceptance, StepPoint

BAR = "▏▎▍▌▋▊▉█"
BAR_WIDTH = 10


def bar(frac: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of `frac` (0..1) in `width` cells, eighths included."""
    eighths = round(max(0.0, min(1.0, frac)) * width * 8)
    full, part = divmod(eighths, 8)
    return "█" * full + (BAR[part - 1] if part else "") + " " * (width - full - (1 if part else 0))


def decode_tok_s(points: list[StepPoint]) -> float | None:
    """Tokens emitted after the prefill ÷ the run's decode time, both read off the step series (live)."""
    prefill = next((p for p in points if p.role == "prefill"), None)
    last = points[-1] if points else None
    if prefill is None or last is None or last is prefill or last.ms is None or prefill.ms is None:
        return None
    span = (last.ms - prefill.ms) / 1000
    return (last.tokens - prefill.tokens) / span if span > 0 else None


class MetricsPanel(Vertical):
    DEFAULT_CSS = """
    MetricsPanel { height: auto; }
    MetricsPanel Sparkline { height: 3; margin: 0 0 1 0; }
    MetricsPanel .spark-label { color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        yield LiveText(id="metrics-numbers")
        yield Static("tokens per forward, by step", classes="spark-label")
        yield Sparkline([], id="metrics-spark")
        yield LiveText(id="metrics-accept")

    def show(self, points: list[StepPoint], accept: Acceptance | None = None, label: str = "") -> None:
        last = points[-1] if points else None
        if last is None:
            self.query_one("#metrics-numbers", LiveText).show_text(Text(f"{label}\nno steps yet", style="dim"))
            self.query_one("#metrics-spark", Sparkline).data = []
            self.query_one("#metrics-accept", LiveText).show_text(Text())
            return
        tok_s = decode_tok_s(points)
        prefill = next((p for p in points if p.role == "prefill"), None)
        lines = Text()
        lines.append(f"{label}\n" if label else "", style="bold")
        lines.append(f"step {last.step}  ·  {last.role or '—'}\n")
        lines.append("forwards ", style="dim").append(f"{last.forwards:<6}")
        lines.append("tokens ", style="dim").append(f"{last.tokens}\n")
        lines.append("TPF      ", style="dim").append(f"{last.tpf:.2f}\n" if last.tpf is not None else "—\n")
        lines.append("tok/s    ", style="dim").append(f"{tok_s:.1f}\n" if tok_s is not None else "—\n")
        lines.append("KV       ", style="dim").append(f"{last.kv_len if last.kv_len is not None else '—'}")
        if prefill is not None and prefill.wall_ms is not None:
            lines.append(f"  (prefill {prefill.wall_ms:.0f} ms)", style="dim")
        self.query_one("#metrics-numbers", LiveText).show_text(lines)
        self.query_one("#metrics-spark", Sparkline).data = [p.emitted for p in points if p.role not in (None, "prefill")]
        self.query_one("#metrics-accept", LiveText).show_text(acceptance_text(accept or Acceptance()))


def acceptance_text(accept: Acceptance) -> Text:
    """Acceptance overall and by draft slot, as bars (nothing verified: says so)."""
    if not accept.verified:
        return Text("acceptance: n/a (nothing verified)", style="dim")
    out = Text()
    out.append("acceptance ", style="dim").append(f"{accept.rate:.0%}  ({accept.accepted}/{accept.verified})\n")
    for k, (rate, n) in enumerate(zip(accept.by_pos, accept.verified_by_pos), 1):
        out.append(f"slot {k:<2} ", style="dim").append(bar(rate), style="#009E73")
        out.append(f" {rate:4.0%}  n={n}\n", style="dim")
    return out

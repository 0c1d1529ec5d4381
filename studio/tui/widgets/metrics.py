"""The metrics panel: forwards, tokens, TPF (with a sparkline of tokens per forward over the steps),
acceptance by draft position, tok/s, KV length (and the slots a cache refresh recomputed at this step), the
current forward's role and, for a cost-aware strategy, the draft count it planned, all read off a run's `RunNumbers` (`studio.viz.view`): counted by `studio.events.metrics`,
the one definition (docs/metrics.md).

One widget drawing one Text: it is redrawn every frame while a run decodes, and a single repaint (a
layout pass only when a new draft slot adds a line) keeps the UI thread's share of the GIL small.
"""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from studio.viz.palette import FORWARD_ROLES
from studio.viz.stats import Acceptance
from studio.viz.view import RunNumbers

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


def cut(text: str, width: int) -> str:
    """`text` in at most `width` characters, "…" marking a cut."""
    return text if len(text) <= width else text[:width - 1] + "…"


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


def plan_text(drafts: int, max_drafts: int, gain: float) -> str:
    """A cost-aware plan in a few words: '3/3 drafts for 1.24x AR' or 'AR step (drafts do not pay)'."""
    if drafts == 0:
        return "AR step (drafts do not pay)"
    return f"{drafts}/{max_drafts} drafts for {gain:.2f}× AR"


def metrics_text(numbers: RunNumbers, label: str, width: int) -> Text:
    points, tally, last = numbers.points, numbers.tally, numbers.last
    out = Text()
    if label:
        out.append(f"{label}\n", style="bold")
    if last is None:
        out.append("no steps yet", style="dim")
        return out
    tpf, tok_s = numbers.tpf, numbers.tok_s()
    prefill = next((p for p in points if p.role == "prefill"), None)
    out.append(f"step {last.step}  ·  {last.role or '—'}\n")
    if last.role in FORWARD_ROLES:   # what the role does, on one line (F1 lists every role)
        out.append(f"{cut(FORWARD_ROLES[last.role], width)}\n", style="dim")
    if last.plan is not None:         # cost-aware drafting: what this forward carried and why
        out.append("plan     ", style="dim").append(plan_text(*last.plan) + "\n")
    out.append("forwards ", style="dim").append(f"{tally.forwards:<6}")
    out.append("tokens ", style="dim").append(f"{tally.n_tokens}\n")
    out.append("TPF      ", style="dim").append(f"{tpf:.2f}\n" if tpf is not None else "—\n")
    out.append("tok/s    ", style="dim").append(f"{tok_s:.1f}\n" if tok_s is not None else "—\n")
    out.append("KV       ", style="dim").append(f"{last.kv_len if last.kv_len is not None else '—'}")
    if last.refreshed:   # an approximate cache recomputed these slots at this step; the length stays (one line)
        out.append("  ⟳ refresh " + " ".join(f"[{a},{b})" for a, b in last.refreshed), style="bold #E69F00")
    elif prefill is not None and prefill.wall_ms is not None:
        out.append(f"  (prefill {prefill.wall_ms:.0f} ms)", style="dim")
    per_step = [p.emitted for p in points if p.role not in (None, "prefill")]
    out.append(f"\ntokens per forward, by step (max {max(per_step, default=0)})\n", style="dim")
    out.append(sparkline(per_step, width) or " ", style="#0072B2")
    out.append("\n\n")
    out.append_text(acceptance_text(numbers.acceptance))
    return out


class MetricsPanel(Widget):
    DEFAULT_CSS = """
    MetricsPanel { height: auto; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self._text = Text()
        self._lines = 0
        self._shown: tuple[RunNumbers | None, str] = (None, "")

    def show(self, numbers: RunNumbers | None, label: str = "") -> None:
        """Show `numbers` (None: a run that has not started)."""
        self._shown = numbers, label
        self._text = metrics_text(numbers or RunNumbers(), label, max(8, self.size.width))
        lines = self._text.plain.count("\n") + 1
        self.refresh(layout=lines != self._lines)
        self._lines = lines

    def on_resize(self) -> None:
        self.show(*self._shown)   # the sparkline and the role's line are cut to the width (hidden: none at all)

    def render(self) -> Text:
        return self._text

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(1, self._text.plain.count("\n") + 1)

"""The figures of `trace analyze` (studio.traces.analysis), static SVG like the HTML report's (`studio.viz.svg`):
one grouped-bar chart per question, a bar per run in each bin, hover text with the counts behind every bar."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from studio.viz.palette import RUN_COLORS
from studio.viz.svg import Plot, ticks


def grouped_bars(title: str, x_title: str, y_title: str, bins: Sequence[str],
                 series: Sequence[tuple[str, Sequence[float | None], Sequence[str]]], percent: bool = False,
                 empty: str = "nothing to show") -> str:
    """`series`: (run label, a value per bin or None, a hover text per bin). Empty bins draw nothing; with no
    value at all the chart is its title and `empty` (why)."""
    values = [v for _, vs, _ in series for v in vs if v is not None]
    if not bins or not values:
        plot = Plot(title, (0, 1), (0, 1), height=80)
        plot.note(empty)
        return plot.svg()
    top = 1.12 if percent else max(values) * 1.15 or 1.0
    plot = Plot(title, (-0.5, len(bins) - 0.5), (0, top), width=max(620, 40 * len(bins) + 120), top=40)
    plot.axes(x_title, y_title, ticks(1.0 if percent else max(values), percent=percent), list(enumerate(bins)))
    width = 0.8 / max(1, len(series))
    for s, (label, vs, tips) in enumerate(series):
        color = RUN_COLORS[s % len(RUN_COLORS)]
        plot.legend(label, color)
        for i, (v, tip) in enumerate(zip(vs, tips)):
            if v is not None:
                x0 = i - 0.4 + s * width
                plot.bar(x0, x0 + width * 0.92, 0, v, color, f"{label} · {bins[i]}: {tip}")
    return plot.svg()


def _rates(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float | None], list[str]]:
    return ([r["rate"] for r in rows],
            [f"{r['accepted']}/{r['verified']} accepted" + ("" if r["rate"] is None else f" ({r['rate']:.0%})")
             for r in rows])


def _edges(rows: Sequence[Mapping[str, Any]], digits: int) -> list[str]:
    return [f"{r['from']:.{digits}f}–{'' if r['to'] is None else format(r['to'], f'.{digits}f')}" for r in rows]


def _longest(analyses: Sequence[Mapping[str, Any]], key: str) -> list:
    return max((a[key] or [] for a in analyses), key=len, default=[])


def _rate_series(labels: Sequence[str], analyses: Sequence[Mapping[str, Any]], key: str, n: int):
    series = []
    for label, a in zip(labels, analyses):
        rows = list(a[key] or [])
        rows += [{"rate": None, "accepted": 0, "verified": 0}] * (n - len(rows))
        series.append((label, *_rates(rows)))
    return series


def analysis_svgs(labels: Sequence[str], analyses: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every figure of the analysis of these runs (one bar per run in each bin), in the report's order."""
    out = []
    slots = _longest(analyses, "by_slot")
    out.append(grouped_bars("Acceptance by draft slot", "draft slot (in verification order)", "accepted / verified",
                            [str(r["slot"]) for r in slots], _rate_series(labels, analyses, "by_slot", len(slots)),
                            percent=True))
    positions = _longest(analyses, "by_position")
    out.append(grouped_bars("Acceptance by position in the answer", "output positions", "accepted / verified",
                            [f"{r['from']}–{r['to'] - 1}" for r in positions],
                            _rate_series(labels, analyses, "by_position", len(positions)), percent=True))
    entropy = _longest(analyses, "by_entropy")
    out.append(grouped_bars("Acceptance by the target's entropy", "target entropy (nats)", "accepted / verified",
                            _edges(entropy, 2), _rate_series(labels, analyses, "by_entropy", len(entropy)),
                            percent=True, empty="not recorded (isd, r-isd, jacobi and jacobi-mr record it)"))
    confidence = _longest(analyses, "by_confidence")
    out.append(grouped_bars("Acceptance by the draft's confidence", "draft probability q", "accepted / verified",
                            _edges(confidence, 2), _rate_series(labels, analyses, "by_confidence", len(confidence)),
                            percent=True))
    calibration = _longest(analyses, "calibration")
    series = []
    for label, a in zip(labels, analyses):
        rows = a["calibration"] or [{"share": None, "right": 0, "filled": 0}] * len(calibration)
        series.append((label, [r["share"] for r in rows],
                       [f"{r['right']}/{r['filled']} equal the reference's token" for r in rows]))
    out.append(grouped_bars("Calibration of the unmasking confidence", "filled at confidence ≥",
                            "share equal to the reference's token", [f"{r['confidence']:g}" for r in calibration],
                            series, percent=True, empty="no unmasked tokens, or no reference run"))
    roles = list(dict.fromkeys(role for a in analyses for role in a["by_role"]))
    out.append(grouped_bars("Tokens per forward by the forward's role", "role of the step's last forward",
                            "tokens / forward", roles,
                            [(label, [(a["by_role"].get(r) or {}).get("tpf") for r in roles],
                              [_role_tip(a["by_role"].get(r)) for r in roles]) for label, a in zip(labels, analyses)]))
    rows = sorted({r["rows"] for a in analyses for r in a["time"]["by_rows"]})
    out.append(grouped_bars("Forward time by row count", "rows in the forward", "median ms", [str(n) for n in rows],
                            [(label, *_times(a["time"]["by_rows"], rows)) for label, a in zip(labels, analyses)]))
    out.append(grouped_bars("Where the decode time went", "", "ms", ["forwards", "the rest"],
                            [(label, [a["time"]["forward_ms"], a["time"]["other_ms"]],
                              [f"{a['time']['forward_ms']:.0f} ms", _ms(a["time"]["other_ms"])])
                             for label, a in zip(labels, analyses)]))
    return out


def _role_tip(row: Mapping[str, Any] | None) -> str:
    if not row:
        return "none"
    return f"{row['tokens']} tokens in {row['forwards']} forwards of {row['rows']} rows"


def _times(by_rows: Sequence[Mapping[str, Any]], rows: Sequence[int]) -> tuple[list, list]:
    at = {r["rows"]: r for r in by_rows}
    return ([at[n]["median_ms"] if n in at else None for n in rows],
            [f"{at[n]['forwards']} forwards, median {at[n]['median_ms']:.1f} ms, {at[n]['total_ms']:.0f} ms in all"
             if n in at else "none" for n in rows])


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f} ms"

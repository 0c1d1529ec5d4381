"""The report's charts keep their words readable: bar labels that would overlap side by side slant (and the chart
grows to hold them), a legend too long for one row wraps (and pushes the chart down) instead of running off."""
import re

from studio.viz.svg import CHAR_PX, Plot, ticks

LONG = ["ar", "ar · smollm2-isd", "isd", "r-isd", "jacobi", "jacobi-mr-cpu", "blockdiff", "s2d2-cpu", "simsd-cpu",
        "canvas-cpu", "canvas-cpu · cache=none"]


def bars(labels):
    plot = Plot("TPF", (-0.5, len(labels) - 0.5), (0, 2), width=400, height=260, top=40)
    plot.axes("", "", ticks(2), list(enumerate(labels)))
    return plot.svg()


def tick_labels(svg):
    return re.findall(r'<text ([^>]*)font-size="11">([^<]*)</text>', svg)


def test_bar_labels_slant_only_when_they_would_overlap_and_the_chart_holds_them():
    side_by_side = tick_labels(bars(["ar", "isd", "r-isd"]))
    assert len(side_by_side) == 3 and not any("rotate" in attrs for attrs, _ in side_by_side)
    svg = bars(LONG)
    slanted = [(attrs, text) for attrs, text in tick_labels(svg) if "rotate(-40" in attrs]
    assert len(slanted) == len(LONG)
    height = float(re.search(r'height="([\d.]+)"', svg).group(1))
    baseline = max(float(re.search(r' y="([\d.]+)"', attrs).group(1)) for attrs, _ in slanted)
    assert height >= baseline + 0.64 * CHAR_PX * len(LONG[-1])   # the longest label's drop at 40 degrees fits


def test_a_long_legend_wraps_inside_the_chart_and_pushes_the_marks_down():
    plot = Plot("Tokens vs forwards", (0, 10), (0, 10), width=400, height=260)
    plot.axes("forwards", "tokens", ticks(10), ticks(10))
    for name in LONG:
        plot.legend(name, "#000")
    svg = plot.svg()
    items = [(float(x), float(y), name) for x, y, name in
             re.findall(r'<text x="([\d.]+)" y="([\d.]+)" font-size="11.5">([^<]*)</text>', svg)]
    assert [name for *_, name in items] == LONG
    assert all(x + 6.6 * len(name) <= 400 for x, _, name in items)
    rows = sorted({y for _, y, _ in items})
    assert len(rows) > 1
    height = float(re.search(r'height="([\d.]+)"', svg).group(1))
    assert height == 260 + rows[-1] - rows[0]
    assert f'<g transform="translate(0 {int(rows[-1] - rows[0])})">' in svg
    assert "<g transform" not in Plot("one row", (0, 1), (0, 1)).svg()

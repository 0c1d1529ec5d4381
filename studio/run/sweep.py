"""Accuracy under parallelism: a bench's strategies at every setting of their knobs (`bench --sweep KEY=V1,V2,...`),
and the AUP score of each strategy's accuracy-TPF curve.

AUP (Accuracy Under Parallelism, d3LLM, arXiv 2601.07568) scores a curve of (TPF rho_i, accuracy y_i in %) points,
sorted by TPF: the points below y_1 - 5 (five points under the accuracy at the lowest parallelism) are left out, and

    AUP = rho_1 * y_1 + 1/2 * sum_{i >= 2} (rho_i - rho_{i-1}) * (y_i * W(y_i) + y_{i-1} * W(y_{i-1})),
    W(y) = min(exp(-alpha * (1 - y / y_max)), 1),  alpha = 3,

with y_max the best accuracy on the task (over every run of the bench): the area under the curve, with the
parallelism bought by losing accuracy discounted exponentially. TPF, not tok/s: it holds on any device.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Mapping

from studio.errors import BadInput
from studio.run.config import RunConfig, parse_value

ALPHA = 3.0          # d3LLM's penalty factor
DROP = 5.0           # accuracy points below the first point's that a curve still counts


@dataclass(frozen=True)
class Sweep:
    key: str
    values: tuple


def parse_sweep(text: str) -> Sweep:
    """`threshold=0.5,0.7,0.9` (each value read as `--param` reads one)."""
    key, sep, raw = text.partition("=")
    values = tuple(parse_value(v.strip()) for v in raw.split(",") if v.strip())
    if not sep or not key.strip() or not values:
        raise BadInput(f"--sweep expects KEY=V1,V2,..., got {text!r}")
    if len(set(map(repr, values))) != len(values):
        raise BadInput(f"--sweep {key.strip()}: a value is listed twice ({raw})")
    return Sweep(key.strip().replace("-", "_"), values)


def expand(configs: Mapping[str, RunConfig], sweeps: list[Sweep]) -> tuple[dict[str, RunConfig], dict[str, str]]:
    """Every config but the first (the baseline) at every combination of the swept values of the parameters it has,
    labelled `LABEL · key=value, ...`; a config with none of them runs once as it is. Returns the configs and each
    label's curve (the label it was swept from). BadInput for a key no listed strategy has, or a value a strategy
    refuses (before anything loads)."""
    if not sweeps:
        return dict(configs), {label: label for label in configs}
    if len({s.key for s in sweeps}) != len(sweeps):
        raise BadInput("--sweep: each parameter once (give all its values in one --sweep KEY=V1,V2)")
    out: dict[str, RunConfig] = {}
    curves: dict[str, str] = {}
    used: set[str] = set()
    for i, (label, config) in enumerate(configs.items()):
        strategy, _ = config.build()
        own = {f.name for f in dataclasses.fields(strategy.params)} if i else set()
        mine = [s for s in sweeps if s.key in own]
        used |= {s.key for s in mine}
        if not mine:
            out[label], curves[label] = config, label
            continue
        for combo in itertools.product(*(s.values for s in mine)):
            setting = dict(zip((s.key for s in mine), combo))
            swept = f"{label} · " + ", ".join(f"{k}={v}" for k, v in setting.items())
            out[swept] = dataclasses.replace(config, params={**config.params, **setting})
            out[swept].build()
            curves[swept] = label
    unknown = [s.key for s in sweeps if s.key not in used]
    if unknown:
        raise BadInput(f"--sweep {unknown[0]}: no listed strategy has that parameter "
                       f"({', '.join(label for label in list(configs)[1:]) or 'only the baseline'})")
    return out, curves


def aup(points: list[tuple[float, float]], y_max: float, alpha: float = ALPHA) -> float | None:
    """The AUP of (TPF, accuracy in %) points (any order); None without points."""
    if not points:
        return None
    points = sorted(points)
    floor = points[0][1] - DROP
    kept = [(rho, y) for rho, y in points if y >= floor]

    def weighted(y: float) -> float:
        return y * (min(math.exp(-alpha * (1 - y / y_max)), 1.0) if y_max > 0 else 1.0)
    (rho_1, y_1), rest = kept[0], kept[1:]
    area = rho_1 * y_1
    for (r0, y0), (r1, y1) in zip(kept, rest):
        area += 0.5 * (r1 - r0) * (weighted(y1) + weighted(y0))
    return area


def add_aup(report: dict, curves: Mapping[str, str]) -> dict:
    """A scored bench report (`accuracy` per run) with each run's `curve` and `aup` = {curve: AUP of its runs'
    median-TPF and accuracy points}, y_max the best accuracy of every run."""
    rows = report["strategies"]
    for row in rows:
        row["curve"] = curves.get(row["label"], row["label"])
    y_max = 100 * max(row["accuracy"] for row in rows)
    report["aup"] = {curve: aup([(r["tpf"]["median"], 100 * r["accuracy"]) for r in rows if r["curve"] == curve],
                                y_max)
                     for curve in dict.fromkeys(row["curve"] for row in rows)}
    report["aup_definition"] = {"alpha": ALPHA, "drop": DROP, "y_max": y_max}
    return report


def aup_line(report: dict) -> str:
    """The AUP of every curve, as the bench table's caption says it."""
    scores = " · ".join(f"{curve} {value:.2f}" for curve, value in report["aup"].items() if value is not None)
    return f"AUP (d3LLM: accuracy % x TPF, alpha {ALPHA:g}, best accuracy {report['aup_definition']['y_max']:.0f}%): {scores}"

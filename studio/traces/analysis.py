"""`dlm-studio trace analyze`: what a run's events say across its steps, as tables of plain numbers.

Acceptance of the verified proposals by draft slot, by position in the answer, by the target's entropy (the
optional `h` of accept/reject events: strategies that verify from raw logits record it) and by the draft's own
probability `q`; for runs that fill tokens unverified (`unmask`), the calibration of their confidence against an
exact reference trace (of the tokens filled at confidence >= c, the share equal to the reference's token at that
position); tokens per forward by the forward's role; and where the decode time went (forward time by row count
against the rest). Every number comes from the events (docs/events.md), nothing from the strategy or the model.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Iterable, Mapping

from studio.events.metrics import position_slots

POSITION_BIN = 16                                   # answer positions per bucket
ENTROPY_EDGES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)     # nats; the last bin is open
CONFIDENCE_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95)  # the draft's q; the last bin is [0.95, 1]
CALIBRATION_AT = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)


def verdicts(events: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Every verified proposal: {step, slot (its position's rank in its step: a tree's siblings share one), pos,
    accepted, q, h (None: not recorded)}."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e["t"] == "accept":
            hs = e.get("h") or [None] * len(e["pos"])
            by_step[e["step"]] += [{"step": e["step"], "pos": p, "accepted": True, "q": q, "h": h}
                                   for p, q, h in zip(e["pos"], e["q"], hs)]
        elif e["t"] == "reject":
            by_step[e["step"]].append({"step": e["step"], "pos": e["pos"], "accepted": False, "q": e["q"],
                                       "h": e.get("h")})
    out = []
    for chain in by_step.values():
        slot = position_slots(v["pos"] for v in chain)
        for v in sorted(chain, key=lambda v: v["pos"]):
            out.append({**v, "slot": slot[v["pos"]] + 1})
    return out


def _rate(group: list[dict]) -> dict:
    n = len(group)
    a = sum(v["accepted"] for v in group)
    return {"verified": n, "accepted": a, "rate": a / n if n else None}


def _binned(vs: list[dict], key: str, edges: tuple[float, ...], top: float | None = None) -> list[dict]:
    """Acceptance in the bins [edges[i], edges[i + 1]) of `key`, the last one open (shown up to `top`)."""
    rows = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        group = [v for v in vs if v[key] is not None and v[key] >= lo and (hi is None or v[key] < hi)]
        rows.append({"from": lo, "to": top if hi is None else hi, **_rate(group)})
    return rows


def calibration(events: Iterable[Mapping[str, Any]], reference_tokens: list[int] | None) -> list[dict] | None:
    """Of the tokens an `unmask` filled at confidence >= c, how many equal the reference's token at that output
    position (the last fill of a position counts: an edit or remask can replace it); None without a reference or
    unmask events."""
    filled: dict[int, tuple[int, float]] = {}
    for e in events:
        if e["t"] in ("unmask", "edit"):
            for p, t, c in zip(e["pos"], e["tok"], e["conf"]):
                filled[p] = (t, c)
        elif e["t"] == "remask":
            for p in e["pos"]:
                filled.pop(p, None)
    if reference_tokens is None or not filled:
        return None
    rows = []
    for c in CALIBRATION_AT:
        at = [(p, t) for p, (t, conf) in filled.items() if conf is not None and conf >= c]
        right = sum(p < len(reference_tokens) and reference_tokens[p] == t for p, t in at)
        rows.append({"confidence": c, "filled": len(at), "right": right, "share": right / len(at) if at else None})
    return rows


def tokens_by_role(events: Iterable[Mapping[str, Any]]) -> dict[str, dict]:
    """For each forward role (decode steps only): forwards, rows, and the tokens emitted by the steps whose last
    forward had that role (a step's output is its last forward's work) -> tokens per forward."""
    steps: dict[int, dict] = defaultdict(lambda: {"rows": [], "role": None, "tokens": 0})
    for e in events:
        if e["step"] == 0:
            continue
        if e["t"] == "forward":
            steps[e["step"]]["rows"].append(e["n_tokens"])
            steps[e["step"]]["role"] = e["role"]
        elif e["t"] == "emit":
            steps[e["step"]]["tokens"] += len(e["tok"])
    out: dict[str, dict] = {}
    for s in steps.values():
        if s["role"] is None:
            continue
        row = out.setdefault(s["role"], {"forwards": 0, "rows": 0, "tokens": 0})
        row["forwards"] += len(s["rows"])
        row["rows"] += sum(s["rows"])
        row["tokens"] += s["tokens"]
    for row in out.values():
        row["tpf"] = row["tokens"] / row["forwards"] if row["forwards"] else None
    return out


def time_split(events: list[Mapping[str, Any]]) -> dict:
    """Decode time (after the prefill step, on the run's clock) split into forwards by row count and the rest."""
    by_rows: dict[int, list[float]] = defaultdict(list)
    prefill_end = last = None
    for e in events:
        if e["ms"] is not None:
            if e["step"] == 0:
                prefill_end = max(e["ms"], prefill_end or e["ms"])
            last = max(e["ms"], last or e["ms"])
        if e["t"] == "forward" and e["step"] > 0 and e["wall_ms"] is not None:
            by_rows[e["n_tokens"]].append(e["wall_ms"])
    forward_ms = sum(sum(v) for v in by_rows.values())
    decode_ms = None if prefill_end is None or last is None else max(0.0, last - prefill_end)
    return {"by_rows": [{"rows": n, "forwards": len(v), "median_ms": statistics.median(v), "total_ms": sum(v)}
                        for n, v in sorted(by_rows.items())],
            "forward_ms": forward_ms, "decode_ms": decode_ms,
            "other_ms": None if decode_ms is None else max(0.0, decode_ms - forward_ms)}


def analyze(trace, reference=None) -> dict:
    """The analysis of one trace (a `studio.events.Trace`); `reference`: the exact run's trace for calibration,
    used for a trace of its own strategy (a cached canvas run and its cache=none twin) or when it is an `ar` run
    (the exact output of every lossless rule)."""
    events = trace.events
    vs = verdicts(events)
    slots = max((v["slot"] for v in vs), default=0)
    positions = max((v["pos"] for v in vs), default=-1) // POSITION_BIN + 1
    footer = trace.footer or {}
    ref_tokens = None
    if reference is not None and reference.header.get("strategy") in ("ar", trace.header.get("strategy")):
        ref_tokens = [t for e in reference.events if e["t"] == "emit" for t in e["tok"]]
    return {
        "strategy": trace.header.get("strategy"), "params": trace.header.get("params", {}),
        "tokens": footer.get("n_tokens"), "forwards": footer.get("forwards"), "tpf": footer.get("tpf"),
        "verified": len(vs), **{k: v for k, v in _rate(vs).items() if k != "verified"},
        "by_slot": [{"slot": k, **_rate([v for v in vs if v["slot"] == k])} for k in range(1, slots + 1)],
        "by_position": [{"from": b * POSITION_BIN, "to": (b + 1) * POSITION_BIN,
                         **_rate([v for v in vs if v["pos"] // POSITION_BIN == b])} for b in range(positions)],
        "by_entropy": _binned(vs, "h", ENTROPY_EDGES) if any(v["h"] is not None for v in vs) else None,
        "by_confidence": _binned(vs, "q", CONFIDENCE_EDGES, top=1.0) if vs else None,
        "calibration": calibration(events, ref_tokens),
        "by_role": tokens_by_role(events),
        "time": time_split(events),
    }

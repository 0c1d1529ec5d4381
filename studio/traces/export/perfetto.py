"""Perfetto export: Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

One process per run; tracks: `forwards` (one complete slice per forward, named by role), `decisions`
(instant events: accept, reject, resample, bonus, unmask, edit, remask, emit, route, kv rollback/refresh),
`blocks` (async slices, one per block open→close); counters for running TPF, running acceptance, tokens
emitted and KV length; flow arrows from the forward that proposed a position to the forward whose
accept/reject verified it.
"""
from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from studio.events import SCHEMA, Event, Trace
from studio.traces.export.common import open_for_write, run_meta

TID_FORWARDS, TID_DECISIONS, TID_BLOCKS = 1, 2, 3


def _us(ms: float | None) -> float:
    return 0.0 if ms is None else round(ms * 1000.0, 3)


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _instant_name(e: Mapping[str, Any]) -> str:
    t = e["t"]
    if t == "accept":
        return f"accept ×{len(e['pos'])}"
    if t in ("reject", "resample", "bonus"):
        return f"{t} @{e['pos']}"
    if t in ("unmask", "edit", "remask"):
        return f"{t} ×{len(e['pos'])}"
    if t == "emit":
        return f"emit ×{len(e['tok'])}"
    if t == "route":
        return "route: verify" if e["verify"] else "route: skip"
    if t == "kv" and e["op"] == "refresh":
        return f"kv refresh [{e['from_len']},{e['to_len']})"
    if t == "kv":
        return f"kv {e['op']} {e['from_len']}→{e['to_len']}"
    return t


def _track_names(pid: int, h: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The metadata events that name and order a run's process and its three tracks."""
    name = f"{h.get('strategy', '?')} · {h.get('model', {}).get('name', '?')} · {str(h.get('run_id', ''))[:8]}"
    out = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": f"seed={h.get('seed')}"}},
    ]
    for tid, tname in ((TID_FORWARDS, "forwards"), (TID_DECISIONS, "decisions"), (TID_BLOCKS, "blocks")):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": tname}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return out


def _forward_slices(pid: int, events: Sequence[Event]) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """The `forwards` track (a complete slice per forward), and each step's anchor for flows: the middle
    of its (first) forward slice."""
    out: list[dict[str, Any]] = []
    anchor: dict[int, float] = {}
    for e in events:
        if e["t"] != "forward":
            continue
        wall = e["wall_ms"] if e["wall_ms"] is not None else 0.0
        start_ms = max(0.0, (e["ms"] or 0.0) - wall)
        ts, dur = _us(start_ms), _us(wall)
        out.append({"ph": "X", "cat": "forward", "name": e["role"], "pid": pid, "tid": TID_FORWARDS,
                    "ts": ts, "dur": dur,
                    "args": {"step": e["step"], "n_tokens": e["n_tokens"], "lora_rows": e["lora_rows"],
                             "wall_ms": e["wall_ms"]}})
        anchor.setdefault(e["step"], ts + dur / 2)
    return out, anchor


def _step_ends(events: Sequence[Event]) -> dict[int, float]:
    """step -> the time of its last event: where the step's counters are drawn."""
    ends: dict[int, float] = {}
    for e in events:
        if e["ms"] is not None:
            ends[e["step"]] = max(ends.get(e["step"], 0.0), e["ms"])
    return ends


class _EventTracks:
    """The parts of one run drawn event by event, in trace order: `decisions` instants, `blocks` slices,
    verify flows onto the `forwards` track, and the counters (after each step)."""

    def __init__(self, pid: int, events: Sequence[Event], anchor: Mapping[int, float],
                 flow_ids: Iterator[int], block_ids: Iterator[int]) -> None:
        self.pid, self.events, self.anchor = pid, events, anchor
        self.flow_ids, self.block_ids = flow_ids, block_ids
        self.step_end = _step_ends(events)
        self.out: list[dict[str, Any]] = []
        self.pending: dict[int, int] = {}     # pos -> step of the latest unverified proposal
        self.open_blocks: dict[tuple[int, int], int] = {}
        self.tokens = self.forwards = self.accepted = self.verified = 0

    def build(self) -> list[dict[str, Any]]:
        last_step = None
        for e in self.events:
            if last_step is not None and e["step"] != last_step:
                self._counters(last_step)
            last_step = e["step"]
            self._add(e)
        if last_step is not None:
            self._counters(last_step)
        self._close_open_blocks()
        return self.out

    def _counter(self, name: str, ts: float, args: dict[str, Any]) -> None:
        self.out.append({"ph": "C", "name": name, "pid": self.pid, "tid": 0, "ts": ts, "args": args})

    def _counters(self, step: int) -> None:
        """The running counters as they stand at the end of `step`."""
        ts = _us(self.step_end.get(step))
        if self.forwards:
            self._counter("TPF (running)", ts, {"TPF": round(self.tokens / self.forwards, 6)})
        if self.verified:
            self._counter("acceptance (running)", ts, {"accept rate": round(self.accepted / self.verified, 6)})
        self._counter("tokens emitted", ts, {"tokens": self.tokens})

    def _add(self, e: Event) -> None:
        """One event: what it changes on the other tracks, then its instant on `decisions` (if it has one)."""
        kind, ts = e["t"], _us(e["ms"])
        if kind == "forward":   # its slice is on `forwards` already
            self.forwards += e["role"] != "prefill"
            return
        args = _clean({k: v for k, v in e.items() if k not in ("t", "ms")})
        if kind == "propose":
            for p in e["pos"]:
                self.pending[p] = e["step"]
        elif kind in ("accept", "reject"):
            self._verify(e)
        elif kind == "emit":
            self.tokens += len(e["tok"])
        elif kind == "block":
            self._block(e, ts, args)
            return
        elif kind == "kv":
            if e["op"] != "refresh":   # a refresh names the slots it recomputed; the length stays
                self._counter("KV length", ts, {"tokens": e["to_len"]})
            if e["op"] == "commit":
                return
        self.out.append({"ph": "i", "s": "t", "cat": kind, "name": _instant_name(e), "pid": self.pid,
                         "tid": TID_DECISIONS, "ts": ts, "args": args})

    def _verify(self, e: Event) -> None:
        """Tally an accept/reject; a flow from each earlier step that proposed some of its positions."""
        kind, step = e["t"], e["step"]
        ps = e["pos"] if kind == "accept" else [e["pos"]]
        if kind == "accept":
            self.accepted += len(ps)
        self.verified += len(ps)
        sources: dict[int, list[int]] = {}
        for p in ps:
            src = self.pending.pop(p, None)
            if src is not None:
                sources.setdefault(src, []).append(p)
        for src, positions in sorted(sources.items()):
            if src in self.anchor and step in self.anchor and src != step:
                self._flow(src, step, positions, kind)

    def _flow(self, src: int, step: int, positions: list[int], outcome: str) -> None:
        fid = next(self.flow_ids)
        name = f"verify pos {','.join(map(str, positions))}"
        self.out.append({"ph": "s", "cat": "verify", "name": name, "id": fid, "pid": self.pid,
                         "tid": TID_FORWARDS, "ts": self.anchor[src], "args": {"positions": positions}})
        self.out.append({"ph": "f", "bp": "e", "cat": "verify", "name": name, "id": fid, "pid": self.pid,
                         "tid": TID_FORWARDS, "ts": self.anchor[step], "args": {"outcome": outcome}})

    def _block(self, e: Event, ts: float, args: dict[str, Any]) -> None:
        """A block open begins an async slice on `blocks`, its close ends it (a close never opened: nothing)."""
        key = (e["start"], e["end"])
        if e["op"] == "open":
            bid = self.open_blocks[key] = next(self.block_ids)
            self._block_edge("b", key, bid, ts, args)
            return
        bid = self.open_blocks.pop(key, None)
        if bid is not None:
            self._block_edge("e", key, bid, ts, args)

    def _block_edge(self, ph: str, key: tuple[int, int], bid: int, ts: float, args: dict[str, Any]) -> None:
        self.out.append({"ph": ph, "cat": "block", "name": f"block [{key[0]},{key[1]})",
                         "id": f"0x{self.pid:x}{bid:06x}", "pid": self.pid, "tid": TID_BLOCKS, "ts": ts, "args": args})

    def _close_open_blocks(self) -> None:
        """Blocks still open at the end of the trace end with its last event."""
        end = _us(max(self.step_end.values(), default=0.0))
        for key, bid in self.open_blocks.items():
            self._block_edge("e", key, bid, end, {})


def perfetto_json(traces: Sequence[Trace]) -> dict[str, Any]:
    """The Chrome trace-event document for one or several runs (a process per run)."""
    out: list[dict[str, Any]] = []
    flow_ids, block_ids = itertools.count(1), itertools.count(1)   # across runs: a flow id is unique per document
    for pid, t in enumerate(traces, start=1):
        slices, anchor = _forward_slices(pid, t.events)
        out += _track_names(pid, t.header)
        out += slices
        out += _EventTracks(pid, t.events, anchor, flow_ids, block_ids).build()
    meta: dict[str, Any] = {"dlm-studio.trace": SCHEMA, "runs": [run_meta(t) for t in traces]}
    if len(traces) == 1:
        meta.update(run_meta(traces[0]))
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": _clean(meta)}


def write_perfetto(traces: Sequence[Trace], path: str | os.PathLike) -> Path:
    path = Path(path)
    doc = perfetto_json(traces)
    with open_for_write(path) as f:
        json.dump(doc, f, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return path

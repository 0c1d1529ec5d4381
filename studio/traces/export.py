"""Trace exports: Parquet, CSV, Perfetto (Chrome trace JSON) and a self-contained HTML report.

All of them are derived from the JSONL trace (the source of truth) and nothing else.

Parquet / CSV: ONE ROW PER EVENT. Columns: `run_id, strategy, t, step, ms`, then the union of the
schema's event fields (a field a kind lacks is null), then `extra` (a JSON object of fields the schema
does not know, from a newer minor version; null when none). In Parquet a field that is a list for
some kinds and a scalar for others (`pos`, `tok`, `p`, `q`: lists in accept/propose/unmask/edit/remask/emit,
scalars in reject/resample/bonus) is a list column and the scalars are one-element lists;
`read_parquet_events` gives the original scalars back. In CSV, lists are JSON-encoded and scalars
stay scalars, so every non-string cell is valid JSON. The Parquet file's schema metadata key
`dlm-studio.trace` holds the header and footer JSON.

Perfetto: Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing). One process per
run; tracks: `forwards` (one complete slice per forward, named by role), `decisions` (instant events:
accept, reject, resample, bonus, unmask, edit, remask, emit, route, kv rollback/refresh), `blocks` (async slices, one per
block open→close); counters for running TPF, running acceptance, tokens emitted and KV length; flow
arrows from the forward that proposed a position to the forward whose accept/reject verified it.
"""
from __future__ import annotations

import csv
import html
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union, get_args, get_origin

from studio.errors import BadInput
from studio.events import EVENT_FIELDS, SCHEMA, Event, Trace, read_trace, summarize
from studio.files import atomic_path, atomic_write, check_writable

FORMATS = ("parquet", "perfetto", "html", "csv")
SUFFIXES = {"parquet": ".parquet", "perfetto": ".perfetto.json", "html": ".html", "csv": ".csv"}
META_KEY = b"dlm-studio.trace"
PARQUET_FORMAT = "dlm-studio.events-parquet/1"
BASE_COLUMNS = ("run_id", "strategy", "t", "step", "ms")

TraceLike = Union[Trace, str, os.PathLike]


def metrics_from_events(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The one metric definition (docs/metrics.md): `studio.events.summarize`."""
    return summarize(events)


def _as_trace(trace: TraceLike) -> Trace:
    return trace if isinstance(trace, Trace) else read_trace(trace)


def default_out(path: str | os.PathLike, fmt: str) -> Path:
    """`run.jsonl` -> `run.parquet` / `run.perfetto.json` / `run.html` / `run.csv`."""
    p = Path(path)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.stem
    return p.with_name(stem + SUFFIXES[fmt])


def export(trace: TraceLike, fmt: str, out_path: str | os.PathLike | None = None, *,
           title: str | None = None) -> Path:
    """Export one trace (a Trace or a path to a JSONL trace) to `fmt`; returns the path written."""
    if fmt not in FORMATS:
        raise BadInput(f"unknown export format {fmt!r} (choose from {', '.join(FORMATS)})")
    src_path = None if isinstance(trace, Trace) else trace
    t = _as_trace(trace)
    if out_path is None:
        if src_path is None:
            raise ValueError("out_path is required when exporting an in-memory Trace")
        out_path = default_out(src_path, fmt)
    out = Path(out_path)
    if fmt == "parquet":
        write_parquet([t], out)
    elif fmt == "csv":
        write_csv([t], out)
    elif fmt == "perfetto":
        write_perfetto([t], out)
    else:
        html_report([t], out, title)
    return out


def _open_for_write(path: Path, mode: str = "w"):
    """The whole export, written atomically (studio.files): the final name never holds a half-written file."""
    _check_writable(path)
    return atomic_write(path, mode, newline="" if "b" not in mode else None)


def _check_writable(path: Path) -> None:
    """Fail early (before building the export) when `path` cannot be written; creates nothing. Whether an
    existing file may be replaced is the caller's policy (the CLI's --force): here it is replaced."""
    check_writable(path, force=True)


# -- the column layout shared by Parquet and CSV ----------------------------------------------------
def _is_list(spec: Any) -> bool:
    return get_origin(spec) is list


def _elem(spec: Any) -> Any:
    return get_args(spec)[0] if _is_list(spec) else spec


def _column_specs() -> dict[str, tuple[bool, Any]]:
    """field -> (is a list column, element spec), over every event kind, in schema order."""
    out: dict[str, tuple[bool, Any]] = {}
    for fields in EVENT_FIELDS.values():
        for name, spec in fields.items():
            is_list, elem = _is_list(spec), _elem(spec)
            if name in out:
                was_list, was_elem = out[name]
                if was_elem is not elem and {was_elem, elem} <= {int, float}:
                    elem = float
                out[name] = (was_list or is_list, elem if was_elem in (int, float) else was_elem)
            else:
                out[name] = (is_list, elem)
    return out


_COLUMNS = _column_specs()
_KNOWN = {kind: frozenset(fields) for kind, fields in EVENT_FIELDS.items()}
_COMMON = frozenset(("t", "step", "ms"))


def _extra(event: Mapping[str, Any]) -> str | None:
    known = _KNOWN.get(event["t"], frozenset())
    extra = {k: v for k, v in event.items() if k not in _COMMON and k not in known}
    return json.dumps(extra, ensure_ascii=False, allow_nan=False) if extra else None


def _rows(traces: Sequence[Trace]) -> Iterable[tuple[Trace, Event]]:
    for t in traces:
        for e in t.events:
            yield t, e


# -- Parquet ----------------------------------------------------------------------------------------
def _arrow_type(spec: Any):
    import pyarrow as pa

    if spec is bool:
        return pa.bool_()
    if spec is int:
        return pa.int64()
    if spec is float:
        return pa.float64()
    return pa.string()  # str, Literal enums, anything else


def _arrow_schema(meta: bytes):
    import pyarrow as pa

    fields = [pa.field("run_id", pa.string()), pa.field("strategy", pa.string()), pa.field("t", pa.string()),
              pa.field("step", pa.int64()), pa.field("ms", pa.float64())]
    for name, (is_list, elem) in _COLUMNS.items():
        typ = _arrow_type(elem)
        fields.append(pa.field(name, pa.list_(typ) if is_list else typ))
    fields.append(pa.field("extra", pa.string()))
    return pa.schema(fields, metadata={META_KEY: meta})


def _run_meta(t: Trace) -> dict[str, Any]:
    return {"header": t.header, "footer": t.footer}


def write_parquet(traces: Sequence[Trace], path: str | os.PathLike) -> Path:
    """One row per event of every trace; schema metadata `dlm-studio.trace` = header/footer JSON."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    meta: dict[str, Any] = {"format": PARQUET_FORMAT, "schema": SCHEMA, "runs": [_run_meta(t) for t in traces]}
    if len(traces) == 1:
        meta.update(_run_meta(traces[0]))
    schema = _arrow_schema(json.dumps(meta, ensure_ascii=False, allow_nan=False).encode())
    cols: dict[str, list[Any]] = {f.name: [] for f in schema}
    for t, e in _rows(traces):
        cols["run_id"].append(t.header.get("run_id"))
        cols["strategy"].append(t.header.get("strategy"))
        cols["t"].append(e["t"])
        cols["step"].append(e["step"])
        cols["ms"].append(e["ms"])
        known = _KNOWN.get(e["t"], frozenset())
        for name, (is_list, _) in _COLUMNS.items():
            v = e.get(name) if name in known else None
            if is_list and v is not None and not isinstance(v, list):
                v = [v]
            cols[name].append(v)
        cols["extra"].append(_extra(e))
    table = pa.Table.from_pydict(cols, schema=schema)
    _check_writable(path)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def _parquet_table(path: str | os.PathLike):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except (pa.ArrowException, OSError) as e:
        raise BadInput(f"{path}: not a readable Parquet file: {e}") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise BadInput(f"{path}: not a dlm-studio events Parquet file (no {META_KEY.decode()} metadata)")
    return table, json.loads(raw)


def _event_from_row(row: Mapping[str, Any]) -> Event:
    kind = row["t"]
    e: Event = {"t": kind, "step": row["step"], "ms": row["ms"]}
    for name, spec in EVENT_FIELDS.get(kind, {}).items():
        v = row.get(name)
        if not _is_list(spec) and isinstance(v, list):
            v = v[0] if v else None
        e[name] = v
    if row.get("extra"):
        e.update(json.loads(row["extra"]))
    return e


def read_parquet_events(path: str | os.PathLike, run_id: str | None = None) -> list[Event]:
    """The events of an exported Parquet file, exactly as in the trace (all runs, or one `run_id`)."""
    table, _ = _parquet_table(path)
    return [_event_from_row(r) for r in table.to_pylist() if run_id is None or r["run_id"] == run_id]


def read_parquet(path: str | os.PathLike) -> list[Trace]:
    """Every run of an exported Parquet file as a Trace (header, events, footer)."""
    table, meta = _parquet_table(path)
    rows = table.to_pylist()
    out = []
    for run in meta.get("runs", []):
        rid = run["header"].get("run_id")
        out.append(Trace(run["header"], [_event_from_row(r) for r in rows if r["run_id"] == rid], run["footer"]))
    return out


# -- CSV --------------------------------------------------------------------------------------------
def _csv_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    return str(v)


def write_csv(traces: Sequence[Trace], path: str | os.PathLike) -> Path:
    """One row per event; lists JSON-encoded; empty cell = field absent/null."""
    path = Path(path)
    header = [*BASE_COLUMNS, *_COLUMNS, "extra"]
    with _open_for_write(path) as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        for t, e in _rows(traces):
            known = _KNOWN.get(e["t"], frozenset())
            w.writerow([_csv_cell(t.header.get("run_id")), _csv_cell(t.header.get("strategy")), e["t"],
                        e["step"], _csv_cell(e["ms"]),
                        *(_csv_cell(e.get(n)) if n in known else "" for n in _COLUMNS),
                        _extra(e) or ""])
    return path


# -- Perfetto (Chrome trace-event JSON) -------------------------------------------------------------
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


def perfetto_json(traces: Sequence[Trace]) -> dict[str, Any]:
    """The Chrome trace-event document for one or several runs (a process per run)."""
    out: list[dict[str, Any]] = []
    flow_id = 0
    block_id = 0
    for i, t in enumerate(traces):
        pid = i + 1
        h = t.header
        name = f"{h.get('strategy', '?')} · {h.get('model', {}).get('name', '?')} · {str(h.get('run_id', ''))[:8]}"
        out += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
            {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
             "args": {"labels": f"seed={h.get('seed')}"}},
        ]
        for tid, tname in ((TID_FORWARDS, "forwards"), (TID_DECISIONS, "decisions"), (TID_BLOCKS, "blocks")):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": tname}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

        # forward slices; a step's anchor point for flows = the middle of its (first) forward slice
        anchor: dict[int, float] = {}
        for e in t.events:
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

        # decisions (instants), blocks (async), flows, counters
        pending: dict[int, int] = {}     # pos -> step of the latest unverified proposal
        open_blocks: dict[tuple[int, int], int] = {}
        tokens = forwards = accepted = verified = 0
        by_step_end: dict[int, float] = {}
        for e in t.events:
            if e["ms"] is not None:
                by_step_end[e["step"]] = max(by_step_end.get(e["step"], 0.0), e["ms"])
        last_step = None

        def counters(step: int) -> None:
            ts = _us(by_step_end.get(step))
            if forwards:
                out.append({"ph": "C", "name": "TPF (running)", "pid": pid, "tid": 0, "ts": ts,
                            "args": {"TPF": round(tokens / forwards, 6)}})
            if verified:
                out.append({"ph": "C", "name": "acceptance (running)", "pid": pid, "tid": 0, "ts": ts,
                            "args": {"accept rate": round(accepted / verified, 6)}})
            out.append({"ph": "C", "name": "tokens emitted", "pid": pid, "tid": 0, "ts": ts, "args": {"tokens": tokens}})

        for e in t.events:
            kind, step = e["t"], e["step"]
            if last_step is not None and step != last_step:
                counters(last_step)
            last_step = step
            ts = _us(e["ms"])
            args = _clean({k: v for k, v in e.items() if k not in ("t", "ms")})
            if kind == "forward":
                forwards += e["role"] != "prefill"
                continue
            if kind == "propose":
                for p in e["pos"]:
                    pending[p] = step
            elif kind in ("accept", "reject"):
                ps = e["pos"] if kind == "accept" else [e["pos"]]
                if kind == "accept":
                    accepted += len(ps)
                verified += len(ps)
                sources: dict[int, list[int]] = {}
                for p in ps:
                    src = pending.pop(p, None)
                    if src is not None:
                        sources.setdefault(src, []).append(p)
                for src, positions in sorted(sources.items()):
                    if src in anchor and step in anchor and src != step:
                        flow_id += 1
                        fname = f"verify pos {','.join(map(str, positions))}"
                        out.append({"ph": "s", "cat": "verify", "name": fname, "id": flow_id, "pid": pid,
                                    "tid": TID_FORWARDS, "ts": anchor[src], "args": {"positions": positions}})
                        out.append({"ph": "f", "bp": "e", "cat": "verify", "name": fname, "id": flow_id, "pid": pid,
                                    "tid": TID_FORWARDS, "ts": anchor[step], "args": {"outcome": kind}})
            elif kind == "emit":
                tokens += len(e["tok"])
            elif kind == "block":
                key = (e["start"], e["end"])
                if e["op"] == "open":
                    block_id += 1
                    open_blocks[key] = block_id
                    bid = block_id
                    ph = "b"
                else:
                    bid = open_blocks.pop(key, None)
                    if bid is None:
                        continue
                    ph = "e"
                out.append({"ph": ph, "cat": "block", "name": f"block [{e['start']},{e['end']})",
                            "id": f"0x{pid:x}{bid:06x}", "pid": pid, "tid": TID_BLOCKS, "ts": ts, "args": args})
                continue
            elif kind == "kv":
                if e["op"] != "refresh":   # a refresh names the slots it recomputed; the length stays
                    out.append({"ph": "C", "name": "KV length", "pid": pid, "tid": 0, "ts": ts,
                                "args": {"tokens": e["to_len"]}})
                if e["op"] == "commit":
                    continue
            out.append({"ph": "i", "s": "t", "cat": kind, "name": _instant_name(e), "pid": pid,
                        "tid": TID_DECISIONS, "ts": ts, "args": args})
        if last_step is not None:
            counters(last_step)
        end = _us(max(by_step_end.values(), default=0.0))
        for key, bid in open_blocks.items():  # blocks still open at the end of the trace
            out.append({"ph": "e", "cat": "block", "name": f"block [{key[0]},{key[1]})",
                        "id": f"0x{pid:x}{bid:06x}", "pid": pid, "tid": TID_BLOCKS, "ts": end, "args": {}})
    meta: dict[str, Any] = {"dlm-studio.trace": SCHEMA, "runs": [_run_meta(t) for t in traces]}
    if len(traces) == 1:
        meta.update(_run_meta(traces[0]))
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": _clean(meta)}


def write_perfetto(traces: Sequence[Trace], path: str | os.PathLike) -> Path:
    path = Path(path)
    doc = perfetto_json(traces)
    with _open_for_write(path) as f:
        json.dump(doc, f, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return path


# -- HTML report ------------------------------------------------------------------------------------
_CSS = """
:root { --ink:#1f1f1f; --muted:#5f6368; --line:#e3e3e3; --bg:#fafafa; }
* { box-sizing: border-box; }
body { font-family: Inter, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif; color: var(--ink);
       background: var(--bg); margin: 0; line-height: 1.45; }
main { max-width: 1320px; margin: 0 auto; padding: 24px 28px 60px; }
h1 { font-size: 26px; margin: 0 0 4px; } h2 { font-size: 21px; margin: 34px 0 10px; border-bottom: 2px solid var(--line);
     padding-bottom: 6px; } h3 { font-size: 16px; margin: 22px 0 8px; color: #333; }
.sub { color: var(--muted); font-size: 14px; margin-bottom: 18px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 18px; margin: 12px 0; }
.grid2 { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
@media (max-width: 900px) { .grid2 { grid-template-columns: 1fr; } }
table { border-collapse: collapse; font-size: 14px; width: 100%; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; white-space: nowrap; width: 1%; }
table.metrics td.num, table.cmp td.num { font-variant-numeric: tabular-nums; text-align: right; }
table.cmp th { width: auto; text-align: right; } table.cmp th:first-child { text-align: left; }
code, .mono { font-family: 'JetBrains Mono', 'DejaVu Sans Mono', Menlo, Consolas, monospace; font-size: 13px; }
.prompt { white-space: pre-wrap; }
.gen { font-family: 'JetBrains Mono', 'DejaVu Sans Mono', Menlo, Consolas, monospace; font-size: 15px;
       line-height: 2.0; white-space: pre-wrap; word-break: break-word; max-height: 30em; overflow-y: auto; }
.gen span { padding: 2px 1px; border-radius: 3px; text-underline-offset: 4px; text-decoration-thickness: 2px; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 16px; font-size: 13px; margin: 4px 0 10px; color: #333; }
.legend .sw { display: inline-block; min-width: 22px; text-align: center; border-radius: 3px; margin-right: 5px;
              padding: 0 3px; border: 1px solid #888; font-weight: 700; }
.banner { background: #fff4e5; border: 1px solid #E69F00; border-radius: 6px; padding: 8px 12px; margin: 10px 0; }
.notes li { margin: 3px 0; }
.chip { display: inline-block; background: #f1f3f4; border-radius: 10px; padding: 1px 8px; margin: 2px 4px 2px 0;
        font-size: 12.5px; }
.fig { background: #fff; border: 1px solid var(--line); border-radius: 8px; margin: 12px 0; padding: 8px;
       display: flex; flex-wrap: wrap; gap: 12px; }
.fig.wide { display: block; overflow: auto; max-height: 80vh; }
.chart { max-width: 100%; height: auto; } .fig.wide .chart { max-width: none; }
.chart text { fill: #222; }
footer { color: var(--muted); font-size: 12px; margin-top: 40px; }
"""


def _esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _num(v: Any, fmt: str) -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and not math.isfinite(v):
        return "—"
    return format(v, fmt)


def _state_css() -> str:
    from studio.viz.palette import DECORATION, INK, PALETTE, State, tint

    rules = []
    for s in State:
        col = PALETTE[s][0]
        bg = "transparent" if s in (State.EMPTY, State.COMMITTED) else tint(col, 0.62)
        deco = DECORATION[s]
        line = f"text-decoration: {deco}; text-decoration-color: {col};" if deco != "none" else ""
        rules.append(f".st-{s.value} {{ background: {bg}; {line} }}")
        rules.append(f".sw.st-{s.value} {{ background: {col}; color: {INK[s]}; text-decoration: none; }}")
    return "\n".join(rules)


def _text_legend() -> str:
    from studio.viz.palette import PALETTE, State

    items = []
    for s in (State.COMMITTED, State.ACCEPTED, State.BONUS, State.RESAMPLED, State.UNMASKED, State.EDITED):
        col, glyph, lab = PALETTE[s]
        sample = {State.COMMITTED: "plain target token", State.ACCEPTED: "accepted draft",
                  State.BONUS: "bonus token", State.RESAMPLED: "correction after a reject",
                  State.UNMASKED: "filled by diffusion", State.EDITED: "edited (T2T)"}[s]
        items.append(f'<span><span class="sw st-{s.value}">{glyph}</span><span class="st-{s.value}">{_esc(sample)}</span>'
                     f"</span>")
    return '<div class="legend">' + "".join(items) + "</div>"


def _generated_html(grid: Any) -> str:
    from studio.viz.grid import show_text

    parts = []
    for seg in grid.segments:
        ps = seg.positions
        tips = [f"pos {ps[0]}" if len(ps) == 1 else f"pos {ps[0]}–{ps[-1]}" if ps else "", f"step {seg.step}",
                seg.state.value]
        if len(ps) == 1:
            c = grid.final.get(ps[0])
            if c is not None:
                tips.append(f"token {c.tok} {show_text(c.text)}")
                for k, v in (("p", c.p), ("q", c.q), ("conf", c.conf)):
                    if v is not None:
                        tips.append(f"{k}={v:.3g}")
        parts.append(f'<span class="st-{seg.state.value}" title="{_esc(" · ".join(x for x in tips if x))}">'
                     f"{_esc(seg.text)}</span>")
    return "".join(parts) or '<span class="sub">(no tokens)</span>'


def _header_table(h: Mapping[str, Any]) -> str:
    model, tok, prompt = h.get("model", {}), h.get("tokenizer", {}), h.get("prompt", {})
    params = "".join(f'<span class="chip mono">{_esc(k)}={_esc(json.dumps(v))}</span>'
                     for k, v in (h.get("params") or {}).items())
    rows = [
        ("strategy", f"<b>{_esc(h.get('strategy'))}</b>"),
        ("model", f"{_esc(model.get('name'))} ({_esc(model.get('arch'))}, {_esc(model.get('dtype'))}, "
                  f"{_esc(model.get('device'))})" + (f" + adapter <code>{_esc(model.get('adapter'))}</code>"
                                                      if model.get("adapter") else "")),
        ("tokenizer", f"{_esc(tok.get('name'))} · vocab {_esc(tok.get('vocab_size'))} · eos {_esc(tok.get('eos_ids'))}"
                      f" · mask {_esc(tok.get('mask_id'))}"),
        ("seed", _esc(h.get("seed"))),
        ("params", params or "—"),
        ("prompt", f'<div class="prompt mono">{_esc(prompt.get("text"))}</div>'
                   f'<span class="sub">{len(prompt.get("token_ids") or [])} tokens</span>'),
        ("run", " · ".join(x for x in (f'<span class="mono">{_esc(h["run_id"])}</span>' if h.get("run_id") else "",
                                       _esc(h.get("created")), _esc(h.get("schema"))) if x)
         or '<span class="sub">not saved as a trace file</span>'),
    ]
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _metrics_table(m: Mapping[str, Any], counts: Mapping[str, int]) -> str:
    abp = m.get("accept_by_pos") or []
    rows = [
        ("stop reason", _esc(m.get("stop_reason"))),
        ("tokens", _num(m.get("n_tokens"), "d")),
        ("forwards", _num(m.get("forwards"), "d")),
        ("TPF (tokens / forward)", _num(m.get("tpf"), ".3f")),
        ("acceptance rate", _num(m.get("accept_rate"), ".1%")
         + (f' <span class="sub">({m["verified"]} verified)</span>' if m.get("verified") else "")),
        ("mean acceptance length", _num(m.get("mean_acceptance_length"), ".2f")),
        ("acceptance by slot", " ".join(f"{x:.0%}" for x in abp) or "—"),
        ("decode speed (tok/s)", _num(m.get("tok_s"), ".1f")),
        ("wall time (s)", _num(m.get("wall_s"), ".3f")),
        ("prefill (s)", _num(m.get("prefill_s"), ".3f")),
    ]
    body = "".join(f'<tr><th>{k}</th><td class="num">{v}</td></tr>' for k, v in rows)
    ev = " ".join(f'<span class="chip">{_esc(k)} {n}</span>' for k, n in sorted(counts.items()))
    return f'<table class="metrics">{body}<tr><th>events</th><td>{ev}</td></tr></table>'


def _comparison_table(traces: Sequence[Trace], labels: Sequence[str], metrics: Sequence[Mapping[str, Any]]) -> str:
    base = next((i for i, t in enumerate(traces) if t.header.get("strategy") == "ar"), None)
    head = ["run", "tokens", "forwards", "TPF", "acceptance", "mean AL", "tok/s", "wall s", "stop"]
    if base is not None:
        head += ["speed vs ar", "same text as ar"]
    rows = []
    for i, (lab, m) in enumerate(zip(labels, metrics)):
        cells = [f"<b>{_esc(lab)}</b>", _num(m.get("n_tokens"), "d"), _num(m.get("forwards"), "d"),
                 _num(m.get("tpf"), ".3f"), _num(m.get("accept_rate"), ".1%"),
                 _num(m.get("mean_acceptance_length"), ".2f"), _num(m.get("tok_s"), ".1f"),
                 _num(m.get("wall_s"), ".3f"), _esc(m.get("stop_reason"))]
        if base is not None:
            b = metrics[base]
            sp = (m["tok_s"] / b["tok_s"]) if m.get("tok_s") and b.get("tok_s") else None
            cells.append(_num(sp, ".2f") + ("×" if sp is not None else ""))
            cells.append("yes" if m.get("text") == b.get("text") else "no")
        rows.append("<tr>" + "".join(f'<td class="{"num" if j else ""}">{c}</td>' for j, c in enumerate(cells))
                    + "</tr>")
    return ('<table class="cmp"><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows)
            + "</table>")


def html_report(traces: Sequence[Trace] | Trace, path: str | os.PathLike, title: str | None = None, *,
                token_text: Any = None, labels: Sequence[str] | None = None) -> Path:
    """A self-contained HTML report, one light file that opens offline (its figures are static SVG,
    `studio.viz.svg`: no script at all): for several runs a comparison table and figures first, then for
    each run its header, metrics, diagnostics, the generated text coloured by provenance, and its figures.
    `labels` names the runs (default: the strategy names, numbered when one repeats), e.g. the preset names
    a comparison ran."""
    from studio.viz import svg
    from studio.viz.figures import trace_metrics, unique_labels
    from studio.viz.grid import build_grid
    from studio.viz.palette import legend_kind, legend_text
    from studio.viz.stats import acceptance, diagnostics, kind_counts

    if isinstance(traces, Trace):
        traces = [traces]
    traces = list(traces)
    path = Path(path)
    _check_writable(path)
    if labels is None:
        labels = unique_labels(traces)
    elif len(labels) != len(traces):
        raise ValueError(f"{len(labels)} labels for {len(traces)} traces")
    labels = list(labels)
    if title is None:
        title = ("dlm-studio trace: " + labels[0]) if len(traces) == 1 else f"dlm-studio comparison: {', '.join(labels)}"

    def fig_html(*figures: str) -> str:
        return '<div class="fig">' + "".join(figures) + "</div>"

    metrics = [trace_metrics(t) for t in traces]
    body: list[str] = [f"<h1>{_esc(title)}</h1>",
                       f'<div class="sub">{len(traces)} run(s) · schema {_esc(SCHEMA)} · glyph legend: '
                       f"{_esc(legend_text(legend_kind(['canvas' in t.header for t in traces])))}</div>"]
    if len(traces) > 1:
        body += ["<h2>Comparison</h2>", '<div class="card">', _comparison_table(traces, labels, metrics), "</div>",
                 fig_html(*svg.comparison_svgs(traces, labels, metrics))]
    for lab, t, m in zip(labels, traces, metrics):
        grid = build_grid(t.header, t.events, token_text)
        body.append(f"<h2>{_esc(lab)}</h2>" if len(traces) > 1 else "")
        if t.footer is None:
            body.append('<div class="banner">This trace is <b>truncated</b> (no footer: the run did not finish). '
                        "Metrics below are computed from the events that were written; timings are unknown.</div>")
        body.append('<div class="grid2"><div class="card"><h3>Run</h3>' + _header_table(t.header) + "</div>"
                    '<div class="card"><h3>Metrics</h3>' + _metrics_table(m, kind_counts(t.events)) + "</div></div>")
        notes = diagnostics(t.events, t.header.get("strategy"))
        if notes:
            body.append('<div class="card"><h3>Diagnostics</h3><ul class="notes">'
                        + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul></div>")
        body.append('<div class="card"><h3>Generated text</h3>' + _text_legend()
                    + f'<div class="gen">{_generated_html(grid)}</div></div>')
        body.append('<div class="fig wide">' + svg.trajectory_svg(grid) + "</div>")
        body.append(fig_html(svg.tpf_svg(t.events, t.footer)))
        if acceptance(t.events).verified:
            body.append(fig_html(svg.acceptance_svg(t.events), svg.acceptance_length_svg(t.events)))
        else:
            body.append(f'<div class="card sub">No drafts were verified in this run ({_esc(t.header.get("strategy"))}),'
                        " so there are no acceptance figures.</div>")
    body.append("<footer>Generated by dlm-studio from the JSONL event trace alone. Hover a trajectory cell for its "
                "token, p, q, min(1, p/q) and confidence, and a bar for its numbers.</footer>")
    doc = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
           f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_esc(title)}</title>'
           f"<style>{_CSS}\n{_state_css()}</style></head><body><main>{''.join(body)}</main></body></html>\n")
    with _open_for_write(path) as f:
        f.write(doc)
    return path

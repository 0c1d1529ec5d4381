"""Parquet export and its reader: one row per event (the column layout is in `common`).

A field that is a list for some kinds and a scalar for others (`pos`, `tok`, `p`, `q`: lists in
accept/propose/unmask/edit/remask/emit, scalars in reject/resample/bonus) is a list column and the
scalars are one-element lists; `read_parquet_events` gives the original scalars back. The file's
schema metadata key `dlm-studio.trace` holds the header and footer JSON.

pyarrow is imported inside the functions: importing the exports stays cheap for those that never
write Parquet.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from studio.errors import BadInput
from studio.events import EVENT_FIELDS, SCHEMA, Event, Trace
from studio.files import atomic_path
from studio.traces.export.common import COLUMNS, KNOWN, ensure_writable, event_rows, extra_json, is_list_spec, run_meta

META_KEY = b"dlm-studio.trace"
PARQUET_FORMAT = "dlm-studio.events-parquet/1"


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
    for name, (is_list, elem) in COLUMNS.items():
        typ = _arrow_type(elem)
        fields.append(pa.field(name, pa.list_(typ) if is_list else typ))
    fields.append(pa.field("extra", pa.string()))
    return pa.schema(fields, metadata={META_KEY: meta})


def write_parquet(traces: Sequence[Trace], path: str | os.PathLike) -> Path:
    """One row per event of every trace; schema metadata `dlm-studio.trace` = header/footer JSON."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    meta: dict[str, Any] = {"format": PARQUET_FORMAT, "schema": SCHEMA, "runs": [run_meta(t) for t in traces]}
    if len(traces) == 1:
        meta.update(run_meta(traces[0]))
    schema = _arrow_schema(json.dumps(meta, ensure_ascii=False, allow_nan=False).encode())
    cols: dict[str, list[Any]] = {f.name: [] for f in schema}
    for t, e in event_rows(traces):
        cols["run_id"].append(t.header.get("run_id"))
        cols["strategy"].append(t.header.get("strategy"))
        cols["t"].append(e["t"])
        cols["step"].append(e["step"])
        cols["ms"].append(e["ms"])
        known = KNOWN.get(e["t"], frozenset())
        for name, (is_list, _) in COLUMNS.items():
            v = e.get(name) if name in known else None
            if is_list and v is not None and not isinstance(v, list):
                v = [v]
            cols[name].append(v)
        cols["extra"].append(extra_json(e))
    table = pa.Table.from_pydict(cols, schema=schema)
    ensure_writable(path)
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
        if not is_list_spec(spec) and isinstance(v, list):
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

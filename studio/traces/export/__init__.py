"""Trace exports: Parquet, CSV, Perfetto (Chrome trace JSON) and a self-contained HTML report.

All of them are derived from the JSONL trace (the source of truth) and nothing else. A module per format:
`parquet` (with its reader), `csv_rows`, `perfetto`, `report` (HTML; its stylesheet is `style`); what they
share (atomic output, the Parquet/CSV column layout) is in `common`. Here: the formats and `export`, which
writes one trace in any of them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Union

from studio.errors import BadInput
from studio.events import Trace, read_trace, summarize
from studio.traces.export.common import BASE_COLUMNS
from studio.traces.export.csv_rows import write_csv
from studio.traces.export.parquet import META_KEY, PARQUET_FORMAT, read_parquet, read_parquet_events, write_parquet
from studio.traces.export.perfetto import TID_BLOCKS, TID_DECISIONS, TID_FORWARDS, perfetto_json, write_perfetto
from studio.traces.export.report import html_report

__all__ = ["BASE_COLUMNS", "FORMATS", "META_KEY", "PARQUET_FORMAT", "SUFFIXES", "TID_BLOCKS", "TID_DECISIONS",
           "TID_FORWARDS", "TraceLike", "default_out", "export", "html_report", "metrics_from_events",
           "perfetto_json", "read_parquet", "read_parquet_events", "write_csv", "write_parquet", "write_perfetto"]

FORMATS = ("parquet", "perfetto", "html", "csv")
SUFFIXES = {"parquet": ".parquet", "perfetto": ".perfetto.json", "html": ".html", "csv": ".csv"}

TraceLike = Union[Trace, str, os.PathLike]


def metrics_from_events(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The one metric definition (docs/metrics.md): `studio.events.summarize`."""
    return summarize(events)


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
    t = trace if isinstance(trace, Trace) else read_trace(trace)
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

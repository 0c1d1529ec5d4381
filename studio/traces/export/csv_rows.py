"""CSV export: one row per event (the column layout is in `common`).

Lists are JSON-encoded and scalars stay scalars, so every non-string cell is valid JSON; an empty cell
is a field that is absent or null.
"""
from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from studio.events import Trace
from studio.traces.export.common import BASE_COLUMNS, COLUMNS, KNOWN, event_rows, extra_json, open_for_write


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
    header = [*BASE_COLUMNS, *COLUMNS, "extra"]
    with open_for_write(path) as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        for t, e in event_rows(traces):
            known = KNOWN.get(e["t"], frozenset())
            w.writerow([_csv_cell(t.header.get("run_id")), _csv_cell(t.header.get("strategy")), e["t"],
                        e["step"], _csv_cell(e["ms"]),
                        *(_csv_cell(e.get(n)) if n in known else "" for n in COLUMNS),
                        extra_json(e) or ""])
    return path

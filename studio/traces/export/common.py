"""What the writers share: atomic output, the run metadata they embed, and the column layout of Parquet
and CSV.

Parquet / CSV: ONE ROW PER EVENT. Columns: `run_id, strategy, t, step, ms`, then the union of the
schema's event fields (a field a kind lacks is null), then `extra` (a JSON object of fields the schema
does not know, from a newer minor version; null when none). How each format encodes lists is in its
own module (`parquet`, `csv_rows`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, ContextManager, Iterable, Mapping, Sequence, get_args, get_origin

from studio.events import EVENT_FIELDS, Event, Trace
from studio.files import atomic_write, check_writable

BASE_COLUMNS = ("run_id", "strategy", "t", "step", "ms")


def ensure_writable(path: Path) -> None:
    """Fail early (before building the export) when `path` cannot be written; creates nothing. Whether an
    existing file may be replaced is the caller's policy (the CLI's --force): here it is replaced."""
    check_writable(path, force=True)


def open_for_write(path: Path) -> ContextManager[IO]:
    """The whole export, written atomically (studio.files): the final name never holds a half-written file."""
    ensure_writable(path)
    return atomic_write(path, "w", newline="")


def run_meta(t: Trace) -> dict[str, Any]:
    return {"header": t.header, "footer": t.footer}


# -- the column layout shared by Parquet and CSV ----------------------------------------------------
def is_list_spec(spec: Any) -> bool:
    return get_origin(spec) is list


def _elem(spec: Any) -> Any:
    return get_args(spec)[0] if is_list_spec(spec) else spec


def _column_specs() -> dict[str, tuple[bool, Any]]:
    """field -> (is a list column, element spec), over every event kind, in schema order."""
    out: dict[str, tuple[bool, Any]] = {}
    for fields in EVENT_FIELDS.values():
        for name, spec in fields.items():
            is_list, elem = is_list_spec(spec), _elem(spec)
            if name in out:
                was_list, was_elem = out[name]
                if was_elem is not elem and {was_elem, elem} <= {int, float}:
                    elem = float
                out[name] = (was_list or is_list, elem if was_elem in (int, float) else was_elem)
            else:
                out[name] = (is_list, elem)
    return out


COLUMNS = _column_specs()
KNOWN = {kind: frozenset(fields) for kind, fields in EVENT_FIELDS.items()}
_COMMON = frozenset(("t", "step", "ms"))


def extra_json(event: Mapping[str, Any]) -> str | None:
    """The `extra` cell: the fields of `event` its kind's schema does not know, as JSON (None when none)."""
    known = KNOWN.get(event["t"], frozenset())
    extra = {k: v for k, v in event.items() if k not in _COMMON and k not in known}
    return json.dumps(extra, ensure_ascii=False, allow_nan=False) if extra else None


def event_rows(traces: Sequence[Trace]) -> Iterable[tuple[Trace, Event]]:
    for t in traces:
        for e in t.events:
            yield t, e

"""Trace files: JSON Lines of one header, the events, one footer (schema in `studio.events.schema`).

A file without its footer is *truncated* (the run crashed or was killed); ``read_trace(...,
allow_truncated=True)`` still reads it.

Floats: NaN/inf are fine in memory, but strict JSON has no such tokens, so ``TraceWriter`` writes any
non-finite float as ``null``. Hence every float field of a *read* trace may be ``None``.
"""
from __future__ import annotations

import json
import math
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping

from studio.errors import BadInput
from studio.events.schema import (EVENT_FIELDS, SCHEMA, Event, bad_trace, check_schema, footer_problem, header_problem,
                                  newer_minor, validate_event)

def _finite(obj: Any) -> Any:
    """A copy of `obj` with every non-finite float replaced by None (JSON null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _dumps(obj: Any) -> str:
    # Strict JSON. Fast path first: almost no event carries a non-finite float.
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"))


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def full_header(header: Mapping[str, Any]) -> dict[str, Any]:
    """`header` as a trace file holds it: the schema, and a run id and creation time unless it has them."""
    full: dict[str, Any] = {"kind": "header", "schema": SCHEMA, "run_id": header.get("run_id") or uuid.uuid4().hex,
                            "created": header.get("created") or _now_iso()}
    full.update((k, v) for k, v in header.items() if k not in full)
    return full


class TraceWriter:
    """Writes a `dlm-studio.trace/1.3` JSONL file: the header at once, events with `write` (or by
    calling the writer: it is an event sink), the footer with `close(footer)`.

    Line-buffered: every line reaches the OS as soon as it is written, so a crash leaves a readable,
    truncated trace. As a context manager it closes on exit; without a `close(footer)` first (e.g. on
    an exception) the trace stays truncated, which is the honest record.

    Non-finite floats are written as null. Invalid header/event/footer dicts raise ValueError (a bug
    in the code calling the writer); a path that cannot be opened raises BadInput.
    """

    def __init__(self, path: str | os.PathLike[str], header: Mapping[str, Any]) -> None:
        self.path = Path(path)
        full = full_header(header)
        if problem := header_problem(full):
            raise ValueError(f"trace header: {problem}")
        line = _dumps(full) + "\n"  # before opening: an unserialisable header leaves no file behind
        self.header = full
        self.n_events = 0
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._f = open(self.path, "w", encoding="utf-8", newline="\n", buffering=1)
        except OSError as e:
            raise bad_trace(f"{self.path}: cannot write trace: {e.strerror or e}") from None
        self._f.write(line)

    def write(self, event: Event) -> None:
        try:
            validate_event(event, str(self.path))
        except BadInput as e:
            raise ValueError(str(e)) from None
        line = _dumps(event) + "\n"
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.path}: trace is closed (event after the footer)")
            self._f.write(line)
            self.n_events += 1

    __call__ = write  # a writer is an event sink: `run_to_end(..., sinks=[writer])`

    def close(self, footer: Mapping[str, Any] | None = None) -> None:
        """Write `footer` (if given) and close. Idempotent: later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            try:
                if footer is not None:
                    full = {"kind": "footer", **{k: v for k, v in footer.items() if k != "kind"}}
                    if problem := footer_problem(full):
                        raise ValueError(f"trace footer: {problem}")
                    self._f.write(_dumps(full) + "\n")
            finally:
                self._closed = True
                self._f.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- TraceReader ------------------------------------------------------------------------------------
@dataclass
class Trace:
    header: dict[str, Any]
    events: list[Event]
    footer: dict[str, Any] | None  # None only for a truncated trace read with allow_truncated=True
    path: Path | None = None       # the file it was read from
    skipped: int = 0               # events of kinds a newer minor version added, which this build skips

    @property
    def truncated(self) -> bool:
        return self.footer is None


_PARTIAL = object()  # marks an unterminated, unparsable last line: the writer died mid-line


class TraceReader:
    """Streams a trace: the header is read and checked on open; iterating yields the events (each
    validated) and sets `footer` at the end. Iterate once. Every error is a one-line BadInput naming
    the path and line number.
    """

    def __init__(self, path: str | os.PathLike[str], *, allow_truncated: bool = False) -> None:
        self.path = Path(path)
        self.allow_truncated = allow_truncated
        self.footer: dict[str, Any] | None = None
        self.skipped = 0   # events of unknown kinds in a trace of a newer minor version
        self._lineno = 0
        self._iterated = False
        try:
            self._f = open(self.path, "rb")
        except FileNotFoundError:
            raise bad_trace(f"{self.path}: no such trace file") from None
        except OSError as e:
            raise bad_trace(f"{self.path}: cannot read trace: {e.strerror or e}") from None
        try:
            self.header = self._read_header()
        except BaseException:
            self._f.close()
            raise

    def _where(self) -> str:
        return f"{self.path}, line {self._lineno}"

    def _next(self) -> Any:
        """The next non-blank line as a dict; None at end of file; _PARTIAL for a torn last line."""
        while True:
            raw = self._f.readline()
            if not raw:
                return None
            self._lineno += 1
            if raw.strip():
                break
        complete = raw.endswith(b"\n")
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # also ints of 4300+ digits, and nesting too deep to parse
            if not complete:
                return _PARTIAL
            why = (f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else
                   "not UTF-8" if isinstance(e, UnicodeDecodeError) else
                   "nested too deeply" if isinstance(e, RecursionError) else "a number too long to read")
            raise bad_trace(f"{self._where()}: not valid JSON ({why})") from None
        if not isinstance(obj, dict):
            raise bad_trace(f"{self._where()}: expected a JSON object, got {type(obj).__name__}")
        return obj

    def _read_header(self) -> dict[str, Any]:
        obj = self._next()
        if obj is None:
            raise bad_trace(f"{self.path}: empty file (expected a {SCHEMA} header on line 1)")
        if obj is _PARTIAL:
            raise bad_trace(f"{self._where()}: truncated trace: the header line is incomplete")
        if obj.get("kind") != "header":
            raise bad_trace(f"{self._where()}: first line is not a trace header (expected \"kind\": \"header\")")
        self._newer = newer_minor(check_schema(obj.get("schema"), self._where()))
        if problem := header_problem(obj):
            raise bad_trace(f"{self._where()}: header: {problem}")
        return obj

    def _truncated(self, detail: str) -> None:
        if not self.allow_truncated:
            raise bad_trace(f"{self.path}: truncated trace: {detail} (the run did not finish)")

    def __iter__(self) -> Iterator[Event]:
        if self._iterated:
            raise RuntimeError("a TraceReader can be iterated only once")
        self._iterated = True
        try:
            while True:
                obj = self._next()
                if obj is None:
                    if self.footer is None:
                        self._truncated(f"no footer after line {self._lineno}")
                    return
                if self.footer is not None:
                    raise bad_trace(f"{self._where()}: content after the footer")
                if obj is _PARTIAL:
                    self._truncated(f"line {self._lineno} is incomplete and there is no footer")
                    return
                if "t" in obj:
                    if self._newer and obj["t"] not in EVENT_FIELDS:
                        self.skipped += 1
                        continue
                    validate_event(obj, self._where())
                    yield obj
                elif obj.get("kind") == "footer":
                    if problem := footer_problem(obj):
                        raise bad_trace(f"{self._where()}: footer: {problem}")
                    self.footer = obj
                elif obj.get("kind") == "header":
                    raise bad_trace(f"{self._where()}: a second header")
                else:
                    raise bad_trace(f"{self._where()}: neither an event (no 't' field) nor a footer")
        finally:
            self._f.close()

    def read(self) -> Trace:
        events = list(self)
        return Trace(self.header, events, self.footer, self.path, self.skipped)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | os.PathLike[str], *, allow_truncated: bool = False) -> Trace:
    """Read and validate a whole trace. A trace without footer raises BadInput ('truncated') unless
    allow_truncated, in which case `footer` is None."""
    return TraceReader(path, allow_truncated=allow_truncated).read()


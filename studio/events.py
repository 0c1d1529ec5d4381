"""Event schema ``dlm-studio.trace/1``: the one contract between the engine and every consumer.

The engine describes every decoding step as small plain-dict events (JSON-ready, cheap to build on
the hot path). The CLI printer, TUI, web UI, trace files and metrics read nothing else (DESIGN §2.2).

A trace is JSON Lines: one header line, event lines, one footer line. A file without its footer is
*truncated* (the run crashed or was killed); ``read_trace(..., allow_truncated=True)`` still reads it.

Versioning: ``dlm-studio.trace/MAJOR[.MINOR]``. A minor bump may only add fields (readers ignore
fields they don't know, and keep them in the dicts). New event kinds, new enum values or changed
meanings need a new major, which this build refuses to read.

Floats: NaN/inf are fine in memory, but strict JSON has no such tokens, so ``TraceWriter`` writes any
non-finite float as ``null``. Hence every float field of a *read* trace may be ``None``.

Values must be plain Python types (use ``.tolist()`` / ``.item()`` on tensors); consumers share the
event dicts and must not mutate them.
"""
from __future__ import annotations

import json
import math
import os
import queue
import re
import threading
import types
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Union, get_args, get_origin

from studio.errors import BadInput

SCHEMA = "dlm-studio.trace/1"
_SCHEMA_RE = re.compile(r"dlm-studio\.trace/([0-9]{1,9})(?:\.([0-9]{1,9}))?")  # int() refuses 4300+ digits
_MAJOR = 1

Event = dict[str, Any]

# -- schema -----------------------------------------------------------------------------------------
# Specs: int (bools rejected), float (ints and None accepted, see module doc), str, bool, dict,
# list[T] (checked elementwise), Literal[...] (an enum of strings), T | None, or a nested field dict.

COMMON_FIELDS: dict[str, Any] = {"step": int, "ms": float}  # every event also has "t", its kind

EVENT_FIELDS: dict[str, dict[str, Any]] = {
    "forward": {"role": Literal["prefill", "cold", "verify", "draft", "target", "commit", "jacobi", "extend"],
                "n_tokens": int, "lora_rows": int, "wall_ms": float},
    "propose": {"pos": list[int], "tok": list[int], "q": list[float],
                "src": Literal["mask", "draft_model", "jacobi", "ngram", "diffusion"]},
    "accept": {"pos": list[int], "tok": list[int], "p": list[float], "q": list[float]},
    "reject": {"pos": int, "tok": int, "p": float, "q": float},
    "resample": {"pos": int, "tok": int},
    "bonus": {"pos": int, "tok": int},
    "unmask": {"pos": list[int], "tok": list[int], "conf": list[float]},
    "block": {"op": Literal["open", "close"], "start": int, "end": int},
    "route": {"verify": bool, "score": float, "policy": str},
    "kv": {"op": Literal["commit", "rollback"], "from_len": int, "to_len": int},
    "emit": {"pos": list[int], "tok": list[int], "text": str},
}
# Optional fields (added in 1.x, so readers must not require them). emit.pieces: the text of each
# token on its own, for per-token displays (`text` alone cannot always be split back into tokens).
OPTIONAL_FIELDS: dict[str, dict[str, Any]] = {"emit": {"pieces": list[str]}}
ROLES: tuple[str, ...] = get_args(EVENT_FIELDS["forward"]["role"])
SOURCES: tuple[str, ...] = get_args(EVENT_FIELDS["propose"]["src"])

HEADER_FIELDS: dict[str, Any] = {
    "schema": str, "run_id": str, "created": str, "strategy": str, "params": dict,
    "model": {"name": str, "arch": str, "dtype": str, "device": str, "adapter": str | None},
    "tokenizer": {"name": str, "vocab_size": int, "eos_ids": list[int], "mask_id": int | None},
    "prompt": {"text": str, "token_ids": list[int]},
    "seed": int | None,
}

FOOTER_FIELDS: dict[str, Any] = {
    "stop_reason": str, "text": str, "n_tokens": int, "forwards": int, "tpf": float,
    "accept_rate": float, "accept_by_pos": list[float], "wall_s": float, "tok_s": float, "prefill_s": float,
}


# -- validation (specs compiled once at import, so checking an event is a short loop) ---------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _leaf(spec: Any) -> tuple[Callable[[Any], bool], str]:
    if spec is bool:
        return (lambda v: v is True or v is False), "bool"
    if spec is int:
        return _is_int, "int"
    if spec is float:
        return _is_float, "float"
    if spec is str:
        return (lambda v: isinstance(v, str)), "str"
    if spec is dict:
        return (lambda v: isinstance(v, dict)), "object"
    if spec is type(None):
        return (lambda v: v is None), "null"
    origin, args = get_origin(spec), get_args(spec)
    if origin is list:
        elem, desc = _leaf(args[0])
        return (lambda v: isinstance(v, list) and all(map(elem, v))), f"list[{desc}]"
    if origin is Literal:
        allowed = frozenset(args)
        return (lambda v: isinstance(v, str) and v in allowed), "one of " + "|".join(args)
    if origin in (Union, types.UnionType):
        parts = [_leaf(a) for a in args]
        return (lambda v: any(check(v) for check, _ in parts)), " or ".join(d for _, d in parts)
    raise TypeError(f"unsupported field spec {spec!r}")


_Compiled = tuple[tuple[str, Callable[[Any], bool], str, Any], ...]


def _compile(fields: Mapping[str, Any]) -> _Compiled:
    out = []
    for name, spec in fields.items():
        if isinstance(spec, dict):
            out.append((name, _leaf(dict)[0], "object", _compile(spec)))
        else:
            out.append((name, *_leaf(spec), None))
    return tuple(out)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _problem(obj: Mapping[str, Any], compiled: _Compiled, prefix: str = "") -> str | None:
    """The first thing wrong with `obj` against `compiled`, or None. Extra keys are fine."""
    for name, check, desc, nested in compiled:
        if name not in obj:
            return f"missing field {prefix + name!r}"
        v = obj[name]
        if not check(v):
            return f"field {prefix + name!r} must be {desc}, got {_short(v)}"
        if nested is not None and (p := _problem(v, nested, prefix + name + ".")):
            return p
    return None


def _bad(msg: str) -> BadInput:
    # The CLI prints BadInput as exactly one line.
    return BadInput(msg.replace("\r", "\\r").replace("\n", "\\n"))


_EVENT_CHECKS = {kind: _compile({**COMMON_FIELDS, **fields}) for kind, fields in EVENT_FIELDS.items()}
_LIST_FIELDS = {kind: tuple(n for n, s in fields.items() if get_origin(s) is list)
                for kind, fields in EVENT_FIELDS.items()}
_HEADER_CHECKS = _compile(HEADER_FIELDS)
_FOOTER_CHECKS = _compile(FOOTER_FIELDS)
_REQUIRED = {kind: frozenset(fields) for kind, fields in EVENT_FIELDS.items()}
_ALLOWED = {kind: _REQUIRED[kind] | frozenset(OPTIONAL_FIELDS.get(kind, {})) for kind in EVENT_FIELDS}


def validate_event(event: Any, where: str = "event") -> None:
    """Raise BadInput (one line, starting with `where`) unless `event` is a well-formed event.

    Unknown extra fields are allowed (forward compatibility). Parallel lists (pos/tok/q/...) must have
    the same length.
    """
    if not isinstance(event, dict):
        raise _bad(f"{where}: an event must be a JSON object, got {_short(event)}")
    kind = event.get("t")
    compiled = _EVENT_CHECKS.get(kind) if isinstance(kind, str) else None
    if compiled is None:
        if "t" not in event:
            raise _bad(f"{where}: event has no 't' (kind) field")
        raise _bad(f"{where}: unknown event kind {_short(kind)} (known: {', '.join(EVENT_FIELDS)})")
    if problem := _problem(event, compiled):
        raise _bad(f"{where}: {kind} event: {problem}")
    optional = OPTIONAL_FIELDS.get(kind, {})
    present = {k: spec for k, spec in optional.items() if k in event}
    if present and (problem := _problem(event, _compile(present))):
        raise _bad(f"{where}: {kind} event: {problem}")
    if event["step"] < 0:
        raise _bad(f"{where}: {kind} event: field 'step' must be >= 0, got {event['step']}")
    lists = _LIST_FIELDS[kind]
    if len(lists) > 1 and len({len(event[n]) for n in lists}) > 1:
        lens = ", ".join(f"{n}={len(event[n])}" for n in lists)
        raise _bad(f"{where}: {kind} event: fields {'/'.join(lists)} must have the same length ({lens})")


# -- constructors -----------------------------------------------------------------------------------
def make(kind: str, step: int, ms: float, **fields: Any) -> Event:
    """Build an event dict. Checks (cheaply) the kind and that the field names are exactly the
    required ones; types are checked by `validate_event` (the TraceWriter does that).

    Raises ValueError / TypeError, not BadInput: a wrong event is a bug in engine code, not user input.
    """
    required = _REQUIRED.get(kind)
    if required is None:
        raise ValueError(f"unknown event kind {kind!r}")
    if not required <= fields.keys() <= _ALLOWED[kind]:
        missing, extra = sorted(required - fields.keys()), sorted(fields.keys() - _ALLOWED[kind])
        raise TypeError(f"{kind} event: missing fields {missing}, unexpected fields {extra}")
    return {"t": kind, "step": step, "ms": ms, **fields}


# One helper per kind, e.g. forward(step, ms, role="verify", n_tokens=7, lora_rows=0, wall_ms=12.3).
forward = partial(make, "forward")
propose = partial(make, "propose")
accept = partial(make, "accept")
reject = partial(make, "reject")
resample = partial(make, "resample")
bonus = partial(make, "bonus")
unmask = partial(make, "unmask")
block = partial(make, "block")
route = partial(make, "route")
kv = partial(make, "kv")
emit = partial(make, "emit")


# -- metrics (DESIGN §2.3: the one definition; footers, CLI --json, bench all use this) ------------
def summarize(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Footer metrics computed from events alone.

    - n_tokens: emitted tokens (sum of len(emit.tok)); text: the emit texts concatenated.
    - forwards: `forward` events with role != "prefill"; tpf = n_tokens / forwards (0.0 if none).
    - accept_rate: accepted / verified proposals, verified = accepted + rejected (an `accept` event
      counts len(pos), a `reject` event one); 0.0 when nothing was verified.
    - accept_by_pos[k]: the same ratio for draft slot k. Slot = rank by `pos` among the accepted and
      rejected positions of one step (one verify forward = one chain). A strategy that verifies
      several independent chains in one forward would need its own chain id; none does today.

    Timing (wall_s, tok_s, prefill_s) and stop_reason are not derivable from events: the session
    adds them to make the footer.
    """
    n_tokens = forwards = 0
    texts: list[str] = []
    chains: dict[int, list[tuple[int, bool]]] = {}
    for e in events:
        t = e["t"]
        if t == "emit":
            n_tokens += len(e["tok"])
            texts.append(e["text"])
        elif t == "forward":
            forwards += e["role"] != "prefill"
        elif t == "accept":
            chains.setdefault(e["step"], []).extend((p, True) for p in e["pos"])
        elif t == "reject":
            chains.setdefault(e["step"], []).append((e["pos"], False))
    verified: list[int] = []
    accepted: list[int] = []
    for chain in chains.values():
        chain.sort()
        for k, (_, ok) in enumerate(chain):
            if k == len(verified):
                verified.append(0)
                accepted.append(0)
            verified[k] += 1
            accepted[k] += ok
    n_verified = sum(verified)
    return {
        "text": "".join(texts),
        "n_tokens": n_tokens,
        "forwards": forwards,
        "tpf": n_tokens / forwards if forwards else 0.0,
        "accept_rate": sum(accepted) / n_verified if n_verified else 0.0,
        "accept_by_pos": [a / v for a, v in zip(accepted, verified)],
    }


# -- EventBus ---------------------------------------------------------------------------------------
class QueueSubscription:
    """An EventBus consumer for another thread: `for ev in sub: ...` ends once the bus (or this
    subscription) is closed and the queued events are drained.

    Full-queue policy (the engine must never deadlock on a slow UI): when the queue is full, the
    publisher waits up to `put_timeout` seconds for room; if none comes the event is dropped, counted
    in `dropped`, and the subscription is marked stalled. While stalled, further events are dropped at
    once without waiting, until the consumer takes an event. So the engine loses at most `put_timeout`
    per event the consumer takes. Consumers that must see everything (TraceWriter, metrics) subscribe
    synchronously with `EventBus.subscribe` instead.
    """

    def __init__(self, bus: EventBus | None, maxsize: int, put_timeout: float) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.put_timeout = put_timeout
        self.dropped = 0
        self._bus = bus
        self._buf: deque[Event] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        self._stalled = False

    def _put(self, event: Event) -> bool:
        """Publisher side. False when the event was dropped."""
        with self._lock:
            if self._closed:
                return True  # nobody listens any more: not a drop
            if len(self._buf) >= self.maxsize:
                if self._stalled or not self._not_full.wait_for(
                        lambda: self._closed or len(self._buf) < self.maxsize, self.put_timeout):
                    self._stalled = True
                    self.dropped += 1
                    return False
                if self._closed:
                    return True
            self._buf.append(event)
            self._not_empty.notify()
            return True

    def _took(self) -> None:  # caller holds the lock
        self._stalled = False
        self._not_full.notify_all()

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, blocking; None once closed and drained. Raises queue.Empty on timeout."""
        with self._lock:
            if not self._not_empty.wait_for(lambda: self._buf or self._closed, timeout):
                raise queue.Empty
            if not self._buf:
                return None
            event = self._buf.popleft()
            self._took()
            return event

    def drain(self) -> list[Event]:
        """Every event queued right now, without blocking (for UIs that poll on a timer)."""
        with self._lock:
            out = list(self._buf)
            self._buf.clear()
            if out:
                self._took()
            return out

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        event = self.get()
        if event is None:
            raise StopIteration
        return event

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop receiving (consumer side). Events already queued can still be read."""
        if self._bus is not None:
            self._bus._detach(self)
        self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()  # wake a publisher waiting for room


class EventBus:
    """Bounded, thread-safe publish/subscribe for events.

    - `subscribe(callback)`: called synchronously in the publisher's thread, in subscription order.
      It must be fast; an exception propagates to the publisher (a broken TraceWriter should fail the
      run, not be hidden). Returns a function that unsubscribes.
    - `open_queue()`: a bounded queue for a consumer in another thread; see QueueSubscription for the
      full-queue policy. `dropped` is the bus-wide count of events dropped that way.
    - Publishes are serialised, so every consumer sees the same order of events.
    - `close()` wakes every consumer (and any publisher waiting for room); publishing afterwards is a
      no-op, as is subscribing (the callback is never called, a new queue is already closed).
    """

    def __init__(self, maxsize: int = 10_000, put_timeout: float = 0.1) -> None:
        self.maxsize = maxsize
        self.put_timeout = put_timeout
        self.dropped = 0
        self._lock = threading.Lock()  # guards the subscriber tuples (copy-on-write)
        self._publish_lock = threading.RLock()  # RLock: a callback that publishes must not deadlock
        self._callbacks: tuple[Callable[[Event], Any], ...] = ()
        self._queues: tuple[QueueSubscription, ...] = ()
        self._closed = False

    def publish(self, event: Event) -> None:
        with self._publish_lock:
            if self._closed:
                return
            for callback in self._callbacks:
                callback(event)
            for sub in self._queues:
                if not sub._put(event):
                    self.dropped += 1

    def subscribe(self, callback: Callable[[Event], Any]) -> Callable[[], None]:
        with self._lock:
            if not self._closed:
                self._callbacks += (callback,)

        def unsubscribe() -> None:
            with self._lock:
                cbs = list(self._callbacks)
                for i, c in enumerate(cbs):
                    if c is callback:
                        del cbs[i]
                        break
                self._callbacks = tuple(cbs)
        return unsubscribe

    def open_queue(self, maxsize: int | None = None, put_timeout: float | None = None) -> QueueSubscription:
        sub = QueueSubscription(self, self.maxsize if maxsize is None else maxsize,
                                self.put_timeout if put_timeout is None else put_timeout)
        with self._lock:
            if not self._closed:
                self._queues += (sub,)
                return sub
        sub._shutdown()
        return sub

    def _detach(self, sub: QueueSubscription) -> None:
        with self._lock:
            self._queues = tuple(q for q in self._queues if q is not sub)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            subs, self._queues, self._callbacks = self._queues, (), ()
        for sub in subs:
            sub._shutdown()

    def __enter__(self) -> EventBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- TraceWriter ------------------------------------------------------------------------------------
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


class TraceWriter:
    """Writes a `dlm-studio.trace/1` JSONL file: the header at once, events with `write` (or by
    subscribing the writer itself to an EventBus), the footer with `close(footer)`.

    Line-buffered: every line reaches the OS as soon as it is written, so a crash leaves a readable,
    truncated trace. As a context manager it closes on exit; without a `close(footer)` first (e.g. on
    an exception) the trace stays truncated, which is the honest record.

    Non-finite floats are written as null. Invalid header/event/footer dicts raise ValueError (a bug
    in the code calling the writer); a path that cannot be opened raises BadInput.
    """

    def __init__(self, path: str | os.PathLike[str], header: Mapping[str, Any]) -> None:
        self.path = Path(path)
        full: dict[str, Any] = {"kind": "header", "schema": SCHEMA,
                                "run_id": header.get("run_id") or uuid.uuid4().hex,
                                "created": header.get("created") or _now_iso()}
        full.update((k, v) for k, v in header.items() if k not in full)
        if problem := _problem(full, _HEADER_CHECKS):
            raise ValueError(f"trace header: {problem}")
        line = _dumps(full) + "\n"  # before opening: an unserialisable header leaves no file behind
        self.header = full
        self.n_events = 0
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._f = open(self.path, "w", encoding="utf-8", newline="\n", buffering=1)
        except OSError as e:
            raise _bad(f"{self.path}: cannot write trace: {e.strerror or e}") from None
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

    __call__ = write  # so `bus.subscribe(writer)` works

    def close(self, footer: Mapping[str, Any] | None = None) -> None:
        """Write `footer` (if given) and close. Idempotent: later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            try:
                if footer is not None:
                    full = {"kind": "footer", **{k: v for k, v in footer.items() if k != "kind"}}
                    if problem := _problem(full, _FOOTER_CHECKS):
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

    @property
    def truncated(self) -> bool:
        return self.footer is None


_PARTIAL = object()  # marks an unterminated, unparsable last line: the writer died mid-line


def check_schema(schema: Any, where: str = "trace") -> None:
    """Accept dlm-studio.trace/1 and any 1.x; raise BadInput for anything else."""
    m = _SCHEMA_RE.fullmatch(schema) if isinstance(schema, str) else None
    if m is None or int(m.group(1)) != _MAJOR:
        raise _bad(f"{where}: unsupported trace schema {_short(schema)} (this build reads {SCHEMA})")


class TraceReader:
    """Streams a trace: the header is read and checked on open; iterating yields the events (each
    validated) and sets `footer` at the end. Iterate once. Every error is a one-line BadInput naming
    the path and line number.
    """

    def __init__(self, path: str | os.PathLike[str], *, allow_truncated: bool = False) -> None:
        self.path = Path(path)
        self.allow_truncated = allow_truncated
        self.footer: dict[str, Any] | None = None
        self._lineno = 0
        self._iterated = False
        try:
            self._f = open(self.path, "rb")
        except FileNotFoundError:
            raise _bad(f"{self.path}: no such trace file") from None
        except OSError as e:
            raise _bad(f"{self.path}: cannot read trace: {e.strerror or e}") from None
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
            raise _bad(f"{self._where()}: not valid JSON ({why})") from None
        if not isinstance(obj, dict):
            raise _bad(f"{self._where()}: expected a JSON object, got {type(obj).__name__}")
        return obj

    def _read_header(self) -> dict[str, Any]:
        obj = self._next()
        if obj is None:
            raise _bad(f"{self.path}: empty file (expected a {SCHEMA} header on line 1)")
        if obj is _PARTIAL:
            raise _bad(f"{self._where()}: truncated trace: the header line is incomplete")
        if obj.get("kind") != "header":
            raise _bad(f"{self._where()}: first line is not a trace header (expected \"kind\": \"header\")")
        check_schema(obj.get("schema"), self._where())
        if problem := _problem(obj, _HEADER_CHECKS):
            raise _bad(f"{self._where()}: header: {problem}")
        return obj

    def _truncated(self, detail: str) -> None:
        if not self.allow_truncated:
            raise _bad(f"{self.path}: truncated trace: {detail} (the run did not finish)")

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
                    raise _bad(f"{self._where()}: content after the footer")
                if obj is _PARTIAL:
                    self._truncated(f"line {self._lineno} is incomplete and there is no footer")
                    return
                if "t" in obj:
                    validate_event(obj, self._where())
                    yield obj
                elif obj.get("kind") == "footer":
                    if problem := _problem(obj, _FOOTER_CHECKS):
                        raise _bad(f"{self._where()}: footer: {problem}")
                    self.footer = obj
                elif obj.get("kind") == "header":
                    raise _bad(f"{self._where()}: a second header")
                else:
                    raise _bad(f"{self._where()}: neither an event (no 't' field) nor a footer")
        finally:
            self._f.close()

    def read(self) -> Trace:
        events = list(self)
        return Trace(self.header, events, self.footer)

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

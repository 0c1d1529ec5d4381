"""Event schema ``dlm-studio.trace/1.3``: the one contract between the engine and every consumer
(docs/events.md). Fields, their validation, and one constructor per event kind.

The engine describes every decoding step as small plain-dict events (JSON-ready, cheap to build on
the hot path); the CLI printer, TUI, web UI, trace files and metrics read nothing else.

Versioning: ``dlm-studio.trace/MAJOR[.MINOR]``. A minor bump may add fields (readers ignore fields they don't
know, and keep them in the dicts), event kinds and enum values; a reader skips the event kinds of a newer minor
it does not know (`TraceReader.skipped` counts them). Changed meanings need a new major, which this build
refuses to read. 1.1 added `edit`, `remask`, `kv {op: refresh}` and the header's `canvas`; 1.2 added `plan` (the
draft count a cost-aware strategy chose for its next forward and the speed-up over a plain AR step it expects); 1.3
added draft trees: `propose.parent`, `accept.node` and `reject.node`.

Values must be plain Python types (use ``.tolist()`` / ``.item()`` on tensors); consumers share the
event dicts and must not mutate them. A read trace may hold ``None`` for any float (see trace.py).
"""
from __future__ import annotations

import re
import types
from functools import partial
from typing import Any, Callable, Literal, Mapping, Union, get_args, get_origin

from studio.errors import BadInput

SCHEMA = "dlm-studio.trace/1.3"
_SCHEMA_RE = re.compile(r"dlm-studio\.trace/([0-9]{1,9})(?:\.([0-9]{1,9}))?")  # int() refuses 4300+ digits
_MAJOR, _MINOR = 1, 3

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
    "edit": {"pos": list[int], "old": list[int], "tok": list[int], "conf": list[float]},
    "remask": {"pos": list[int], "tok": list[int]},
    "block": {"op": Literal["open", "close"], "start": int, "end": int},
    "route": {"verify": bool, "score": float, "policy": str},
    "plan": {"drafts": int, "max_drafts": int, "gain": float},
    "kv": {"op": Literal["commit", "rollback", "refresh"], "from_len": int, "to_len": int},
    "emit": {"pos": list[int], "tok": list[int], "text": str},
}
# Optional fields (added in 1.x, so readers must not require them). emit.pieces: the text of each
# token on its own, for per-token displays (`text` alone cannot always be split back into tokens).
# forward.experts: on a mixture-of-experts model, how many distinct experts each MoE layer ran (what a wide
# forward pays for: every expert it touches is read). accept.h / reject.h: the target's entropy (nats, softmax of
# its raw logits at temperature 1) at each verified position, where the strategy verified from raw logits.
# propose.parent (1.3, a draft tree): each draft's parent among this propose's drafts (-1: the committed context), so
# drafts at one position are siblings; accept.node: the accepted drafts' indices in that propose (the path taken);
# reject.node: a refused candidate's index (a step may refuse several, siblings at one position).
OPTIONAL_FIELDS: dict[str, dict[str, Any]] = {"emit": {"pieces": list[str]}, "forward": {"experts": list[int]},
                                              "accept": {"h": list[float], "node": list[int]},
                                              "reject": {"h": float, "node": int}, "propose": {"parent": list[int]}}
ROLES: tuple[str, ...] = get_args(EVENT_FIELDS["forward"]["role"])
SOURCES: tuple[str, ...] = get_args(EVENT_FIELDS["propose"]["src"])

HEADER_FIELDS: dict[str, Any] = {
    "schema": str, "run_id": str, "created": str, "strategy": str, "params": dict,
    "model": {"name": str, "arch": str, "dtype": str, "device": str, "adapter": str | None},
    "tokenizer": {"name": str, "vocab_size": int, "eos_ids": list[int], "mask_id": int | None},
    "prompt": {"text": str, "token_ids": list[int]},
    "seed": int | None,
}
# header.canvas (1.1, canvas strategies): the canvas after the prompt -- its length (--max-new-tokens) and the
# block size it is filled by -- so a viewer can lay out every cell before the first is filled.
OPTIONAL_HEADER_FIELDS: dict[str, Any] = {"canvas": {"length": int, "block_size": int}}

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


def bad_trace(msg: str) -> BadInput:
    """A BadInput the CLI prints as exactly one line."""
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
        raise bad_trace(f"{where}: an event must be a JSON object, got {_short(event)}")
    kind = event.get("t")
    compiled = _EVENT_CHECKS.get(kind) if isinstance(kind, str) else None
    if compiled is None:
        if "t" not in event:
            raise bad_trace(f"{where}: event has no 't' (kind) field")
        raise bad_trace(f"{where}: unknown event kind {_short(kind)} (known: {', '.join(EVENT_FIELDS)})")
    if problem := _problem(event, compiled):
        raise bad_trace(f"{where}: {kind} event: {problem}")
    optional = OPTIONAL_FIELDS.get(kind, {})
    present = {k: spec for k, spec in optional.items() if k in event}
    if present and (problem := _problem(event, _compile(present))):
        raise bad_trace(f"{where}: {kind} event: {problem}")
    if event["step"] < 0:
        raise bad_trace(f"{where}: {kind} event: field 'step' must be >= 0, got {event['step']}")
    lists = [*_LIST_FIELDS[kind], *(k for k, spec in present.items() if get_origin(spec) is list)]
    if len(lists) > 1 and len({len(event[n]) for n in lists}) > 1:
        lens = ", ".join(f"{n}={len(event[n])}" for n in lists)
        raise bad_trace(f"{where}: {kind} event: fields {'/'.join(lists)} must have the same length ({lens})")


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
edit = partial(make, "edit")
remask = partial(make, "remask")
block = partial(make, "block")
route = partial(make, "route")
plan = partial(make, "plan")
kv = partial(make, "kv")
emit = partial(make, "emit")




def header_problem(header: Mapping[str, Any]) -> str | None:
    """The first thing wrong with a trace header, or None."""
    present = {k: spec for k, spec in OPTIONAL_HEADER_FIELDS.items() if k in header}
    return _problem(header, _HEADER_CHECKS) or (_problem(header, _compile(present)) if present else None)


def footer_problem(footer: Mapping[str, Any]) -> str | None:
    """The first thing wrong with a trace footer, or None."""
    return _problem(footer, _FOOTER_CHECKS)


def check_schema(schema: Any, where: str = "trace") -> int:
    """The minor version of `schema`; BadInput unless it is a version this build reads (major 1, any minor)."""
    m = _SCHEMA_RE.fullmatch(schema) if isinstance(schema, str) else None
    if m is None or int(m.group(1)) != _MAJOR:
        raise bad_trace(f"{where}: unsupported trace schema {_short(schema)} (this build reads {SCHEMA})")
    return int(m.group(2) or 0)


def newer_minor(minor: int) -> bool:
    """Whether a trace of this minor version may hold event kinds this build does not know (it skips them)."""
    return minor > _MINOR

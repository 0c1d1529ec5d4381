"""Fuzzing the trace reader: studio.events.read_trace (JSON Lines: header, events, footer), strict and with
allow_truncated=True, seeded with the real traces in tests/support/fixtures/.

Each mutation family is one test; see tests/support/fuzzing.py for the property and the profiles."""
from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from studio.events import EVENT_FIELDS, FOOTER_FIELDS, HEADER_FIELDS, Trace, read_trace
from tests.support.fuzzing import (bad_values, bit_flipped, check_reader, dump_json, fuzz, mutated_doc, spliced, truncated,
                           write_case)

pytest_plugins = ["tests.support.fuzzing"]

FIXTURES = Path(__file__).parents[1] / "support" / "fixtures"
SEEDS = tuple(p.read_bytes() for p in sorted(FIXTURES.glob("*.jsonl")))
LINES = tuple(tuple(s.splitlines(keepends=True)) for s in SEEDS)
KEYS = tuple(sorted({"kind", "t", "step", "ms", *HEADER_FIELDS, *FOOTER_FIELDS,
                     *(k for fields in EVENT_FIELDS.values() for k in fields)}))


def _valid(trace) -> None:
    assert isinstance(trace, Trace) and isinstance(trace.header, dict) and isinstance(trace.events, list)
    assert all(isinstance(e, dict) and isinstance(e.get("t"), str) for e in trace.events)
    assert trace.footer is None or isinstance(trace.footer, dict)


def read_case(data: bytes, allow_truncated: bool):
    p = write_case("case.jsonl", data)
    return check_reader("trace", lambda: read_trace(p, allow_truncated=allow_truncated), data, names=(p.name,),
                        valid=_valid)


def test_trace_seeds_are_valid():
    for seed in SEEDS:
        t = read_case(seed, False)
        assert t.footer is not None and t.events


_SEED = st.sampled_from(range(len(SEEDS)))


@fuzz(80)
@given(_SEED.flatmap(lambda i: truncated(SEEDS[i], 600)), st.booleans())
def test_trace_truncated(data, allow_truncated):
    """A trace cut anywhere: mid-header, mid-line, between lines."""
    read_case(data, allow_truncated)


@fuzz(80)
@given(_SEED.flatmap(lambda i: bit_flipped(SEEDS[i], 600)), st.booleans())
def test_trace_bit_flips(data, allow_truncated):
    read_case(data, allow_truncated)


@fuzz(80)
@given(_SEED.flatmap(lambda i: spliced(SEEDS[i], SEEDS, 600)), st.booleans())
def test_trace_splices(data, allow_truncated):
    """Chunks of the traces (or non-UTF-8 bytes, CR, NUL, U+2028) inserted, overwritten, deleted, repeated."""
    read_case(data, allow_truncated)


def _line_index(n: int):
    """A line: the header, the footer, the first event, or any (the header and footer half the time)."""
    return st.one_of(st.sampled_from([0, n - 1, 1]), st.integers(0, n - 1))


@st.composite
def _field_mutation(draw):
    lines = list(LINES[draw(_SEED)])
    i = draw(_line_index(len(lines)))
    obj = json.loads(lines[i])
    lines[i] = dump_json(draw(mutated_doc(obj, "json", keys=KEYS))) + b"\n"
    return b"".join(lines)


@fuzz(160)
@given(_field_mutation(), st.booleans())
def test_trace_fields(data, allow_truncated):
    """One field of one line (header, footer or event) replaced by a wrong type / huge int / NaN / inf /
    non-UTF-8 / a deeply nested value, deleted, or a known field added with such a value."""
    read_case(data, allow_truncated)


@st.composite
def _line_mutation(draw):
    lines = list(LINES[draw(_SEED)])
    i = draw(_line_index(len(lines)))
    op = draw(st.sampled_from(("drop", "duplicate", "swap", "insert", "blank", "no newline")))
    if op == "drop":
        del lines[i]
    elif op == "duplicate":
        lines.insert(i, lines[i])
    elif op == "swap":
        j = draw(_line_index(len(lines)))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == "insert":
        lines.insert(i, dump_json(draw(bad_values("json"))) + b"\n")
    elif op == "blank":
        lines.insert(i, draw(st.sampled_from([b"\n", b"   \n", b"\r\n", b"\t\n", b"\x0b\n", b"\xc2\xa0\n"])))
    else:
        lines[i] = lines[i].rstrip(b"\n")
    return b"".join(lines)


@fuzz(120)
@given(_line_mutation(), st.booleans())
def test_trace_lines(data, allow_truncated):
    """Whole lines dropped, repeated, swapped, blanked, joined, or a JSON value of any kind inserted."""
    read_case(data, allow_truncated)

"""The event contract: schema checks, trace round trip, reader errors, metrics."""
from __future__ import annotations

import json
import math

import pytest

from studio import events as ev
from studio.errors import BadInput


def header(**over):
    h = {
        "strategy": "isd",
        "params": {"stride": 4, "tau": 0.0},
        "model": {"name": "smollm2-135m", "arch": "llama", "dtype": "float32", "device": "cpu", "adapter": None},
        "tokenizer": {"name": "smollm2", "vocab_size": 49152, "eos_ids": [0, 2], "mask_id": None},
        "prompt": {"text": "Hello", "token_ids": [19556]},
        "seed": 0,
    }
    h.update(over)
    return h


def one_of_each() -> list[dict]:
    return [
        ev.forward(0, 0.0, role="prefill", n_tokens=5, lora_rows=0, wall_ms=3.5),
        ev.emit(0, 0.1, pos=[0], tok=[11], text="a"),
        ev.propose(0, 0.2, pos=[1, 2], tok=[12, 13], q=[0.9, 0.5], src="mask"),
        ev.plan(1, 0.9, drafts=3, max_drafts=3, gain=1.21),
        ev.forward(1, 1.0, role="verify", n_tokens=7, lora_rows=3, wall_ms=12.3),
        ev.accept(1, 1.1, pos=[1], tok=[12], p=[0.8], q=[0.9]),
        ev.reject(1, 1.2, pos=2, tok=13, p=0.1, q=0.5),
        ev.resample(1, 1.3, pos=2, tok=14),
        ev.bonus(1, 1.4, pos=3, tok=15),
        ev.unmask(1, 1.5, pos=[4, 5], tok=[16, 17], conf=[0.99, 1]),
        ev.edit(1, 1.55, pos=[4], old=[16], tok=[18], conf=[0.95]),
        ev.remask(1, 1.56, pos=[5], tok=[3]),
        ev.block(1, 1.6, op="open", start=4, end=8),
        ev.route(1, 1.7, verify=True, score=0.42, policy="threshold"),
        ev.kv(1, 1.8, op="rollback", from_len=12, to_len=9),
        ev.kv(1, 1.85, op="refresh", from_len=4, to_len=9),
        ev.emit(1, 1.9, pos=[1, 2, 3], tok=[12, 14, 15], text="bcd"),
    ]


def footer(events, **over):
    f = {**ev.summarize(events), "stop_reason": "max_tokens", "wall_s": 0.5, "tok_s": 8.0, "prefill_s": 0.01}
    f.update(over)
    return f


def write_lines(path, objs, tail=""):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs) + tail)
    return path


def full_header(**over):
    return {"kind": "header", "schema": ev.SCHEMA, "run_id": "r1", "created": "2025-01-01T00:00:00Z",
            **header(**over)}


# -- constructors and validation ----------------------------------------------------------------------
def test_every_kind_has_a_helper_that_builds_a_valid_event():
    built = {e["t"] for e in one_of_each()}
    assert built == set(ev.EVENT_FIELDS)
    for e in one_of_each():
        ev.validate_event(e)
        assert list(e)[:3] == ["t", "step", "ms"]
        assert set(e) - {"t", "step", "ms"} == set(ev.EVENT_FIELDS[e["t"]])


def test_make_rejects_unknown_kind_and_wrong_field_names():
    with pytest.raises(ValueError, match="unknown event kind"):
        ev.make("teleport", 0, 0.0)
    with pytest.raises(TypeError, match="missing fields \\['wall_ms'\\]"):
        ev.forward(1, 0.0, role="verify", n_tokens=1, lora_rows=0)
    with pytest.raises(TypeError, match="unexpected fields \\['extra'\\]"):
        ev.bonus(1, 0.0, pos=1, tok=2, extra=3)


@pytest.mark.parametrize("event, needle", [
    (ev.bonus(1, 0.0, pos=True, tok=2), "field 'pos' must be int"),          # bool is not an int
    (ev.bonus(1, 0.0, pos=1.0, tok=2), "field 'pos' must be int"),
    (ev.emit(1, 0.0, pos=[0, "1"], tok=[1, 2], text="x"), "field 'pos' must be list[int]"),
    (ev.accept(1, 0.0, pos=[0], tok=[1], p=[0.5], q=["x"]), "field 'q' must be list[float]"),
    (ev.forward(1, 0.0, role="sideways", n_tokens=1, lora_rows=0, wall_ms=1.0), "field 'role' must be one of"),
    (ev.route(1, 0.0, verify=1, score=0.5, policy="p"), "field 'verify' must be bool"),
    (ev.emit(1, 0.0, pos=[0, 1], tok=[1], text="x"), "same length"),
    (ev.bonus(-1, 0.0, pos=1, tok=2), "'step' must be >= 0"),
    ({"step": 0, "ms": 0.0}, "no 't'"),
    ({"t": "teleport", "step": 0, "ms": 0.0}, "unknown event kind"),
    ({"t": "bonus", "step": 0, "ms": 0.0, "pos": 1}, "missing field 'tok'"),
])
def test_validate_event_names_the_problem(event, needle):
    with pytest.raises(BadInput) as e:
        ev.validate_event(event, "here")
    msg = str(e.value)
    assert msg.startswith("here: ") and needle in msg and "\n" not in msg


def test_validate_event_accepts_ints_nan_and_null_for_floats_and_extra_fields():
    ev.validate_event(ev.reject(1, 2, pos=0, tok=1, p=1, q=math.nan))
    ev.validate_event({**ev.reject(1, 0.0, pos=0, tok=1, p=None, q=math.inf), "new_in_1_1": "ok"})


# -- metrics -----------------------------------------------------------------------------------------
def test_summarize_hand_computed():
    events = [
        ev.forward(0, 0.0, role="prefill", n_tokens=4, lora_rows=0, wall_ms=1.0),
        ev.forward(1, 1.0, role="verify", n_tokens=4, lora_rows=0, wall_ms=1.0),
        ev.accept(1, 1.1, pos=[0, 1], tok=[5, 6], p=[0.9, 0.8], q=[1.0, 1.0]),
        ev.reject(1, 1.2, pos=2, tok=7, p=0.1, q=0.9),
        ev.emit(1, 1.3, pos=[0, 1, 2], tok=[5, 6, 8], text="abc"),
        ev.forward(2, 2.0, role="verify", n_tokens=4, lora_rows=0, wall_ms=1.0),
        # accept listed out of pos order: slots follow pos, not event order
        ev.accept(2, 2.1, pos=[5, 3, 4], tok=[1, 2, 3], p=[1.0] * 3, q=[1.0] * 3),
        ev.forward(3, 3.0, role="commit", n_tokens=1, lora_rows=0, wall_ms=1.0),
        ev.emit(3, 3.1, pos=[3, 4, 5, 6], tok=[2, 3, 1, 9], text="defg"),
    ]
    s = ev.summarize(iter(events))  # any iterable, single pass
    assert s["n_tokens"] == 7
    assert s["forwards"] == 3
    assert s["tpf"] == pytest.approx(7 / 3)
    assert s["accept_rate"] == pytest.approx(5 / 6)
    assert s["accept_by_pos"] == pytest.approx([1.0, 1.0, 0.5])
    assert s["text"] == "abcdefg"
    assert not {"wall_s", "tok_s", "prefill_s", "stop_reason"} & set(s)


def test_summarize_empty_and_no_verification():
    assert ev.summarize([]) == {"text": "", "n_tokens": 0, "forwards": 0, "tpf": 0.0,
                                "accept_rate": 0.0, "accept_by_pos": []}
    s = ev.summarize([ev.forward(0, 0, role="prefill", n_tokens=3, lora_rows=0, wall_ms=1),
                      ev.emit(0, 0, pos=[0], tok=[1], text="x")])
    assert (s["forwards"], s["tpf"], s["accept_rate"]) == (0, 0.0, 0.0)


# -- trace round trip ----------------------------------------------------------------------------------
def test_round_trip(tmp_path):
    events = one_of_each()
    path = tmp_path / "t.jsonl"
    with ev.TraceWriter(path, header()) as w:
        for e in events:
            w.write(e)
        w.close(footer(events))
    trace = ev.read_trace(path)
    assert trace.events == events
    assert trace.footer == {"kind": "footer", **footer(events)}
    assert not trace.truncated
    h = trace.header
    assert (h["kind"], h["schema"]) == ("header", ev.SCHEMA)
    assert h["run_id"] and h["created"].endswith("Z") and h == w.header
    assert {k: h[k] for k in header()} == header()
    assert len(path.read_text().splitlines()) == len(events) + 2


def test_writer_keeps_given_run_id(tmp_path):
    path = tmp_path / "t.jsonl"
    events = one_of_each()
    with ev.TraceWriter(path, header(run_id="abc")) as w:
        for e in events:
            w.write(e)
        w.close(footer(events))
    trace = ev.read_trace(path)
    assert trace.header["run_id"] == "abc" and trace.events == events


def test_non_finite_floats_are_written_as_null(tmp_path):
    path = tmp_path / "t.jsonl"
    events = [ev.reject(1, 0.5, pos=0, tok=1, p=math.nan, q=0.25),
              ev.unmask(1, 0.6, pos=[0, 1], tok=[1, 2], conf=[math.inf, 0.5])]
    with ev.TraceWriter(path, header(params={"temperature": -math.inf})) as w:
        for e in events:
            w(e)
        w.close(footer(events, tok_s=math.inf))
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def strict(tok):
        raise AssertionError(f"non-strict JSON token {tok}")
    for line in text.splitlines():
        json.loads(line, parse_constant=strict)
    trace = ev.read_trace(path)
    assert trace.events[0]["p"] is None and trace.events[0]["q"] == 0.25
    assert trace.events[1]["conf"] == [None, 0.5]
    assert trace.footer["tok_s"] is None and trace.header["params"]["temperature"] is None
    assert math.isnan(events[0]["p"])  # the caller's event is not mutated


def test_writer_rejects_bad_header_event_footer_as_bugs(tmp_path):
    with pytest.raises(ValueError, match="missing field 'model.arch'"):
        bad = header()
        del bad["model"]["arch"]
        ev.TraceWriter(tmp_path / "a.jsonl", bad)
    with ev.TraceWriter(tmp_path / "b.jsonl", header()) as w:
        with pytest.raises(ValueError, match="field 'tok' must be int"):
            w.write(ev.bonus(1, 0.0, pos=1, tok="x"))
        with pytest.raises(ValueError, match="trace footer: missing field"):
            w.close({"stop_reason": "eos"})
        with pytest.raises(ValueError, match="closed"):
            w.write(ev.bonus(1, 0.0, pos=1, tok=2))
    with pytest.raises(BadInput, match="cannot write trace"):
        ev.TraceWriter(tmp_path / "no" / "such" / "dir.jsonl", header())


def test_crash_leaves_a_readable_truncated_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    with pytest.raises(RuntimeError):
        with ev.TraceWriter(path, header()) as w:
            w.write(one_of_each()[0])
            # Line-buffered: already on disk before close.
            assert len(path.read_text().splitlines()) == 2
            raise RuntimeError("engine died")
    with pytest.raises(BadInput, match="truncated") as e:
        ev.read_trace(path)
    assert "line 2" in str(e.value) and "\n" not in str(e.value)
    trace = ev.read_trace(path, allow_truncated=True)
    assert trace.truncated and trace.events == one_of_each()[:1]


# -- reader errors ------------------------------------------------------------------------------------
BONUS = ev.bonus(1, 0.0, pos=1, tok=2)
FOOTER = {"kind": "footer", **footer([])}


@pytest.mark.parametrize("lines, tail, line_no, needle", [
    ([full_header(), BONUS], "{not json\n", 3, "not valid JSON"),
    ([BONUS, FOOTER], "", 1, "first line is not a trace header"),
    ([[1, 2]], "", 1, "expected a JSON object"),
    ([full_header(), BONUS, {"t": "teleport", "step": 1, "ms": 0.0}, FOOTER], "", 3, "unknown event kind"),
    ([full_header(), {"t": "bonus", "step": 1, "ms": 0.0, "pos": 1}, FOOTER], "", 2, "missing field 'tok'"),
    ([full_header(), {**BONUS, "tok": 2.5}, FOOTER], "", 2, "field 'tok' must be int"),
    ([full_header(), BONUS, FOOTER, BONUS], "", 4, "content after the footer"),
    ([full_header(), FOOTER], '{"t": "bo', 3, "content after the footer"),
    ([full_header(), full_header()], "", 2, "a second header"),
    ([full_header(), {"hello": 1}], "", 2, "neither an event"),
    ([full_header(), {**FOOTER, "n_tokens": "7"}], "", 2, "footer: field 'n_tokens'"),
    ([{**full_header(), "tokenizer": {"name": "x"}}], "", 1, "header: missing field 'tokenizer.vocab_size'"),
    ([full_header(), BONUS], "", 2, "truncated"),
    ([full_header(), BONUS], '{"t": "emit", "st', 3, "truncated"),
    ([], '{"kind": "hea', 1, "truncated"),
    ([{**full_header(), "schema": "dlm-studio.trace/2"}], "", 1,
     "unsupported trace schema 'dlm-studio.trace/2' (this build reads dlm-studio.trace/1.3)"),
    ([{**full_header(), "schema": "other/1"}], "", 1, "unsupported trace schema"),
])
def test_reader_errors_are_one_line_with_path_and_line(tmp_path, lines, tail, line_no, needle):
    path = write_lines(tmp_path / "bad.jsonl", lines, tail)
    with pytest.raises(BadInput) as e:
        ev.read_trace(path)
    msg = str(e.value)
    assert needle in msg, msg
    assert str(path) in msg and f"line {line_no}" in msg and "\n" not in msg


def test_reader_missing_empty_and_binary_files(tmp_path):
    for path, needle in [(tmp_path / "nope.jsonl", "no such trace file"),
                         (write_lines(tmp_path / "empty.jsonl", [], "\n\n"), "empty file"),
                         (tmp_path, "cannot read trace")]:
        with pytest.raises(BadInput, match=needle) as e:
            ev.read_trace(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00\n")
    with pytest.raises(BadInput, match="line 1: not valid JSON"):
        ev.read_trace(tmp_path / "bin.jsonl")


def test_allow_truncated_drops_a_torn_last_line(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [full_header(), BONUS], '{"t": "emit", "st')
    trace = ev.read_trace(path, allow_truncated=True)
    assert trace.footer is None and trace.events == [BONUS]


def test_a_newer_minor_versions_unknown_kinds_are_skipped_and_counted_an_older_ones_refused(tmp_path):
    teleport = {"t": "teleport", "step": 1, "ms": 0.0}
    trace = ev.read_trace(write_lines(tmp_path / "t.jsonl", [
        {**full_header(), "schema": "dlm-studio.trace/1.9"}, BONUS, teleport, FOOTER]))
    assert trace.events == [BONUS] and trace.skipped == 1
    old = ev.read_trace(write_lines(tmp_path / "o.jsonl", [{**full_header(), "schema": "dlm-studio.trace/1"}, BONUS,
                                                             FOOTER]))
    assert old.events == [BONUS] and old.skipped == 0   # 1.0 traces read as they always did
    with pytest.raises(BadInput, match="unknown event kind"):   # this build's own minor knows every kind
        ev.read_trace(write_lines(tmp_path / "u.jsonl", [full_header(), BONUS, teleport, FOOTER]))


def test_the_canvas_header_field_is_checked_when_present(tmp_path):
    good = {**full_header(), "canvas": {"length": 32, "block_size": 8}}
    assert ev.read_trace(write_lines(tmp_path / "g.jsonl", [good, FOOTER])).header["canvas"]["length"] == 32
    with pytest.raises(BadInput, match="canvas.block_size"):
        ev.read_trace(write_lines(tmp_path / "b.jsonl", [{**good, "canvas": {"length": 32}}, FOOTER]))


def test_minor_version_accepted_and_unknown_fields_kept(tmp_path):
    lines = [{**full_header(), "schema": "dlm-studio.trace/1.7", "new": 1},
             {**BONUS, "chain": 3}, {**FOOTER, "energy_j": 2.0}]
    trace = ev.read_trace(write_lines(tmp_path / "t.jsonl", lines))
    assert trace.header["schema"] == "dlm-studio.trace/1.7"
    assert trace.events == [{**BONUS, "chain": 3}] and trace.footer["energy_j"] == 2.0


def test_reader_streams_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(full_header()) + "\n\n" + json.dumps(BONUS) + "\n" + json.dumps(FOOTER) + "\n")
    with ev.TraceReader(path) as r:
        assert r.header["strategy"] == "isd" and r.footer is None
        assert list(r) == [BONUS]
        assert r.footer == FOOTER
        with pytest.raises(RuntimeError):
            list(r)



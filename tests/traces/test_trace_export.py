"""Trace exports (Parquet, CSV, Perfetto, HTML), replay, and the `trace` CLI sub-app (no model needed)."""
from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from studio import events as ev
from studio.errors import BadInput
from studio.events import SCHEMA, read_trace, summarize
from studio.traces.cli import trace_app
from studio.traces.export import (default_out, export, html_report, metrics_from_events, perfetto_json,
                                  read_parquet, read_parquet_events, write_parquet)
from studio.traces.replay import replay
from tests.support.fixtures.traces import hand_events, header, synthetic_blockdiff, synthetic_isd, write_raw, write_trace

FIXTURES = Path(__file__).parents[1] / "support" / "fixtures"
REAL = [FIXTURES / "isd_smollm2.jsonl", FIXTURES / "ar_smollm2.jsonl"]
METRICS = ("n_tokens", "forwards", "tpf", "accept_rate", "accept_by_pos", "text")


@pytest.fixture
def hand(tmp_path):
    return write_trace(tmp_path / "hand.jsonl", hand_events(), strategy="s2d2")


def _all_traces(tmp_path):
    return [write_trace(tmp_path / "hand.jsonl", hand_events()),
            write_trace(tmp_path / "isd.jsonl", synthetic_isd(50, 4, 0.6, seed=4)),
            write_trace(tmp_path / "bd.jsonl", synthetic_blockdiff(24, 8, seed=4), strategy="blockdiff"), *REAL]


# -- Parquet ----------------------------------------------------------------------------------------
def test_parquet_one_row_per_event_same_values(tmp_path):
    import pyarrow.parquet as pq

    for src in _all_traces(tmp_path):
        t = read_trace(src)
        out = export(src, "parquet", tmp_path / (src.stem + ".parquet"))
        table = pq.read_table(out)
        assert table.num_rows == len(t.events)
        assert table.column_names[:5] == ["run_id", "strategy", "t", "step", "ms"]
        assert set(table.column("run_id").to_pylist()) == {t.header["run_id"]}
        assert table.column("t").to_pylist() == [e["t"] for e in t.events]
        assert table.column("ms").to_pylist() == [e["ms"] for e in t.events]
        back = read_parquet_events(out)
        assert back == t.events  # exact: kinds, scalars vs lists, floats, None
        for e in back:
            ev.validate_event(e)
        meta = json.loads(table.schema.metadata[b"dlm-studio.trace"])
        assert meta["header"] == t.header and meta["footer"] == t.footer
        # the metric definition, recomputed from the Parquet rows, gives the footer's numbers
        m = metrics_from_events(back)
        for k in ("tpf", "accept_rate", "n_tokens", "forwards"):
            assert m[k] == t.footer[k], (src.name, k)


def test_parquet_list_columns_and_multi_run(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = read_trace(write_trace(tmp_path / "a.jsonl", hand_events()))
    b = read_trace(REAL[0])
    out = write_parquet([a, b], tmp_path / "ab.parquet")
    table = pq.read_table(out)
    assert table.num_rows == len(a.events) + len(b.events)
    assert table.schema.field("pos").type == pa.list_(pa.int64())
    assert table.schema.field("verify").type == pa.bool_()
    rows = table.to_pylist()
    reject = next(r for r in rows if r["t"] == "reject")
    assert isinstance(reject["pos"], list) and len(reject["pos"]) == 1  # scalars become 1-element lists
    runs = read_parquet(out)
    assert [(r.header, r.events, r.footer) for r in runs] == [(a.header, a.events, a.footer),
                                                              (b.header, b.events, b.footer)]
    assert read_parquet_events(out, run_id=b.header["run_id"]) == b.events


def test_parquet_keeps_unknown_fields_and_nulls(tmp_path):
    E = hand_events()
    E[0] = {**E[0], "gpu_ms": 3.5, "note": {"a": [1, 2]}}   # fields of a future minor version
    E[5] = {**E[5], "p": [float("nan"), 0.2]}              # written as null
    t = read_trace(write_trace(tmp_path / "x.jsonl", E))
    assert t.events[5]["p"] == [None, 0.2]
    out = export(t, "parquet", tmp_path / "x.parquet")
    assert read_parquet_events(out) == t.events


def test_read_parquet_rejects_other_files(tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_text("not parquet")
    with pytest.raises(BadInput):
        read_parquet_events(bad)
    with pytest.raises(BadInput):
        read_parquet_events(tmp_path / "missing.parquet")


# -- CSV --------------------------------------------------------------------------------------------
def test_csv_one_row_per_event(tmp_path):
    for src in _all_traces(tmp_path)[:2] + REAL[:1]:
        t = read_trace(src)
        out = export(t, "csv", tmp_path / (src.stem + ".csv"))
        rows = list(csv.DictReader(out.open(encoding="utf-8")))
        assert len(rows) == len(t.events)
        for r, e in zip(rows, t.events):
            assert r["t"] == e["t"] and int(r["step"]) == e["step"] and float(r["ms"]) == e["ms"]
            for k in ("pos", "tok", "p", "q", "conf"):
                if k in e:
                    assert json.loads(r[k]) == e[k]
            if e["t"] == "emit":
                assert r["text"] == e["text"]
            if e["t"] == "route":
                assert r["verify"] in ("true", "false")


# -- Perfetto ---------------------------------------------------------------------------------------
def test_perfetto_slices_flows_counters(tmp_path, hand):
    for src in (hand, REAL[0], write_trace(tmp_path / "isd.jsonl", synthetic_isd(40, 4, 0.6, seed=8))):
        t = read_trace(src)
        out = export(src, "perfetto", tmp_path / (src.stem + ".json"))
        doc = json.loads(out.read_text())
        assert doc["displayTimeUnit"] == "ms"
        assert doc["metadata"]["header"] == t.header and doc["metadata"]["footer"] == t.footer
        te = doc["traceEvents"]
        forwards = [e for e in t.events if e["t"] == "forward"]
        slices = [x for x in te if x["ph"] == "X"]
        assert len(slices) == len(forwards)
        for x, f in zip(slices, forwards):
            assert x["name"] == f["role"] and x["cat"] == "forward"
            assert x["ts"] == pytest.approx((f["ms"] - f["wall_ms"]) * 1000, abs=1e-2)
            assert x["dur"] == pytest.approx(f["wall_ms"] * 1000, abs=1e-2)
            assert x["args"]["n_tokens"] == f["n_tokens"] and x["args"]["lora_rows"] == f["lora_rows"]
        starts = {x["id"]: x for x in te if x["ph"] == "s"}
        finishes = {x["id"]: x for x in te if x["ph"] == "f"}
        assert len(starts) == len([x for x in te if x["ph"] == "s"])
        assert starts.keys() == finishes.keys()
        assert all(f["bp"] == "e" for f in finishes.values())
        for i, s in starts.items():
            assert s["ts"] < finishes[i]["ts"]
            # both ends sit inside a forward slice on the same track (flow binding)
            for end in (s, finishes[i]):
                assert any(x["tid"] == end["tid"] and x["ts"] <= end["ts"] <= x["ts"] + x["dur"] for x in slices)
        counters = {x["name"] for x in te if x["ph"] == "C"}
        assert {"TPF (running)", "tokens emitted", "KV length"} <= counters
        tracks = {x["args"]["name"] for x in te if x["ph"] == "M" and x["name"] == "thread_name"}
        assert tracks == {"forwards", "decisions", "blocks"}
        assert any(x["ph"] == "M" and x["name"] == "process_name" for x in te)
        last_tpf = [x for x in te if x["name"] == "TPF (running)"][-1]["args"]["TPF"]
        assert last_tpf == pytest.approx(t.footer["tpf"], abs=1e-6)
    # the hand trace: verification of every proposed position is linked; every decision kind is an instant
    doc = perfetto_json([read_trace(hand)])
    te = doc["traceEvents"]
    linked = sorted(p for x in te if x["ph"] == "s" for p in x["args"]["positions"])
    assert linked == [1, 2, 3, 4, 5, 6]
    kinds = {x["cat"] for x in te if x["ph"] == "i"}
    assert {"accept", "reject", "resample", "bonus", "unmask", "emit", "route", "kv"} <= kinds
    assert "acceptance (running)" in {x["name"] for x in te if x["ph"] == "C"}
    assert [x["ph"] for x in te if x.get("cat") == "block"] == ["b", "e"]


def test_perfetto_multi_run_one_process_each(tmp_path, hand):
    doc = perfetto_json([read_trace(hand), read_trace(REAL[0])])
    names = {x["pid"]: x["args"]["name"] for x in doc["traceEvents"] if x["name"] == "process_name"}
    assert set(names) == {1, 2} and names[1].startswith("s2d2") and names[2].startswith("isd")
    ids = [x["id"] for x in doc["traceEvents"] if x["ph"] == "s"]
    assert len(ids) == len(set(ids))
    json.dumps(doc, allow_nan=False)


# -- HTML -------------------------------------------------------------------------------------------
def test_html_report_is_self_contained(tmp_path, hand):
    t = read_trace(hand)
    out = export(hand, "html", tmp_path / "r.html")
    doc = out.read_text(encoding="utf-8")
    assert "<script" not in doc and "http" not in doc.replace("http://www.w3.org/2000/svg", "")   # opens offline
    assert doc.count("<svg") == 4                        # trajectory, TPF, acceptance x2: static SVG
    for needle in (f"{t.footer['tpf']:.3f}", f"{t.footer['accept_rate']:.1%}", str(t.footer["n_tokens"]),
                   t.footer["stop_reason"], t.header["run_id"], "s2d2", "Generated text"):
        assert needle in doc, needle
    assert 'class="st-accepted"' in doc and 'class="st-unmasked"' in doc and 'class="st-bonus"' in doc


def test_html_multi_run_and_truncated(tmp_path, hand):
    ts = [read_trace(REAL[1]), read_trace(REAL[0]), read_trace(hand)]
    out = html_report(ts, tmp_path / "cmp.html", "three runs")
    doc = out.read_text(encoding="utf-8")
    assert "<script" not in doc and "Tokens vs forwards" in doc
    assert "<h1>three runs</h1>" in doc and "speed vs ar" in doc and "same text as ar" in doc
    assert "no acceptance figures" in doc  # the AR run verifies nothing
    trunc = write_trace(tmp_path / "trunc.jsonl", hand_events(), footer=False)
    t = read_trace(trunc, allow_truncated=True)
    doc = export(t, "html", tmp_path / "trunc.html").read_text(encoding="utf-8")
    assert "truncated" in doc


def test_default_out_and_export_errors(tmp_path, hand):
    assert default_out("/a/run.jsonl", "perfetto") == Path("/a/run.perfetto.json")
    assert default_out("/a/run.jsonl", "parquet") == Path("/a/run.parquet")
    assert default_out("/a/run.trace", "csv") == Path("/a/run.csv")
    with pytest.raises(BadInput):
        export(hand, "xml", tmp_path / "x.xml")
    with pytest.raises(BadInput):
        export(hand, "csv", tmp_path / "no" / "such" / "dir.csv")
    assert export(hand, "csv") == hand.with_suffix(".csv")


# -- replay -----------------------------------------------------------------------------------------
def _console(terminal: bool = False):
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=terminal, width=120, color_system="truecolor" if terminal else None)


def test_replay_every_kind_speed_zero(hand):
    t = read_trace(hand)
    con = _console()
    slept = []
    text = replay(t, speed=0, console=con, sleep=slept.append)
    out = con.file.getvalue()
    assert text == t.footer["text"] and slept == []
    assert t.footer["text"].splitlines()[0] in out and "Banana" in out
    for line in ("   1 verify   ■✓✓↻○○○", "   4 draft    ■■■■■■■■◇◇◆", "   6 commit"):
        assert line in out
    assert "TPF 2.000" in out
    # on a terminal (Live panel), too
    con = _console(terminal=True)
    assert replay(t, speed=0, console=con) == t.footer["text"]
    assert "Banana" in con.file.getvalue()


def test_replay_timing_and_truncated(tmp_path, hand):
    t = read_trace(hand)
    slept: list[float] = []
    replay(t, speed=2.0, console=_console(), sleep=slept.append)
    ends = [max(e["ms"] for e in t.events if e["step"] == s) for s in range(7)]
    assert slept == pytest.approx([(b - a) / 1000 / 2 for a, b in zip(ends, ends[1:])])
    slept.clear()
    replay(t, console=_console(), step_delay=0.01, sleep=slept.append)
    assert slept == [0.01] * 7
    trunc = read_trace(write_trace(tmp_path / "tr.jsonl", hand_events()[:12], footer=False), allow_truncated=True)
    con = _console()
    replay(trunc, speed=0, console=con)
    assert "truncated" in con.file.getvalue()


# -- the CLI sub-app --------------------------------------------------------------------------------
def _bad_traces(tmp_path):
    h = {"kind": "header", **header(), "run_id": "r1", "created": "2026-01-01T00:00:00Z"}
    good_event = ev.forward(0, 1.0, role="prefill", n_tokens=1, lora_rows=0, wall_ms=1.0)
    footer = {"kind": "footer", "stop_reason": "eos", "text": "", "n_tokens": 0, "forwards": 0, "tpf": 0.0,
              "accept_rate": 0.0, "accept_by_pos": [], "wall_s": 0.1, "tok_s": 0.0, "prefill_s": 0.0}
    return {
        "malformed": write_raw(tmp_path / "malformed.jsonl", [h, "{not json", footer]),
        "bad_event": write_raw(tmp_path / "bad_event.jsonl", [h, {**good_event, "role": "sideways"}, footer]),
        "truncated": write_raw(tmp_path / "truncated.jsonl", [h, good_event]),
        "wrong_version": write_raw(tmp_path / "v2.jsonl", [{**h, "schema": "dlm-studio.trace/2"}, good_event, footer]),
        "empty": write_raw(tmp_path / "empty.jsonl", []),
        "missing": tmp_path / "missing.jsonl",
    }


@pytest.mark.parametrize("cmd", [["info"], ["export", "--format", "parquet"], ["export", "-f", "html"],
                                 ["replay", "--speed", "0"]])
def test_cli_bad_traces_raise_badinput(tmp_path, cmd):
    runner = CliRunner()
    for name, path in _bad_traces(tmp_path).items():
        res = runner.invoke(trace_app, [cmd[0], str(path), *cmd[1:]])
        if name == "truncated":   # read, with a one-line warning
            assert res.exit_code == 0 and res.stderr.count("\n") == 1 and "truncated trace" in res.stderr, res.output
            continue
        assert isinstance(res.exception, BadInput), (name, res.output, res.exception)
        msg = str(res.exception)
        assert "\n" not in msg
        if name == "wrong_version":
            assert "dlm-studio.trace/2" in msg and SCHEMA in msg


def test_cli_entry_point_wrapper_exit_code_2(tmp_path):
    """How studio.cli.main treats BadInput: one line on stderr, exit 2 (a tiny stand-in for main)."""
    import subprocess
    import sys

    path = _bad_traces(tmp_path)["wrong_version"]
    code = ("import sys\nfrom studio.errors import BadInput\nfrom studio.traces.cli import trace_app\n"
            "try:\n    trace_app(sys.argv[1:], standalone_mode=False)\n"
            "except BadInput as e:\n    print(f'dlm-studio: error: {e}', file=sys.stderr); sys.exit(2)\n")
    r = subprocess.run([sys.executable, "-c", code, "info", str(path)], capture_output=True, text=True,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_cli_info_export_replay(tmp_path, hand):
    runner = CliRunner()
    t = read_trace(hand)
    res = runner.invoke(trace_app, ["info", str(hand)])
    assert res.exit_code == 0, res.output
    for needle in ("s2d2", "TPF 2.000", "accept 83.3%", "accept 2", "unmask 3", "route 2", f"events:     {len(t.events)} in 7 steps"):
        assert needle in res.output, needle
    res = runner.invoke(trace_app, ["info", str(hand), "--json"])
    d = json.loads(res.output)
    assert d["events"]["by_kind"]["forward"] == 7 and d["footer"]["tpf"] == t.footer["tpf"]
    assert d["footer_mismatch"] == [] and d["metrics"]["mean_acceptance_length"] == 3.5
    for fmt, suffix in (("parquet", ".parquet"), ("perfetto", ".perfetto.json"), ("html", ".html"), ("csv", ".csv")):
        res = runner.invoke(trace_app, ["export", str(hand), "--format", fmt])
        assert res.exit_code == 0, res.output
        assert res.output.strip() == str(hand.with_name("hand" + suffix))
        assert hand.with_name("hand" + suffix).stat().st_size > 0
    out = tmp_path / "sub.parquet"
    res = runner.invoke(trace_app, ["export", str(hand), "-f", "parquet", "-o", str(out)])
    assert res.exit_code == 0 and read_parquet_events(out) == t.events
    res = runner.invoke(trace_app, ["export", str(hand), "-f", "csv", "-o", str(hand)])
    assert isinstance(res.exception, BadInput)  # never overwrite the trace itself
    res = runner.invoke(trace_app, ["export", str(hand), "-f", "xml"])
    assert res.exit_code == 2  # click usage error
    res = runner.invoke(trace_app, ["replay", str(hand), "--speed", "0"])
    assert res.exit_code == 0 and "Banana" in res.output


def test_cli_allow_truncated(tmp_path):
    """Truncated traces are read by default (a one-line warning on stderr); --allow-truncated is a no-op."""
    runner = CliRunner()
    trunc = write_trace(tmp_path / "t.jsonl", hand_events(), footer=False)
    res = runner.invoke(trace_app, ["info", str(trunc)])
    assert res.exit_code == 0 and "TRUNCATED" in res.stdout and "truncated trace" in res.stderr
    res = runner.invoke(trace_app, ["info", str(trunc), "--allow-truncated"])
    assert res.exit_code == 0 and "TRUNCATED" in res.output
    res = runner.invoke(trace_app, ["export", str(trunc), "-f", "parquet"])
    assert res.exit_code == 0
    assert read_parquet(tmp_path / "t.parquet")[0].footer is None


def test_footer_metrics_roundtrip_all_formats(tmp_path):
    """export -> read back (parquet) -> summarize == the footer's tpf / accept_rate / n_tokens / forwards."""
    for src in REAL:
        t = read_trace(src)
        back = read_parquet_events(export(src, "parquet", tmp_path / (src.stem + ".parquet")))
        m = summarize(back)
        assert {k: m[k] for k in ("tpf", "accept_rate", "n_tokens", "forwards")} == \
               {k: t.footer[k] for k in ("tpf", "accept_rate", "n_tokens", "forwards")}
        assert m["text"] == t.footer["text"]
        assert not any(isinstance(v, float) and math.isnan(v) for e in back for v in e.values())


# -- real traces from every registered strategy (tiny engine), and the real `dlm-studio` entry point -------
def _strategy_names():
    from studio.engine.strategies import STRATEGIES
    # jacobi-mr through its CPU preset: its default blocks do not fit the tiny model's 128-token context; gemma-canvas
    # decodes DiffusionGemma only (its trace: tests/strategies/test_gemma_canvas.py)
    return [s if s != "jacobi-mr" else "jacobi-mr-cpu" for s in STRATEGIES if s != "gemma-canvas"]


@pytest.fixture(scope="module")
def strategy_traces(tmp_path_factory):
    """One real trace per registered strategy: greedy on a tiny engine, written by `run_to_end`."""
    import torch

    from studio.run.config import RunConfig
    from studio.run.compare import compare_configs, run_compare
    from studio.run.session import encode_prompt
    from tests.support.tiny import tiny_dlm

    d = tmp_path_factory.mktemp("strategy_traces")
    engine = tiny_dlm("llama", shift=True, block=4, vocab=16)   # a block dLLM: canvas decodes it too
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        configs = compare_configs(",".join(_strategy_names()), RunConfig(max_new_tokens=12, temperature=0.0))
        run_compare(engine, "abcab", encode_prompt(engine, "abcab"), configs, trace_dir=d)
    finally:
        torch.set_num_threads(old)
    return {name: d / f"{name}.jsonl" for name in _strategy_names()}


_STRING_FIELDS = {"t", "role", "src", "op", "policy", "text", "run_id", "strategy"}


def _events_from_csv(path: Path) -> list[dict]:
    """Read an exported CSV back into events (empty cell = absent; string fields as-is; the rest JSON)."""
    out = []
    for row in csv.DictReader(path.open(encoding="utf-8")):
        e = {}
        for k, v in row.items():
            if k in ("run_id", "strategy", "extra"):
                continue
            if v == "" and not (k == "text" and row["t"] == "emit"):
                continue
            e[k] = v if k in _STRING_FIELDS else json.loads(v)
        out.append(e)
    return out


def test_every_format_from_every_strategy_roundtrips_metrics(tmp_path, strategy_traces):
    """Parquet (one row per event), CSV and Perfetto exports of a real trace of each strategy read back to
    the footer's numbers; the Perfetto file is valid JSON with a forward slice per forward; HTML exists."""
    import pyarrow.parquet as pq

    for name, src in strategy_traces.items():
        t = read_trace(src)
        want = {k: t.footer[k] for k in METRICS}
        pq_out = export(src, "parquet", tmp_path / f"{name}.parquet")
        assert pq.read_table(pq_out).num_rows == len(t.events)
        back = read_parquet_events(pq_out)
        assert back == t.events
        assert {k: summarize(back)[k] for k in METRICS} == want, name
        csv_out = export(src, "csv", tmp_path / f"{name}.csv")
        from_csv = _events_from_csv(csv_out)
        assert len(from_csv) == len(t.events) and [e["t"] for e in from_csv] == [e["t"] for e in t.events]
        assert {k: summarize(from_csv)[k] for k in METRICS} == want, name
        doc = json.loads(export(src, "perfetto", tmp_path / f"{name}.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"{name}: {c} in the Perfetto JSON"))
        te = doc["traceEvents"]
        assert len([x for x in te if x["ph"] == "X"]) == len([e for e in t.events if e["t"] == "forward"])
        assert doc["metadata"]["footer"] == t.footer
        tpf = [x["args"]["TPF"] for x in te if x["name"] == "TPF (running)"]
        assert tpf and tpf[-1] == pytest.approx(t.footer["tpf"], abs=1e-6)  # counters keep 6 decimals
        html_out = export(src, "html", tmp_path / f"{name}.html")
        assert t.header["run_id"] in html_out.read_text(encoding="utf-8")


def test_an_html_report_is_light(tmp_path):
    """A report of a ~128-token run weighs well under a megabyte (plotly.js inlined made it ~6 MB) and its
    trajectory keeps a hover text per cell."""
    from studio.run.config import RunConfig
    from studio.run.session import encode_prompt, run_to_end
    from tests.support.tiny import tiny_engine

    engine = tiny_engine("llama", vocab=16)
    for name, n in (("ar", 124), ("isd", 100)):
        strategy, settings = RunConfig(name, max_new_tokens=n, temperature=0.0).build()
        trace = tmp_path / f"{name}.jsonl"
        run_to_end(engine, strategy, settings, "abc", encode_prompt(engine, "abc"), trace_path=str(trace))
        doc = export(trace, "html", tmp_path / f"{name}.html").read_text(encoding="utf-8")
        assert len(doc.encode()) < 1_000_000, (name, len(doc))
        cells = re.findall(r"<title>step \d+ · position \d+", doc)
        assert len(cells) >= n, name   # every emitted position has a cell to hover


def test_trace_info_says_n_a_where_the_run_had_none(strategy_traces):
    """A canvas run verifies nothing and has no prefill: `trace info` says n/a for both, as the TUI and the web do,
    where it printed an acceptance of 0.0 % and a prefill of 0.000 s; a run that had them still shows numbers."""
    runner = CliRunner()
    canvas = runner.invoke(trace_app, ["info", str(strategy_traces["canvas"])]).output
    assert "accept n/a" in canvas and "prefill n/a" in canvas
    isd = runner.invoke(trace_app, ["info", str(strategy_traces["isd"])]).output
    assert "accept n/a" not in isd and "prefill n/a" not in isd and re.search(r"prefill \d+\.\d{3} s", isd)
    replayed = runner.invoke(trace_app, ["replay", str(strategy_traces["canvas"]), "--speed", "0"]).output
    assert "accept n/a" in replayed and "· not written yet" in replayed   # its legend names every glyph it draws


def test_replay_a_trace_of_every_strategy_without_a_model(strategy_traces):
    """`dlm-studio trace replay` through the real entry point, on each strategy's trace; the process never
    imports torch (so no model can have been loaded) and ends with the footer's text."""
    import subprocess
    import sys

    code = ("import sys\nfrom studio.cli import main\nsys.argv = ['dlm-studio', 'trace', 'replay', sys.argv[1], "
            "'--speed', '0']\ntry:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('TORCH-LOADED' if 'torch' in sys.modules else 'NO-TORCH')\n")
    for name, src in strategy_traces.items():
        t = read_trace(src)
        r = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parents[2])
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert r.stdout.strip().endswith("NO-TORCH"), (name, r.stdout[-500:])
        n_steps = len({e["step"] for e in t.events})
        assert f"{n_steps} steps" in r.stdout and f"\n{n_steps - 1:>4} " in r.stdout   # a grid row per step
        done = f"done · {t.footer['stop_reason']} · {t.footer['n_tokens']} tokens · {t.footer['forwards']} forwards"
        assert done in r.stdout, (name, r.stdout[-400:])
        assert t.footer["text"] in r.stdout, name


@pytest.mark.parametrize("cmd", [["info"], ["info", "--json"], ["export", "-f", "parquet"],
                                 ["export", "-f", "perfetto"], ["export", "-f", "csv"], ["export", "-f", "html"],
                                 ["replay", "--speed", "0"]])
def test_every_trace_command_bad_traces_exit_2_via_main(tmp_path, monkeypatch, capsys, cmd):
    """studio.cli.main itself (what `dlm-studio` runs): exit 2 and exactly one line on stderr, no traceback."""
    from studio.cli import main

    for name, path in _bad_traces(tmp_path).items():
        if name == "truncated":   # not bad: read with a warning (test_trace_commands_bad_trace_exit_2_subprocess)
            continue
        monkeypatch.setattr("sys.argv", ["dlm-studio", "trace", cmd[0], str(path), *cmd[1:]])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        assert e.value.code == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dlm-studio: error: "), (name, err)
        assert "Traceback" not in err
        assert not list(tmp_path.glob("*.parquet")) + list(tmp_path.glob("*.csv")) + list(tmp_path.glob("*.html"))


def test_trace_commands_bad_trace_exit_2_subprocess(tmp_path):
    """The installed command line, once per command, on a malformed trace (exit 2) and on a truncated one
    (read, with a one-line warning)."""
    import subprocess
    import sys

    bad = _bad_traces(tmp_path)
    for cmd in (["info"], ["export", "-f", "csv"], ["replay", "--speed", "0"]):
        for name, rc, needle in (("malformed", 2, "dlm-studio: error: "), ("truncated", 0, "dlm-studio: warning: ")):
            r = subprocess.run([sys.executable, "-m", "studio", "trace", cmd[0], str(bad[name]), *cmd[1:]],
                               capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
            assert r.returncode == rc and r.stderr.count("\n") == 1 and needle in r.stderr, (cmd, r.stderr)


def test_diagnostics_slot_numbers_match_the_figure():
    """The drop-off note numbers draft slots from 1 like the acceptance-by-position figure, and ignores
    slots verified fewer than 5 times."""
    from studio.viz.stats import acceptance, diagnostics

    def run(chains):
        E = [ev.forward(0, 1.0, role="prefill", n_tokens=4, lora_rows=0, wall_ms=1.0)]
        for step, (acc, rej) in enumerate(chains, 1):
            E.append(ev.forward(step, step + 1.0, role="verify", n_tokens=4, lora_rows=0, wall_ms=1.0))
            if acc:
                E.append(ev.accept(step, step + 1.1, pos=list(range(acc)), tok=[5] * acc, p=[0.9] * acc,
                                   q=[1.0] * acc))
            if rej is not None:
                E.append(ev.reject(step, step + 1.2, pos=rej, tok=6, p=0.1, q=1.0))
        return E
    # slot 1: 9 of 11 accepted; slot 2: 2 of 9; slot 3: verified once (accepted): too few to count
    E = run([(2, None)] + [(1, 1)] * 7 + [(3, None)] + [(0, 0)] * 2)
    acc = acceptance(E)
    assert acc.verified_by_pos == [11, 9, 1] and acc.by_pos[2] == 1.0
    notes = [n for n in diagnostics(E, "isd") if "falls off" in n]
    assert notes == ["Acceptance falls off by draft slot: 82% at slot 1, 22% at slot 2."]

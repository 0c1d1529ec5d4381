"""`dlm-studio compare` and the demo (`make run`) on tiny random models: the --json contract, agreement with
ar, traces, the self-contained HTML report. The CLI runs in-process with `Engine.load` swapped for a tiny engine."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from studio.cli import app
from studio.run.config import build_run
from studio.run.compare import RunSpec, first_difference, parse_specs, render_table, rows, run_compare
from studio.engine.engine import Engine
from studio.engine.strategies import STRATEGIES
from studio.errors import BadInput
from studio.events import read_trace
from studio.run.session import Session, encode_prompt
from tests.support.tiny import tiny_engine

PROMPT = "abcab"                                     # TinyTokenizer: letters a.. are token ids 0..
LOSSLESS = ["isd", "r-isd", "jacobi", "jacobi-mr-cpu"]  # greedy output == greedy ar, token for token
ROW_KEYS = {"label", "strategy", "params", "n_tokens", "token_ids", "forwards", "tpf", "accept_rate", "tok_s",
            "speed_vs_ar", "identical_to_ar", "first_difference", "stop_reason", "text"}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", vocab=16)


@pytest.fixture
def cli(engine, monkeypatch):
    """Invoke `dlm-studio ...` in-process on the tiny engine; returns the click Result."""
    loads = []

    def load(spec, adapter=None, **kw):
        loads.append(spec)
        return engine
    monkeypatch.setattr(Engine, "load", staticmethod(load))
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(app, list(args), catch_exceptions=True)
    invoke.loads = loads
    return invoke


def _ar_tokens(engine, n, prompt=PROMPT, temperature=0.0, seed=0):
    strat, settings = build_run("ar", None, [], n, temperature, None, None, seed, [])
    return Session(engine, strat, settings).run(prompt, encode_prompt(engine, prompt)).token_ids


def _compare_json(cli, *args):
    res = cli("compare", PROMPT, *args, "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)


# -- parsing the run list ----------------------------------------------------------------------------
def test_parse_specs_adds_ar_first_and_rejects_bad_lists():
    assert [s.label for s in parse_specs("isd,jacobi")] == ["ar", "isd", "jacobi"]
    assert [s.label for s in parse_specs("isd,ar,jacobi")] == ["ar", "isd", "jacobi"]  # ar moved to the front
    specs = parse_specs("isd", preset="jacobi-mr-cpu")
    assert specs[-1] == RunSpec("jacobi-mr-cpu", None, "jacobi-mr-cpu")
    with pytest.raises(BadInput, match="beam"):
        parse_specs("ar,beam")
    with pytest.raises(BadInput, match="twice"):
        parse_specs("isd,isd")


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2          # a prefix differs where the shorter one ends
    assert first_difference([], [4]) == 0


# -- compare --json ----------------------------------------------------------------------------------
def test_compare_json_fields_and_metrics(cli, engine):
    out = _compare_json(cli, "-s", "isd,jacobi", "--max-new-tokens", "12")
    assert cli.loads == ["default"]
    assert [r["label"] for r in out] == ["ar", "isd", "jacobi"]       # ar added, and first
    ar = out[0]
    assert ar["token_ids"] == _ar_tokens(engine, 12)                  # the baseline really is greedy ar
    for r in out:
        assert set(r) >= ROW_KEYS, set(ROW_KEYS) - set(r)
        assert r["strategy"] == r["label"] and r["params"]["temperature"] == 0.0
        assert r["n_tokens"] == len(r["token_ids"]) == 12 and r["stop_reason"] == "max_new_tokens"
        assert r["text"] == "".join(chr(97 + t) for t in r["token_ids"])
        assert r["tpf"] == pytest.approx(r["n_tokens"] / r["forwards"])
        assert r["tok_s"] > 0
        assert r["speed_vs_ar"] == pytest.approx(r["tok_s"] / ar["tok_s"])
        assert r["identical_to_ar"] is True and r["first_difference"] is None  # greedy, lossless
    assert ar["accept_rate"] is None and ar["forwards"] == 11           # ar verifies nothing; prefill gives token 0
    isd = out[1]
    assert 0.0 <= isd["accept_rate"] <= 1.0
    assert isd["forwards"] < ar["forwards"]                          # the tiny model accepts some MASK proposals


@pytest.mark.parametrize("strategy", LOSSLESS)
def test_greedy_lossless_strategies_identical_to_ar(cli, engine, strategy):
    out = _compare_json(cli, "-s", strategy, "--max-new-tokens", "10")
    ar, other = out
    assert other["token_ids"] == ar["token_ids"] == _ar_tokens(engine, 10)
    assert other["identical_to_ar"] and other["first_difference"] is None


def test_every_registered_strategy_runs_in_compare(cli):
    """Grows with the registry: every strategy runs (jacobi-mr through its CPU preset: its default blocks
    do not fit the tiny model's 128-token context); the row numbers are consistent with the tokens."""
    names = [s if s != "jacobi-mr" else "jacobi-mr-cpu" for s in STRATEGIES]
    out = _compare_json(cli, "-s", ",".join(names), "--max-new-tokens", "8")
    assert [r["label"] for r in out] == names
    ar = out[0]["token_ids"]
    for r in out:
        assert r["n_tokens"] == len(r["token_ids"]) == 8
        k = first_difference(ar, r["token_ids"])
        assert r["first_difference"] == k and r["identical_to_ar"] == (k is None)


def test_differing_run_reports_first_differing_position(engine):
    """A run that differs from ar on purpose: sampled at a high temperature, and a shorter run (a prefix)."""
    ids = encode_prompt(engine, PROMPT)
    settings = {"ar": ("ar", 12, 0.0), "hot": ("ar", 12, 3.0), "short": ("ar", 5, 0.0)}

    def make_run(spec):
        name, n, temp = settings[spec.label]
        return build_run(name, None, [], n, temp, None, None, 1, [])
    specs = [RunSpec(label, "ar", None) for label in settings]
    results = run_compare(engine, PROMPT, ids, specs, make_run)
    table = {r["label"]: r for r in rows(results)}
    base, hot = results["ar"].token_ids, results["hot"].token_ids
    k = next(i for i, (a, b) in enumerate(zip(base, hot)) if a != b)  # raises if they never differ
    assert base[:k] == hot[:k] and base[k] != hot[k]
    assert table["hot"]["first_difference"] == k and table["hot"]["identical_to_ar"] is False
    assert table["short"]["token_ids"] == base[:5]
    assert table["short"]["first_difference"] == 5 and table["short"]["identical_to_ar"] is False
    assert table["ar"]["first_difference"] is None and table["ar"]["speed_vs_ar"] == 1.0
    from rich.console import Console
    con = Console(width=140, record=True)
    con.print(render_table(list(table.values()), sampled=True))
    text = con.export_text()
    assert f"no (token {k})" in text and "no (token 5)" in text and "in distribution" in text


def test_compare_cli_table_and_bad_input(cli):
    res = cli("compare", PROMPT, "-s", "isd", "--max-new-tokens", "6")
    assert res.exit_code == 0, res.output
    assert re.search(r"│ isd\s+│\s+6 │", res.stdout) and "same as ar" in res.stdout
    assert "── isd: " in res.stdout
    res = cli("compare", PROMPT, "-s", "isd,nope")
    assert isinstance(res.exception, BadInput) and "nope" in str(res.exception)
    assert cli.loads == ["default"]  # the bad list was refused before loading any model


# -- traces and the HTML report -----------------------------------------------------------------------
def test_trace_dir_one_readable_trace_per_run(cli, tmp_path):
    d = tmp_path / "traces"
    out = _compare_json(cli, "-s", "isd,jacobi-mr-cpu", "--max-new-tokens", "10", "--trace-dir", str(d))
    assert sorted(p.name for p in d.iterdir()) == sorted(f"{r['label']}.jsonl" for r in out)
    for r in out:
        t = read_trace(d / f"{r['label']}.jsonl")
        assert t.header["strategy"] == r["strategy"] and t.header["prompt"]["text"] == PROMPT
        assert [tok for e in t.events if e["t"] == "emit" for tok in e["tok"]] == r["token_ids"]
        for k in ("n_tokens", "forwards", "tpf", "tok_s", "stop_reason", "text"):
            assert t.footer[k] == r[k], k


def test_html_report_self_contained(cli, tmp_path):
    html = tmp_path / "r.html"
    out = _compare_json(cli, "-s", "isd,jacobi", "--max-new-tokens", "8", "--html", str(html))
    doc = html.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\bsrc\s*=\s*[\"']?https?:", doc)   # nothing fetched from the network
    assert not re.search(r"<script[^>]*\bsrc=", doc)                       # no external script at all
    assert doc.count("window.PlotlyConfig") == 1 and len(doc) > 1_000_000  # plotly.js inlined, once
    assert "<h1>compare: abcab</h1>" in doc and "speed vs ar" in doc
    assert doc.count("not saved as a trace file") == len(out)   # no --trace-dir: no run ids to show
    for r in out:
        assert f"<h2>{r['label']}</h2>" in doc
        assert f"{r['tpf']:.3f}" in doc


# -- the demo (make run) ------------------------------------------------------------------------------
def test_demo_every_strategy_cpu_presets_traces_and_report(cli, tmp_path):
    from studio.run.demo import default_specs
    specs = default_specs()
    assert [s.strategy or s.preset for s in specs][0] == "ar"
    expected = [f"{n}-cpu" if n in ("jacobi-mr", "s2d2", "simsd") else n for n in STRATEGIES]
    assert [s.label for s in specs] == expected                         # every registered strategy, CPU-sized
    d = tmp_path / "tr"
    res = cli("demo", "--prompt", PROMPT, "--max-new-tokens", "8", "--trace-dir", str(d))
    assert res.exit_code == 0, (res.output, res.exception)
    assert cli.loads == ["default"]
    traces = sorted(d.glob("demo-*.jsonl"))
    assert sorted(p.name for p in traces) == sorted(f"demo-{lab}.jsonl" for lab in expected)
    for p in traces:
        t = read_trace(p)
        assert t.header["params"]["temperature"] == 0.0 and t.footer["n_tokens"] == 8
    report = d / "demo-report.html"
    doc = report.read_text(encoding="utf-8")
    assert all(f"<h2>{lab}</h2>" in doc for lab in expected)            # labelled as in the table
    assert all(read_trace(p).header["run_id"] in doc for p in traces)   # built from the trace files
    for lab in expected:
        assert re.search(rf"│ {re.escape(lab)}\s+│\s+8 │", res.stdout), lab
        assert str(d / f"demo-{lab}.jsonl") in res.stdout
    assert f"report: {report}" in res.stdout
    toks = {lab: [t for e in read_trace(d / f"demo-{lab}.jsonl").events if e["t"] == "emit" for t in e["tok"]]
            for lab in expected}
    same = [lab for lab in expected if toks[lab] == toks["ar"]]
    assert f"── {', '.join(same)} (identical output):" in res.stdout
    for lab in set(expected) - set(same):
        assert f"── {lab} (differs from ar at token {first_difference(toks['ar'], toks[lab])}):" in res.stdout
    jmr = read_trace(d / "demo-jacobi-mr-cpu.jsonl")
    assert jmr.header["strategy"] == "jacobi-mr" and jmr.header["params"]["block_size"] == 8  # the CPU preset


def test_demo_explicit_strategies_and_bad_list(cli, tmp_path):
    res = cli("demo", "--prompt", PROMPT, "-s", "isd", "--max-new-tokens", "4", "--trace-dir", str(tmp_path),
              "--no-html")
    assert res.exit_code == 0, (res.output, res.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-ar.jsonl", "demo-isd.jsonl"]
    res = cli("demo", "-s", "isd,warp")
    assert isinstance(res.exception, BadInput) and "warp" in str(res.exception)


def test_table_keeps_long_labels_on_80_columns(engine):
    from rich.console import Console
    ids = encode_prompt(engine, PROMPT)
    specs = parse_specs("jacobi-mr-cpu")
    results = run_compare(engine, PROMPT, ids, specs,
                          lambda s: build_run(s.strategy, s.preset, [], 4, 0.0, None, None, 0, []))
    con = Console(width=80, record=True)
    con.print(render_table(rows(results), sampled=False))
    assert "│ jacobi-mr-cpu │" in con.export_text()

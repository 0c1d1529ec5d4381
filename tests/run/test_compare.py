"""`dlm-studio compare` and the demo (`make run`) on tiny random models: the --json contract, agreement with
ar and with each run's reference (ar on the model it decodes), traces, the self-contained HTML report. The CLI runs in-process with `Engine.load` swapped for a tiny engine."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
from typer.testing import CliRunner

from studio.cli import app
from studio.run.config import RunConfig
from studio.run.compare import (agreement, compare_configs, first_difference, make_runs, render_table, rows,
                                run_compare, same_as, settings_text, trace_path)
from studio.engine.engine import Engine
from studio.engine.lora import attach_adapter
from studio.engine.strategies import STRATEGIES
from studio.errors import BadInput
from studio.events import read_trace
from studio.presets import shipped
from studio.run.session import CANCELLED, drive, encode_prompt, run_to_end
from tests.support.lora import random_adapter
from tests.support.tiny import tiny_engine

PROMPT = "abcab"                                     # TinyTokenizer: letters a.. are token ids 0..
LOSSLESS = ["isd", "r-isd", "jacobi", "jacobi-mr-cpu"]  # greedy output == greedy ar, token for token
ROW_KEYS = {"label", "strategy", "params", "n_tokens", "token_ids", "forwards", "tpf", "accept_rate", "tok_s",
            "speed_vs_ar", "identical_to_ar", "first_difference", "reference", "identical_to_reference",
            "reference_first_difference", "identical_so_far", "compared_tokens", "stop_reason", "text"}


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
    strat, settings = RunConfig("ar", max_new_tokens=n, temperature=temperature, seed=seed).build()
    return run_to_end(engine, strat, settings, prompt, encode_prompt(engine, prompt)).token_ids


def _compare_json(cli, *args):
    res = cli("compare", PROMPT, *args, "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)


# -- parsing the run list ----------------------------------------------------------------------------
def test_compare_configs_put_ar_first_on_the_shared_settings_and_reject_bad_lists():
    assert list(compare_configs("isd,jacobi")) == ["ar", "isd", "jacobi"]
    assert list(compare_configs("isd,ar,jacobi")) == ["ar", "isd", "jacobi"]  # ar moved to the front
    base = RunConfig("r-isd", params={"stride": 3}, temperature=0.7, max_new_tokens=9, seed=5, stop=("x",))
    configs = compare_configs("isd,jacobi-mr-cpu", base)
    assert configs["jacobi-mr-cpu"] == RunConfig(None, "jacobi-mr-cpu", {}, 0.7, None, None, 9, 5, ("x",))
    assert configs["ar"].strategy == "ar" and configs["isd"].params == {}   # a strategy's own defaults
    with pytest.raises(BadInput, match="beam"):
        compare_configs("ar,beam")
    with pytest.raises(BadInput, match="twice"):
        compare_configs("isd,isd")
    for nothing in ("", "ar", " , ar"):   # ar alone compares nothing
        with pytest.raises(BadInput, match="nothing to compare"):
            compare_configs(nothing)
    assert list(compare_configs(" , ar", ar_alone=True)) == ["ar"]   # a bench of ar alone (against transformers)
    with pytest.raises(BadInput, match="nothing to compare"):
        compare_configs("", ar_alone=True)


def test_make_runs_refuses_more_runs_than_a_view_shows_before_any_trace_is_opened(engine, tmp_path):
    configs = compare_configs("isd,jacobi,r-isd", RunConfig(max_new_tokens=4, temperature=0.0))
    ids = encode_prompt(engine, PROMPT)
    with pytest.raises(BadInput, match="at most 3 runs"):
        make_runs(engine, PROMPT, ids, configs, trace_dir=tmp_path, most=3)
    assert not list(tmp_path.iterdir())
    assert list(make_runs(engine, PROMPT, ids, configs, most=4)) == ["ar", "isd", "jacobi", "r-isd"]


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
        assert r["reference"] == "ar" and r["identical_to_reference"] is True   # no adapter: ar is every reference
        assert r["identical_so_far"] is False and r["compared_tokens"] == 12 and same_as(r) == "yes (ar)"
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
    names = [s if s != "jacobi-mr" else "jacobi-mr-cpu" for s, cls in STRATEGIES.items() if cls.decodes_ar_models]
    out = _compare_json(cli, "-s", ",".join(names), "--max-new-tokens", "8")
    assert [r["label"] for r in out] == names
    ar = out[0]["token_ids"]
    for r in out:
        assert r["n_tokens"] == len(r["token_ids"]) == 8
        k = first_difference(ar, r["token_ids"])
        assert r["first_difference"] == k and r["identical_to_ar"] == (k is None)


def test_differing_run_reports_first_differing_position(engine):
    """A run that differs from ar on purpose (sampled at a high temperature: both produce 12 tokens, they differ
    at k < 12), and a shorter run (a lower token limit: the same tokens as far as it went)."""
    ids = encode_prompt(engine, PROMPT)
    settings = {"ar": ("ar", 12, 0.0), "hot": ("ar", 12, 3.0), "short": ("ar", 5, 0.0)}

    configs = {label: RunConfig(name, max_new_tokens=n, temperature=temp, seed=1)
               for label, (name, n, temp) in settings.items()}
    results = run_compare(engine, PROMPT, ids, configs)
    table = {r["label"]: r for r in rows(results)}
    base, hot = results["ar"].token_ids, results["hot"].token_ids
    k = next(i for i, (a, b) in enumerate(zip(base, hot)) if a != b)  # raises if they never differ
    assert base[:k] == hot[:k] and base[k] != hot[k]
    assert table["hot"]["first_difference"] == k and table["hot"]["identical_to_ar"] is False
    assert table["hot"]["reference_first_difference"] == k and table["hot"]["compared_tokens"] == 12
    assert table["hot"]["identical_so_far"] is False
    short = table["short"]
    assert short["token_ids"] == base[:5] and short["stop_reason"] == "max_new_tokens"
    assert short["first_difference"] is None and short["identical_to_ar"] is True   # cut short, not different
    assert short["identical_so_far"] is True and short["compared_tokens"] == 5
    assert table["ar"]["first_difference"] is None and table["ar"]["speed_vs_ar"] == 1.0
    assert table["ar"]["identical_so_far"] is False   # ar against itself
    from rich.console import Console
    con = Console(width=140, record=True)
    con.print(render_table(list(table.values()), sampled=True))
    text = con.export_text()
    assert f"no at token {k} (ar)" in text and "yes so far (ar, 5 tokens)" in text and "in distribution" in text


def test_a_cancelled_run_that_matched_so_far_is_not_a_difference(engine):
    """Every run cancelled mid-way (Esc in a front end): isd produced fewer tokens than ar or more, and
    matches it on the tokens both produced."""
    ids = encode_prompt(engine, PROMPT)
    runs = make_runs(engine, PROMPT, ids, _greedy("isd,jacobi", 12))
    steps = []

    def cancel_all_after_four_steps(i, events):
        steps.append(i)
        if len(steps) == 4:
            for run in runs.values():
                run.cancel()
    drive(list(runs.values()), cancel_all_after_four_steps)
    results = {label: run.result for label, run in runs.items()}
    assert all(r.footer["stop_reason"] == CANCELLED for r in results.values())
    assert 0 < len(results["ar"].token_ids) < 12
    for r in rows(results)[1:]:
        n = min(len(r["token_ids"]), len(results["ar"].token_ids))
        assert r["identical_to_reference"] is True and r["reference_first_difference"] is None
        assert r["identical_so_far"] is True and r["compared_tokens"] == n
        assert same_as(r) == f"yes so far (ar, {n} tokens)"


def test_a_run_that_ended_on_its_own_before_the_other_differs_where_it_ended(engine):
    """A stop string ends one run early; the other went on: that is a difference (at the end of the shorter),
    not "so far", whichever of the two is the reference."""
    ids = encode_prompt(engine, PROMPT)
    full = run_compare(engine, PROMPT, ids, {"ar": RunConfig("ar", max_new_tokens=12, temperature=0.0)})["ar"]
    stop_at = next(i for i, t in enumerate(full.token_ids) if i > 0 and t not in full.token_ids[:i])
    stopped = run_compare(engine, PROMPT, ids, {"ar": RunConfig("ar", max_new_tokens=12, temperature=0.0,
                                                              stop=(chr(97 + full.token_ids[stop_at]),))})["ar"]
    assert stopped.footer["stop_reason"] == "stop_string" and stopped.token_ids == full.token_ids[:stop_at + 1]
    for ref, run in ((full, stopped), (stopped, full)):
        a = agreement(ref, run)
        assert (a.difference, a.compared, a.so_far) == (stop_at + 1, stop_at + 1, False)
    assert agreement(full, full).difference is None and not agreement(full, full).so_far


def test_settings_text_names_what_a_run_used(engine):
    ids = encode_prompt(engine, PROMPT)
    config = RunConfig("ar", max_new_tokens=3, temperature=0.5, top_k=4, top_p=0.9, seed=7)
    result = run_compare(engine, PROMPT, ids, {"ar": config})["ar"]
    assert settings_text(result.header) == "temperature 0.5 · top-k 4 · top-p 0.9 · seed 7 · max tokens 3"


def test_compare_cli_table_and_bad_input(cli):
    res = cli("compare", PROMPT, "-s", "isd", "--max-new-tokens", "6")
    assert res.exit_code == 0, res.output
    assert re.search(r"│ isd\s+│\s+6 │.*│ yes \(ar\)\s+│", res.stdout) and "same as" in res.stdout
    assert "── isd: " in res.stdout
    res = cli("compare", PROMPT, "-s", "isd,nope")
    assert isinstance(res.exception, BadInput) and "nope" in str(res.exception)
    assert cli.loads == ["default"]  # the bad list was refused before loading any model


# -- references: each run against ar on the model it decodes ------------------------------------------
def _greedy(items: str, n: int):
    return compare_configs(items, RunConfig(max_new_tokens=n, temperature=0.0))


@pytest.fixture
def shipped_engine(tmp_path, monkeypatch):
    """A tiny engine of its own and a presets/adapters stand-in for it: `every` (an adapter of every row) shipped
    for isd, `masked` (MASK rows only) for r-isd."""
    engine = tiny_engine("llama", vocab=16, seed=4)
    for name, rows_, strategy in (("every", "all", "isd"), ("masked", "mask", "r-isd")):
        path = random_adapter(tmp_path / "adapters" / name, engine.model, seed=1, adapted_rows=rows_)
        (path / "studio.toml").write_text(f'model = "tiny-llama"\nstrategies = ["{strategy}"]\n')
    monkeypatch.setattr(shipped, "ADAPTERS_DIR", tmp_path / "adapters")
    shipped._entries.cache_clear()
    yield engine
    shipped._entries.cache_clear()


def test_each_run_is_compared_with_ar_on_the_model_it_decodes(shipped_engine, tmp_path):
    """isd decodes `every`'s model: its reference is an extra ar run on that adapter, placed before it; r-isd
    (whatever its adapter) and jacobi decode the base model: their reference is the ar row. The fields defined
    against ar keep their meaning."""
    ids = encode_prompt(shipped_engine, PROMPT)
    results = run_compare(shipped_engine, PROMPT, ids, _greedy("isd,r-isd,jacobi", 12))
    assert list(results) == ["ar", "ar · every", "isd", "r-isd", "jacobi"]
    assert results["ar · every"].header["model"]["adapter"] == str(tmp_path / "adapters" / "every")
    assert results["r-isd"].header["model"]["adapter"] == str(tmp_path / "adapters" / "masked")
    table = {r["label"]: r for r in rows(results)}
    assert {label: r["reference"] for label, r in table.items()} == \
        {"ar": "ar", "ar · every": "ar · every", "isd": "ar · every", "r-isd": "ar", "jacobi": "ar"}
    assert all(r["identical_to_reference"] and r["reference_first_difference"] is None for r in table.values())
    isd = table["isd"]
    k = first_difference(table["ar"]["token_ids"], isd["token_ids"])
    assert k is not None and isd["first_difference"] == k and isd["identical_to_ar"] is False   # another model
    assert isd["speed_vs_ar"] == pytest.approx(isd["tok_s"] / table["ar"]["tok_s"])
    from rich.console import Console
    con = Console(width=160, record=True)
    con.print(render_table(list(table.values()), sampled=False))
    text = con.export_text()
    assert re.search(r"│ isd\s+│.*│ yes \(ar · every\)\s+│", text) and re.search(r"│ r-isd\s+│.*│ yes \(ar\)\s+│", text)
    # a front end that runs the specs only names the reference all the same
    partial = rows({label: results[label] for label in ("ar", "isd")})
    assert partial[1]["reference"] == "ar · every" and partial[1]["identical_to_reference"] is None
    assert same_as(partial[1]) == "— (ar · every did not run)"


def test_when_ar_reads_an_adapter_of_every_row_the_base_model_gets_its_own_reference(tmp_path):
    """`compare --adapter EVERY -s r-isd`: ar decodes the adapter's model and r-isd the base model, so r-isd is
    compared with an extra ar run without the adapter."""
    engine = tiny_engine("llama", vocab=16, seed=4)
    base_ar = _ar_tokens(engine, 12)
    attach_adapter(engine, random_adapter(tmp_path / "every", engine.model, seed=1, adapted_rows="all"))
    ids = encode_prompt(engine, PROMPT)
    results = run_compare(engine, PROMPT, ids, _greedy("r-isd", 12))
    assert list(results) == ["ar", "ar · base", "r-isd"]
    assert results["ar · base"].token_ids == base_ar != results["ar"].token_ids
    r_isd = rows(results)[2]
    assert r_isd["reference"] == "ar · base" and r_isd["identical_to_reference"] is True
    assert r_isd["identical_to_ar"] is False


def test_compare_cli_and_demo_run_and_show_the_references(shipped_engine, monkeypatch, tmp_path):
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: shipped_engine))
    res = CliRunner().invoke(app, ["compare", PROMPT, "-s", "isd", "--max-new-tokens", "8", "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    out = json.loads(res.stdout)
    assert [(r["label"], r["reference"], r["identical_to_reference"]) for r in out] == \
        [("ar", "ar", True), ("ar · every", "ar · every", True), ("isd", "ar · every", True)]
    d = tmp_path / "tr"
    res = CliRunner().invoke(app, ["demo", "--prompt", PROMPT, "-s", "isd,r-isd", "--max-new-tokens", "8",
                                   "--trace-dir", str(d), "--no-html"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert sorted(p.name for p in d.iterdir()) == ["demo-ar-every.jsonl", "demo-ar.jsonl", "demo-isd-fixed.jsonl",
                                                  "demo-isd.jsonl", "demo-r-isd-fixed.jsonl", "demo-r-isd.jsonl"]
    assert "── ar, r-isd, r-isd · fixed (identical output):" in res.stdout
    assert "── ar · every, isd, isd · fixed (identical output):" in res.stdout
    assert read_trace(d / "demo-ar-every.jsonl").header["strategy"] == "ar"


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
    assert "<script" not in doc and len(doc) < 1_000_000   # static SVG figures: light, opens offline
    assert "<h1>compare: abcab</h1>" in doc and "speed vs ar" in doc
    assert doc.count("not saved as a trace file") == len(out)   # no --trace-dir: no run ids to show
    for r in out:
        assert f"<h2>{r['label']}</h2>" in doc
        assert f"{r['tpf']:.3f}" in doc


# -- the demo (make run) ------------------------------------------------------------------------------
def test_demo_every_strategy_cpu_presets_traces_and_report(cli, tmp_path):
    from studio.run.demo import demo_configs
    configs = demo_configs(None, 8, "tiny-llama")   # nothing is shipped for canvas on the tiny model
    runs = [f"{n}-cpu" if n in ("jacobi-mr", "s2d2", "simsd") else n for n, c in STRATEGIES.items()
            if c.decodes_ar_models]
    cost_aware = ("isd", "r-isd", "jacobi", "jacobi-mr-cpu", "dflash", "s2d2-cpu", "simsd-cpu")
    expected = [x for n in runs for x in ([n, f"{n} · fixed"] if n in cost_aware else [n])]
    assert list(configs) == expected and expected[0] == "ar"             # every registered strategy, CPU-sized
    assert all(c.temperature == 0.0 and c.max_new_tokens == 8 and c.seed == 0 for c in configs.values())
    for n in cost_aware:                   # the papers' layout beside the cost-aware run: the same run but drafting
        fixed, auto = configs[f"{n} · fixed"].build()[0].params, configs[n].build()[0].params
        assert (fixed.drafting, getattr(fixed, "lookup", 0), auto.drafting) == ("fixed", 0, "auto")
        same = {"lookup": auto.lookup} if hasattr(auto, "lookup") else {}
        assert dataclasses.replace(fixed, drafting="auto", **same) == auto
    d = tmp_path / "tr"
    res = cli("demo", "--prompt", PROMPT, "--max-new-tokens", "8", "--trace-dir", str(d))
    assert res.exit_code == 0, (res.output, res.exception)
    assert cli.loads == ["default"]
    traces = sorted(d.glob("demo-*.jsonl"))
    assert sorted(p.name for p in traces) == sorted(trace_path(d, lab, "demo-").name for lab in expected)
    for p in traces:
        t = read_trace(p)
        assert t.header["params"]["temperature"] == 0.0 and t.footer["n_tokens"] == 8
    report = d / "demo-report.html"
    doc = report.read_text(encoding="utf-8")
    assert all(f"<h2>{lab}</h2>" in doc for lab in expected)            # labelled as in the table
    assert all(read_trace(p).header["run_id"] in doc for p in traces)   # built from the trace files
    for lab in expected:
        assert re.search(rf"│ {re.escape(lab)}\s+│\s+8 │", res.stdout), lab
        assert str(trace_path(d, lab, "demo-")) in res.stdout
    flat = " ".join(res.stdout.split())   # the table's head and caption wrap at the console's width
    assert "(projected)" in flat and "priced by the h200 table" in flat
    assert "the papers' layout (drafting=fixed, lookup=0)" in flat
    assert f"report: {report}" in res.stdout
    toks = {lab: [t for e in read_trace(trace_path(d, lab, "demo-")).events if e["t"] == "emit" for t in e["tok"]]
            for lab in expected}
    same = [lab for lab in expected if toks[lab] == toks["ar"]]
    assert f"── {', '.join(same)} (identical output):" in flat
    for lab in set(expected) - set(same):
        assert f"── {lab} (differs from ar at token {first_difference(toks['ar'], toks[lab])}):" in flat
    jmr = read_trace(d / "demo-jacobi-mr-cpu.jsonl")
    assert jmr.header["strategy"] == "jacobi-mr" and jmr.header["params"]["block_size"] == 8  # the CPU preset


def test_demo_explicit_strategies_and_bad_list(cli, tmp_path):
    res = cli("demo", "--prompt", PROMPT, "-s", "isd", "--max-new-tokens", "4", "--trace-dir", str(tmp_path),
              "--no-html")
    assert res.exit_code == 0, (res.output, res.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-ar.jsonl", "demo-isd-fixed.jsonl", "demo-isd.jsonl"]
    res = cli("demo", "-s", "isd,warp")
    assert isinstance(res.exception, BadInput) and "warp" in str(res.exception)


def test_table_keeps_long_labels_on_80_columns(engine):
    from rich.console import Console
    ids = encode_prompt(engine, PROMPT)
    results = run_compare(engine, PROMPT, ids, _greedy("jacobi-mr-cpu", 4))
    con = Console(width=80, record=True)
    con.print(render_table(rows(results), sampled=False))
    assert "│ jacobi-mr-cpu │" in con.export_text()


# -- masked-diffusion models: the model's own baseline, the exact reference of a cached run -------------------------
def test_a_model_without_an_ar_mode_is_compared_against_its_one_token_per_step_canvas(monkeypatch):
    """LLaDA-like (bidirectional, position-aligned): no ar; the baseline row is canvas at one token per step with no
    cache, and a cached canvas run is compared with its cache=none twin, which runs beside it."""
    from tests.support.tiny import tiny_mdm
    engine = tiny_mdm(seed=3)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    res = CliRunner().invoke(app, ["compare", PROMPT, "-s", "canvas", "--preset", "fast-dllm-dual",
                                   "--max-new-tokens", "32", "--json"])
    assert res.exit_code == 0, res.output
    table = {r["label"]: r for r in json.loads(res.stdout)}
    assert list(table) == ["canvas", "fast-dllm-dual", "fast-dllm-dual · cache=none"]   # the listed canvas IS it
    dual, twin = table["fast-dllm-dual"], table["fast-dllm-dual · cache=none"]
    assert twin["params"]["cache"] == "none" and twin["params"]["threshold"] == dual["params"]["threshold"]
    assert dual["reference"] == "fast-dllm-dual · cache=none" and twin["reference"] == "canvas"
    assert dual["identical_to_reference"] == (dual["token_ids"] == twin["token_ids"])
    assert table["canvas"]["speed_vs_ar"] == 1.0 and table["canvas"]["params"]["steps"] == 0


def test_fit_baseline_keeps_ar_where_the_model_has_an_ar_mode_and_names_the_canvas_where_not():
    from studio.run.compare import fit_baseline, with_references
    from tests.support.tiny import tiny_mdm
    configs = compare_configs("canvas,fast-dllm-prefix")
    assert list(fit_baseline(tiny_mdm(shift=True), configs)) == ["ar", "canvas", "fast-dllm-prefix"]   # Dream: AR mode
    llada = fit_baseline(tiny_mdm(), compare_configs("fast-dllm-prefix"))
    assert list(llada) == ["canvas · 1 token/step", "fast-dllm-prefix"]
    assert llada["canvas · 1 token/step"].strategy == "canvas" and not llada["canvas · 1 token/step"].params
    listed, refs = with_references(compare_configs("fast-dllm-prefix,canvas"))
    assert list(listed) == ["ar", "fast-dllm-prefix", "fast-dllm-prefix · cache=none", "canvas"]
    assert refs == {"fast-dllm-prefix": "fast-dllm-prefix · cache=none"}
    listed, refs = with_references(compare_configs("fast-dllm-prefix,fast-dllm-dual"))   # one twin for both
    assert list(listed) == ["ar", "fast-dllm-prefix", "fast-dllm-prefix · cache=none", "fast-dllm-dual"]
    assert set(refs.values()) == {"fast-dllm-prefix · cache=none"}

"""Device projections (studio.traces.projection): a trace's forwards priced by another device's cost table, the
shipped H200 table, saved tables, and the projected column of `compare` and `trace project`."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from studio.cli import app
from studio.engine.cost_table import CostTable
from studio.engine.engine import Engine
from studio.errors import BadInput
from studio.events import forward, make
from studio.traces import projection
from studio.traces.projection import DeviceCosts
from tests.support.tiny import tiny_engine

# 1-4 rows at 10, 12, 13, 20 ms; with the LoRA on all rows 11, 14, 16, 24 ms
TABLE = DeviceCosts("synthetic", "made by hand", CostTable({"device": "test"}, 0, (10.0, 12.0, 13.0, 20.0),
                                                           gated_ms=(11.0, 14.0, 16.0, 24.0)))


def _emit(step, n):
    return make("emit", step, 0.0, pos=list(range(n)), tok=[1] * n, text="x" * n)


def test_a_trace_of_known_shapes_is_priced_by_hand():
    events = [forward(0, 0.0, role="prefill", n_tokens=9, lora_rows=0, wall_ms=1.0), _emit(0, 1),   # not priced
              forward(1, 0.0, role="verify", n_tokens=3, lora_rows=0, wall_ms=1.0), _emit(1, 2),    # 13
              forward(2, 0.0, role="extend", n_tokens=1, lora_rows=0, wall_ms=1.0), _emit(2, 1),    # 10
              forward(3, 0.0, role="verify", n_tokens=4, lora_rows=2, wall_ms=1.0), _emit(3, 3),    # 20 + 14 - 12
              forward(4, 0.0, role="verify", n_tokens=6, lora_rows=0, wall_ms=1.0), _emit(4, 2)]    # 20 * 6 / 4
    p = projection.project(events, TABLE)
    assert (p.tokens, p.forwards) == (8, 4)
    assert p.forward_ms == pytest.approx(13 + 10 + 22 + 30)
    assert p.ideal_ar_ms == pytest.approx(8 * 10)
    assert p.vs_steps == pytest.approx(80 / 75)
    ar = projection.project([forward(1, 0.0, role="extend", n_tokens=1, lora_rows=0, wall_ms=1.0), _emit(1, 1),
                             forward(2, 0.0, role="extend", n_tokens=1, lora_rows=0, wall_ms=1.0), _emit(2, 1)],
                            TABLE)
    assert ar.vs_steps == pytest.approx(1.0)
    assert p.vs(ar) == pytest.approx((8 / 75) / (2 / 20))
    assert projection.project([], TABLE).vs_steps is None and projection.project([], TABLE).vs(ar) is None


def test_the_shipped_h200_table_is_what_the_h200_measured_and_says_so():
    h200 = projection.load("h200")
    assert "h200" in projection.names()
    t = h200.table
    assert t.max_rows == 16 and t.plain_ms[0] == pytest.approx(42.6)
    assert [round(t.relative(n), 2) for n in (1, 7, 16)] == [1.00, 1.06, 1.10]
    assert all(a < b for a, b in zip(t.plain_ms, t.plain_ms[1:]))      # interpolated: rising between the points
    assert "interpolated" in h200.origin and "2026-11-26" in h200.origin and "eager" in h200.origin


def test_unknown_names_and_bad_files_are_one_line_errors(tmp_path):
    with pytest.raises(BadInput, match="no device cost table named 'h100': one of .*h200"):
        projection.load("h100")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(BadInput, match="is not a device cost table"):
        projection.load(str(bad))
    with pytest.raises(BadInput, match="cannot read"):
        projection.load(str(tmp_path / "missing.json"))
    with pytest.raises(BadInput, match="plain name"):
        projection.save("../elsewhere", TABLE.table)


def test_a_saved_table_loads_by_name_before_a_shipped_one():
    table = CostTable({"device": "cpu", "model": "m", "dtype": "float32", "torch": "x"}, 64, (2.0, 3.0), threads=2)
    path = projection.save("h200", table)                 # the user's own measurement wins over the shipped one
    assert path.parent == projection.saved_dir()
    got = projection.load("h200")
    assert got.table.plain_ms == (2.0, 3.0) and "cpu measured" in got.origin and "2 threads" in got.origin
    path.unlink()
    assert projection.load("h200").table.max_rows == 16


def test_compare_costs_adds_the_projected_column(monkeypatch):
    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    args = ["compare", "abcab", "-s", "jacobi", "--max-new-tokens", "8", "--costs", "h200"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    rows = json.loads(res.stdout)
    assert rows[0]["label"] == "ar" and rows[0]["projected_vs_ar"] == pytest.approx(1.0)
    assert rows[1]["projected_vs_ar"] is not None and rows[1]["projected_vs_ar"] > 0
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, (res.output, res.exception)
    assert "× ar on h200 (projected)" in res.stdout and "priced by the h200 table" in res.stdout
    res = CliRunner().invoke(app, ["compare", "abcab", "-s", "jacobi", "--costs", "nope"])
    assert isinstance(res.exception, BadInput) and "no device cost table named 'nope'" in str(res.exception)


def test_trace_project_prices_the_traces_compare_wrote(monkeypatch, tmp_path):
    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    res = CliRunner().invoke(app, ["compare", "abcab", "-s", "jacobi", "--max-new-tokens", "8", "--costs", "h200",
                                   "--trace-dir", str(tmp_path), "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    shown = {r["label"]: r["projected_vs_ar"] for r in json.loads(res.stdout)}
    files = [str(tmp_path / "ar.jsonl"), str(tmp_path / "jacobi.jsonl")]
    res = CliRunner().invoke(app, ["trace", "project", *files, "--costs", "h200", "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    got = {d["strategy"]: d for d in map(json.loads, res.stdout.splitlines())}
    assert got["ar"]["vs_ar_trace"] == pytest.approx(1.0) and got["ar"]["costs"] == "h200"
    assert got["jacobi"]["vs_ar_trace"] == pytest.approx(shown["jacobi"])
    assert got["jacobi"]["forwards"] == sum(1 for e in map(json.loads, open(files[1])) if e.get("t") == "forward"
                                            and e["step"] > 0)
    text = CliRunner().invoke(app, ["trace", "project", *files, "--costs", "h200"]).stdout
    assert text.startswith("projected on h200: one NVIDIA H200") and "× the ar trace" in text


def test_models_costs_save_writes_a_table_compare_finds_by_name(monkeypatch):
    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    res = CliRunner().invoke(app, ["models", "costs", "--save", "this-cpu"])
    assert res.exit_code == 0, (res.output, res.exception)
    saved = projection.load("this-cpu")
    assert saved.table.max_rows == 16 and "this-cpu" in projection.names()
    assert saved.table.key["model"] == engine.name and f"{engine.name}, float32" in saved.origin
    (projection.saved_dir() / "this-cpu.json").unlink()


def test_bench_costs_projects_every_prompt_as_its_runs_price(monkeypatch, tmp_path):
    """bench's projected column: per prompt, the strategy's tokens per priced ms over ar's (the same greedy runs
    priced on their own here), the median over prompts; the table and the HTML page name the table's origin."""
    import statistics

    from studio.run.config import RunConfig
    from studio.run.session import encode_prompt, run_to_end

    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    prompts = ["abc", "pon", "hello"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    args = ["bench", "--prompts", str(tmp_path / "p.txt"), "-s", "jacobi", "--repeats", "1", "--warmup", "0",
            "--max-new-tokens", "10", "--no-transformers", "--costs", "h200"]
    res = CliRunner().invoke(app, [*args, "--json", "--html", str(tmp_path / "b.html")])
    assert res.exit_code == 0, (res.output, res.exception)
    report = json.loads(res.stdout)
    assert report["costs"]["name"] == "h200" and "2026-11-26" in report["costs"]["origin"]
    h200 = projection.load("h200")

    def priced(name, prompt):
        strategy, settings = RunConfig(name, max_new_tokens=10, temperature=0.0).build()
        return projection.project(run_to_end(engine, strategy, settings, prompt, encode_prompt(engine, prompt)).events,
                                  h200)
    by_hand = statistics.median(priced("jacobi", p).vs(priced("ar", p)) for p in prompts)
    got = {s["label"]: s["projected_vs_ar"] for s in report["strategies"]}
    assert got["ar"]["median"] == pytest.approx(1.0) and got["jacobi"]["median"] == pytest.approx(by_hand)
    assert "priced by the h200 table" in (tmp_path / "b.html").read_text()
    text = CliRunner().invoke(app, args, env={"COLUMNS": "200"}).stdout
    assert "× ar on h200 (projected)" in text and "priced by the h200 table" in text
    res = CliRunner().invoke(app, [*args[:-2], "--concurrency", "2", "-s", "isd", "--costs", "h200"])
    assert isinstance(res.exception, BadInput) and "not with --concurrency" in str(res.exception)

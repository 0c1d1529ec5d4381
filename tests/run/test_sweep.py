"""`bench --sweep` (studio.run.sweep): the runs a sweep makes, d3LLM's AUP by hand, and the swept bench report with
its curves on a tiny model."""
from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from studio.cli import app
from studio.engine.engine import Engine
from studio.errors import BadInput
from studio.run.compare import compare_configs
from studio.run.config import RunConfig
from studio.run.sweep import aup, expand, parse_sweep
from studio.viz.figures import parallelism_figure
from tests.support.tiny import tiny_engine


def test_aup_is_the_weighted_area_d3llm_defines():
    # y_1 = 80: the floor is 75, so (2.0, 70) and (3.0, 60) are left out; y_max 80
    points = [(2.0, 70.0), (1.0, 80.0), (3.0, 60.0), (1.5, 78.0)]
    w78 = math.exp(-3 * (1 - 78 / 80))
    assert aup(points, y_max=80.0) == pytest.approx(1.0 * 80 + 0.5 * 0.5 * (78 * w78 + 80 * 1.0))
    # no accuracy lost: the plain area under the curve (W = 1 at y_max)
    assert aup([(1.0, 50.0), (3.0, 50.0)], y_max=50.0) == pytest.approx(50 + 0.5 * 2 * (50 + 50))
    # a better run elsewhere on the task discounts every point of this curve
    assert aup([(1.0, 50.0), (3.0, 50.0)], y_max=100.0) == pytest.approx(50 + 2 * 50 * math.exp(-1.5))
    assert aup([(1.2, 40.0)], y_max=90.0) == pytest.approx(48.0) and aup([], 90.0) is None


def test_a_sweep_runs_each_strategy_that_has_the_knob_at_every_value():
    configs = compare_configs("jacobi,isd", RunConfig(temperature=0.0, max_new_tokens=8))
    out, curves = expand(configs, [parse_sweep("block_size=2,4")])
    assert list(out) == ["ar", "jacobi · block_size=2", "jacobi · block_size=4", "isd"]   # isd has no block_size
    assert out["jacobi · block_size=4"].build()[0].params.block_size == 4
    assert curves == {"ar": "ar", "jacobi · block_size=2": "jacobi", "jacobi · block_size=4": "jacobi", "isd": "isd"}
    two, _ = expand(compare_configs("jacobi"), [parse_sweep("block_size=2,4"), parse_sweep("init=context,repeat-last")])
    assert len(two) == 1 + 4 and "jacobi · block_size=4, init=repeat-last" in two
    with pytest.raises(BadInput, match="no listed strategy has that parameter"):
        expand(configs, [parse_sweep("threshold=0.5")])
    with pytest.raises(BadInput, match="expects KEY=V1,V2"):
        parse_sweep("threshold")
    with pytest.raises(BadInput, match="listed twice"):
        parse_sweep("threshold=0.5,0.5")
    with pytest.raises(BadInput):                              # a value the strategy refuses, before anything runs
        expand(configs, [parse_sweep("block_size=0")])


def test_bench_task_sweep_reports_each_setting_its_curve_and_aup(monkeypatch, tmp_path):
    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": p, "answer": "b"}) + "\n" for p in ("abc", "pon", "hello")))
    html = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["bench", "--task", str(task), "-s", "jacobi", "--sweep", "block_size=2,4",
                                   "--repeats", "1", "--warmup", "0", "--max-new-tokens", "6", "--no-transformers",
                                   "--json", "--html", str(html)])
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(res.stdout)
    rows = {r["label"]: r for r in rep["strategies"]}
    assert list(rows) == ["ar", "jacobi · block_size=2", "jacobi · block_size=4"]
    assert [rows[k]["params"]["block_size"] for k in list(rows)[1:]] == [2, 4]
    assert {r["curve"] for r in rows.values()} == {"ar", "jacobi"} and set(rep["aup"]) == {"ar", "jacobi"}
    y_max = 100 * max(r["accuracy"] for r in rows.values())
    jacobi = [(r["tpf"]["median"], 100 * r["accuracy"]) for r in list(rows.values())[1:]]
    assert rep["aup"]["jacobi"] == pytest.approx(aup(jacobi, y_max))
    assert all(r["speedup_vs_ar"] and "accuracy" in r for r in rows.values())
    page = html.read_text()
    assert "Accuracy under parallelism on task" in page and "jacobi (AUP" in page
    curve = next(t for t in parallelism_figure(rep).data if t.name.startswith("jacobi"))
    assert sorted(curve.text) == ["block_size=2", "block_size=4"]       # each point says which setting it is

"""`dlm-studio tune` on a tiny model: the search space from the Params metadata, trials kept in SQLite and
resumed, the chosen point written as a preset that loads and runs, the Pareto front drawn."""
from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest
from typer.testing import CliRunner

from studio.cli import app
from studio.engine.engine import Engine
from studio.errors import BadInput
from studio.evaluation import tune
from studio.presets import load_strategy_preset
from studio.run.config import RunConfig
from tests.support.tiny import tiny_engine


def test_the_search_space_is_what_the_params_declare():
    names = {s.name: s.tune for s in tune.space(RunConfig().use("jacobi-mr-cpu"))}
    assert names == {"block_size": (2, 16), "blocks": (1, 4), "spawn_ratio": (0.5, 0.95), "drafting": True}
    with pytest.raises(BadInput, match="nothing to tune"):
        tune.space(RunConfig().use("ar"))


def test_a_canvas_block_size_is_searched_over_sizes_that_divide_its_canvas():
    import optuna
    spec = {s.name: s for s in tune.space(RunConfig().use("canvas-cpu"))}["block_size"]
    assert isinstance(spec.tune, list) and all(n % b == 0 for b in spec.tune for n in (32, 64, 128))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    assert {tune._suggest(study.ask(), spec) for _ in range(20)} == set(spec.tune)


def test_pareto_and_the_constraint_pick_the_fastest_point_good_enough():
    pts = [tune.Point(0, {}, 1.0, 1.0, 1.0, 1.0, 1.0), tune.Point(1, {}, 2.0, 0.8, 2.0, 2.0, 1.0),
           tune.Point(2, {}, 1.5, 0.7, 1.5, 1.5, 1.0), tune.Point(3, {}, 3.0, 0.5, 3.0, 3.0, 1.0)]
    assert [p.number for p in tune.pareto(pts)] == [0, 1, 3]                # 2 is beaten by 1 on both
    assert tune.choose(pts, 0.75).number == 1 and tune.choose(pts, 0.0).number == 3
    with pytest.raises(BadInput, match="no trial reached quality 1.1"):
        tune.choose(pts, 1.1)


def test_a_lossless_strategys_trials_that_leave_ar_are_named_and_a_lossy_ones_are_not():
    pts = [tune.Point(0, {}, 1.0, 1.0, 1.0, 1.0, 1.0), tune.Point(1, {}, 2.0, 0.5, 2.0, 2.0, 0.5)]
    for lossless in ("ar", "jacobi-mr-cpu", "r-isd-n4", "isd-n4"):
        assert [p.number for p in tune.departures(RunConfig().use(lossless), pts)] == [1], lossless
    relaxed = RunConfig().use("isd-n4")
    for lossy in (RunConfig().use("canvas-cpu"), dataclasses.replace(relaxed, params={**relaxed.params, "tau": 0.3})):
        assert tune.departures(lossy, pts) == [], lossy.label


def test_tune_writes_a_preset_that_runs_a_front_and_resumes(monkeypatch, tmp_path):
    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    prompts = tmp_path / "p.txt"
    prompts.write_text("abc\npon\nhello\n")
    out = tmp_path / "tuned.toml"
    args = ["tune", "-s", "jacobi", "--prompts", str(prompts), "--objective", "tpf", "--max-new-tokens", "12",
            "--out", str(out)]
    res = CliRunner().invoke(app, [*args, "--trials", "6"])
    assert res.exit_code == 0, (res.output, res.exception)
    db = out.with_suffix(".db")

    def finished() -> int:
        with sqlite3.connect(db) as c:
            return c.execute("select count(*) from trials where state = 'COMPLETE'").fetchone()[0]
    assert finished() == 6
    preset = load_strategy_preset(str(out))
    assert preset.strategy == "jacobi" and "tuned by dlm-studio tune on 3 prompts of p.txt" in preset.description
    assert "agreement with ar >= 1" in preset.description          # jacobi is exact: every point qualifies
    assert "warning" not in res.output                                # and no trial left ar's output
    run = CliRunner().invoke(app, ["run", "abc", "--preset", str(out), "--max-new-tokens", "6", "--json"])
    assert run.exit_code == 0, (run.output, run.exception)
    assert json.loads(run.stdout)["strategy"] == "jacobi"
    figure = out.with_suffix(".html").read_text()
    assert "Pareto front" in figure and "chosen: trial" in figure
    tried = {line.split("  ")[-1] for line in res.stdout.splitlines()[1:7]}   # the trials' parameters
    assert len(tried) >= 4 and all("block_size=" in t and "drafting=" in t for t in tried)
    again = CliRunner().invoke(app, [*args, "--trials", "8", "--force"])    # resumes: two more trials
    assert again.exit_code == 0, (again.output, again.exception)
    assert finished() == 8
    assert isinstance(CliRunner().invoke(app, [*args, "--trials", "8"]).exception, BadInput)   # --out exists


def test_a_task_tune_weighs_each_trial_against_ars_own_accuracy(monkeypatch, tmp_path):
    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))

    def score(report: dict) -> dict:                  # ar answers 3 of 4, every trial 1 of 4
        for row in report["strategies"]:
            row["accuracy"] = 0.75 if row["label"] == "ar" else 0.25
        return report
    import studio.commands.tune as command
    monkeypatch.setattr(command, "_data", lambda task, prompts: (["abc", "pon"], score, "task fake"))
    out = tmp_path / "tuned.toml"
    res = CliRunner().invoke(app, ["tune", "-s", "jacobi", "--task", "fake", "--trials", "2",
                                   "--max-new-tokens", "8", "--out", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    assert "ar's accuracy: 0.75" in res.stdout
    assert "accuracy 0.25 (ar's: 0.75)" in load_strategy_preset(str(out)).description
    assert "by × ar with accuracy >= 0" in load_strategy_preset(str(out)).description
    assert "rerun with --min-accuracy" in res.stderr                   # the fastest was below ar: said so
    floor = CliRunner().invoke(app, ["tune", "-s", "jacobi", "--task", "fake", "--trials", "2",
                                     "--max-new-tokens", "8", "--out", str(out), "--force", "--min-accuracy", "0.5"])
    assert isinstance(floor.exception, BadInput) and "the best: 0.250" in str(floor.exception)

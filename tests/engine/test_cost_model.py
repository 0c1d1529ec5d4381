"""The forward cost table: measured by row count (plain and LoRA-gated), read back from the user cache for the same
model, device, dtype and torch (whatever the process's thread count or adapter rank), measured again when any of
them changes, when an adapter's view finds no LoRA costs in it, when the file is bad, or on refresh; `models costs`
prints it."""
import json

import pytest
import torch
from typer.testing import CliRunner

from studio.cli import app
from studio.engine import cost_model
from studio.engine.cost_model import calibrate, cost_table
from studio.engine.cost_table import CostTable, table_key, table_path
from studio.engine.engine import Engine
from tests.support.adapters import random_adapter
from tests.support.tiny import tiny_engine


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_the_table_times_every_row_count_and_the_lora_where_an_adapter_is_attached(tmp_path):
    plain = tiny_engine("qwen3", vocab=256, mask_id=255)
    table = calibrate(plain, max_rows=4, repeats=1, context=8)
    assert table.max_rows == 4 and table.gated_ms is None and all(ms > 0 for ms in table.plain_ms)
    assert table.lora_rank is None and table.threads == torch.get_num_threads() and table.relative(1) == 1.0
    gated = plain.with_adapter(str(random_adapter(tmp_path / "ad", plain.model, r=4)))
    table = calibrate(gated, max_rows=4, repeats=1, context=8)
    assert table.lora_rank == 4 and len(table.gated_ms) == 4
    assert CostTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table


def test_a_forward_s_cost_is_its_rows_plus_what_the_lora_adds_to_its_gated_rows():
    t = CostTable({}, 8, plain_ms=(10.0, 12.0, 15.0), gated_ms=(11.0, 14.0, 18.0))
    assert t.forward_ms(3) == 15.0 and t.forward_ms(3, gated=2) == 15.0 + (14.0 - 12.0)
    assert t.relative(2, gated=2) == 1.4
    assert t.forward_ms(6) == 15.0 * 2                             # past the table: the last time per row
    assert CostTable({}, 8, plain_ms=(10.0, 16.0, 15.0)).forward_ms(40) > 0   # never a falling difference
    assert CostTable({}, 8, plain_ms=(10.0, 12.0)).forward_ms(2, gated=2) == 12.0   # no LoRA measured: plain
    for rows, gated in ((0, 0), (2, 3), (2, -1)):
        with pytest.raises(ValueError):
            t.forward_ms(rows, gated)
    assert CostTable.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_the_cache_serves_the_same_key_and_measures_a_new_one_a_bad_file_or_on_refresh(tmp_path, monkeypatch):
    engine = tiny_engine("llama", vocab=64)
    engine.source = "model files"   # random weights are measured once per process and never written
    measured = []

    def counting(e, **kw):
        measured.append(table_key(e))
        return CostTable(table_key(e), 8, (1.0, 1.5))
    monkeypatch.setattr(cost_model, "calibrate", counting)
    first = cost_table(engine)
    path = table_path(first.key)
    assert path.is_relative_to(tmp_path / "cache" / "dlm-studio" / "costs") and path.exists()
    assert cost_table(engine) == first and len(measured) == 1          # read back
    cost_table(engine, refresh=True)
    assert len(measured) == 2
    path.write_text("{not json")
    assert cost_table(engine) == first and len(measured) == 3          # a bad file is measured again
    threads = torch.get_num_threads()
    try:   # the TUI and the web keep a core for drawing: their process reads the table the CLI measured
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        assert cost_table(engine) == first and len(measured) == 3
    finally:
        torch.set_num_threads(threads)


def test_an_adapter_s_view_reads_a_table_with_lora_costs_of_any_rank(tmp_path, monkeypatch):
    """A table measured on the plain model has no LoRA costs: the adapter's view measures its own, which a view with
    an adapter of another rank then reads."""
    engine = tiny_engine("llama", vocab=64, mask_id=63)
    engine.source = "model files"
    measured = []
    real = cost_model.calibrate
    monkeypatch.setattr(cost_model, "calibrate", lambda e, **kw: measured.append(e.adapter) or real(
        e, max_rows=2, repeats=1, context=8))
    plain = cost_table(engine)
    assert plain.gated_ms is None and measured == [None]
    rank4 = engine.with_adapter(str(random_adapter(tmp_path / "a4", engine.model, r=4)))
    gated = cost_table(rank4)
    assert gated.gated_ms is not None and gated.lora_rank == 4 and len(measured) == 2
    rank2 = engine.with_adapter(str(random_adapter(tmp_path / "a2", engine.model, r=2)))
    assert cost_table(rank2) == gated and len(measured) == 2


def test_models_costs_prints_the_table_and_its_json(tmp_path, monkeypatch):
    engine = tiny_engine("llama", vocab=64)
    engine.source = "model files"
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    monkeypatch.setattr(cost_model, "calibrate", lambda e, **kw: CostTable(table_key(e), 128, (2.0, 2.5, 3.0)))
    res = CliRunner().invoke(app, ["models", "costs"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert "measuring forwards" in res.stderr and "after a 128-token context" in res.stdout
    assert "   3       3.00     1.50" in res.stdout
    out = json.loads(CliRunner().invoke(app, ["models", "costs", "--json"]).stdout)
    assert out["plain_ms"] == [2.0, 2.5, 3.0] and out["path"] == str(table_path(table_key(engine)))


def test_the_cli_says_so_once_when_a_first_cost_aware_run_measures_the_table(monkeypatch):
    """Measuring pauses a first run for seconds: one line on stderr says why, and only then (the table is cached)."""
    engine = tiny_engine("llama", vocab=64, mask_id=63)
    engine.source = "model files"
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    monkeypatch.setattr(cost_model, "calibrate", lambda e, **kw: CostTable(table_key(e), 128, (1.0,) * 16))
    monkeypatch.setattr("studio.run.session.cost_table", cost_table)   # the machine's table, not the tests' pin
    monkeypatch.setattr(cost_model, "on_measure", None)
    runs = [CliRunner().invoke(app, ["run", "-s", "isd", "--raw", "--max-new-tokens", "4", "ab"]) for _ in range(2)]
    assert all(r.exit_code == 0 for r in runs), [(r.output, r.exception) for r in runs]
    said = [r.stderr.count("measuring this machine's forward costs") for r in runs]
    assert said == [1, 0]


def test_a_busy_machine_s_times_are_measured_again_and_the_steadiest_table_kept(monkeypatch):
    """Times that swing (another job on the machine) are measured again, at most ATTEMPTS times; the steadiest
    table is kept, and one still unsteady says so where it is printed."""
    from studio.engine.forward_cost import ForwardCost
    engine = tiny_engine("llama", vocab=64)
    spreads = iter([0.5, 0.3, 0.05, 0.01])

    def measure(engine, shapes, **kw):
        spread = next(spreads)
        return [ForwardCost(s, 10.0 + s.tokens, 1.0, spread) for s in shapes]
    monkeypatch.setattr(cost_model, "measure_forwards", measure)
    table = calibrate(engine, max_rows=3)
    assert table.noise == 0.05 and table.steady and next(spreads) == 0.01   # the third try was steady: no fourth
    spreads = iter([0.5, 0.3, 0.4])
    table = calibrate(engine, max_rows=3)
    assert table.noise == 0.3 and not table.steady and table.plain_ms == (11.0, 12.0, 13.0)
    assert "busy" in cost_model.unsteady_line(table) and cost_model.unsteady_line(
        CostTable({}, 8, (1.0,), noise=0.02)) is None
    assert CostTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    assert CostTable.from_dict({"key": {}, "context": 8, "plain_ms": [1.0]}).steady   # a table cached before


def test_a_busy_machine_is_measured_again_only_within_the_budget(monkeypatch):
    """Each unsteady attempt takes 12 s here: a second would end at 24 s, a third at 36 s, past BUDGET_S (30 s), so
    the measurement stops after two (on a loaded machine three attempts made a first decode wait ~100 s)."""
    from studio.engine.forward_cost import ForwardCost
    engine = tiny_engine("llama", vocab=64)
    clock, attempts = [0.0], []

    def measure(engine, shapes, **kw):
        clock[0] += 12.0
        attempts.append(clock[0])
        return [ForwardCost(s, 10.0 + s.tokens, 1.0, 0.5 - 0.1 * len(attempts)) for s in shapes]
    monkeypatch.setattr(cost_model, "measure_forwards", measure)
    monkeypatch.setattr(cost_model.time, "monotonic", lambda: clock[0])
    table = calibrate(engine, max_rows=3)
    assert attempts == [12.0, 24.0] and table.noise == pytest.approx(0.3) and not table.steady


def test_models_costs_warns_of_a_table_measured_on_a_busy_machine(monkeypatch):
    engine = tiny_engine("llama", vocab=64)
    engine.source = "model files"
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    monkeypatch.setattr(cost_model, "calibrate", lambda e, **kw: CostTable(table_key(e), 128, (2.0, 2.5), noise=0.4))
    res = CliRunner().invoke(app, ["models", "costs"])
    assert res.exit_code == 0 and "times spread 40%" in res.stdout
    assert "warning: the machine was busy" in res.stderr and "--refresh" in res.stderr


def test_the_measuring_line_names_the_model_by_its_own_name_not_its_spec():
    """The embedded model is loaded as `default`: the line said 'forward costs for default'."""
    import dataclasses

    from studio.engine.cost_model import measuring_line
    engine = dataclasses.replace(tiny_engine("llama"), name="default")
    assert "forward costs for default " in measuring_line(engine)
    engine.config = dataclasses.replace(engine.config, name="SmolLM2-135M-Instruct")
    assert "forward costs for SmolLM2-135M-Instruct (10-30 s" in measuring_line(engine)

"""`dlm-studio bench` on tiny random models: the --json report (speedups vs ar and vs transformers, repeats,
spread, exact-match rate), the prompts file, and bad input. In-process, `Engine.load` swapped for a tiny engine."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from studio.run.bench import BUILTIN_PROMPTS, load_prompts, spread
from studio.cli import app
from studio.run.config import RunConfig
from studio.engine.engine import Engine
from studio.errors import BadInput
from studio.run.session import encode_prompt, run_to_end
from tests.support.tiny import tiny_engine

PROMPTS = ["abc", "pon", "hello"]   # TinyTokenizer: letters a..p are the vocabulary
SPREAD_KEYS = {"median", "min", "max", "n"}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", vocab=16)


@pytest.fixture
def bench(engine, monkeypatch, tmp_path):
    """Run `dlm-studio bench ... --json` in-process on the tiny engine with PROMPTS; returns the report."""
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")

    def run(*args):
        res = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), "--json", *args])
        assert res.exit_code == 0, (res.output, res.exception)
        return json.loads(res.stdout)
    return run


def _tokens(engine, name, preset, prompt, n=10, temperature=0.0, seed=0):
    strat, settings = RunConfig(name, preset=preset, max_new_tokens=n, temperature=temperature, seed=seed).build()
    return run_to_end(engine, strat, settings, prompt, encode_prompt(engine, prompt)).token_ids


def test_bench_json_speedups_repeats_spread(bench):
    rep = bench("-s", "isd,jacobi-mr-cpu", "--repeats", "3", "--warmup", "1", "--max-new-tokens", "10")
    assert rep["prompts"] == PROMPTS and rep["repeats"] == 3 and rep["warmup"] == 1
    assert [s["label"] for s in rep["strategies"]] == ["ar", "isd", "jacobi-mr-cpu"]
    hf = rep["transformers_per_prompt"]
    assert len(hf) == len(PROMPTS) and all(len(x) == 3 and min(x) > 0 for x in hf)
    assert rep["transformers_tok_s"] == spread([x for xs in hf for x in xs])
    ar = rep["strategies"][0]
    ar_med = [statistics.median(p["tok_s"]) for p in ar["per_prompt"]]
    hf_med = [statistics.median(x) for x in hf]
    for s in rep["strategies"]:
        pp = s["per_prompt"]
        assert len(pp) == len(PROMPTS) and all(len(p["tok_s"]) == len(p["same_as_ar"]) == 3 for p in pp)
        samples = [x for p in pp for x in p["tok_s"]]
        assert s["tok_s"] == {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
                              "n": len(PROMPTS) * 3}
        assert s["tok_s"]["min"] <= s["tok_s"]["median"] <= s["tok_s"]["max"]
        med = [statistics.median(p["tok_s"]) for p in pp]
        ratios = [m / a for m, a in zip(med, ar_med)]
        assert set(s["speedup_vs_ar"]) == SPREAD_KEYS and s["speedup_vs_ar"]["n"] == len(PROMPTS)
        assert s["speedup_vs_ar"]["median"] == pytest.approx(statistics.median(ratios))
        assert s["speedup_vs_ar"]["min"] == pytest.approx(min(ratios))
        assert s["speedup_vs_ar"]["max"] == pytest.approx(max(ratios))
        vs_hf = [m / h for m, h in zip(med, hf_med)]
        assert s["speedup_vs_transformers"]["median"] == pytest.approx(statistics.median(vs_hf))
        assert s["speedup_vs_transformers"]["n"] == len(PROMPTS)
        assert s["params"]["max_new_tokens"] == 10 and s["params"]["temperature"] == 0.0
        assert s["tpf"]["n"] == len(PROMPTS) * 3
    assert ar["speedup_vs_ar"]["median"] == 1.0 and ar["accept_rate"] is None   # ar verifies nothing
    assert rep["strategies"][2]["strategy"] == "jacobi-mr" and rep["strategies"][2]["params"]["block_size"] == 8
    isd = rep["strategies"][1]
    assert 0.0 <= isd["accept_rate"]["min"] <= isd["accept_rate"]["max"] <= 1.0
    # greedy and lossless: every run matches ar
    assert [s["exact_match_vs_ar"] for s in rep["strategies"]] == [1.0, 1.0, 1.0]


def test_a_prompts_runs_advance_in_lock_step(bench, monkeypatch):
    """Every strategy's run of a prompt is driven together, one forward at a time, so a slow spell of the machine
    lands on all of them: the drives are one per prompt and repeat, each over all the strategies."""
    import studio.run.bench as bench_module
    drives = []

    def recording_drive(runs, *args, **kw):
        drives.append([r.strategy.name for r in runs])
        return real_drive(runs, *args, **kw)
    real_drive = bench_module.drive
    monkeypatch.setattr(bench_module, "drive", recording_drive)
    bench("-s", "isd,jacobi", "--repeats", "2", "--max-new-tokens", "8", "--no-transformers")
    assert drives == [["ar", "isd", "jacobi"]] * (2 * len(PROMPTS))


def test_bench_exact_match_rate_sampled(bench, engine, tmp_path):
    """Sampled runs: the rate is the share of (prompt, repeat) runs whose tokens equal ar's, checked against
    runs of our own with the same seed (each run is deterministic given its seed). Fixed drafting: a cost-aware
    plan follows this machine's cost table, and with it the random draws a seed leads to."""
    isd = tmp_path / "isd-fixed.toml"
    isd.write_text('strategy = "isd"\n\n[params]\ndrafting = "fixed"\n')
    rep = bench("-s", str(isd), "--repeats", "2", "--warmup", "0", "--max-new-tokens", "4", "--temperature", "1.0",
                "--seed", "0", "--no-transformers")
    assert rep["transformers_tok_s"] is None and rep["transformers_per_prompt"] is None
    same = [_tokens(engine, "isd", str(isd), p, n=4, temperature=1.0, seed=0)
            == _tokens(engine, "ar", None, p, n=4, temperature=1.0, seed=0) for p in PROMPTS]
    isd = rep["strategies"][1]
    assert [p["same_as_ar"] for p in isd["per_prompt"]] == [[x, x] for x in same]
    assert isd["exact_match_vs_ar"] == pytest.approx(sum(same) / len(same))
    assert isd["speedup_vs_transformers"] is None
    assert 0 < isd["exact_match_vs_ar"] < 1  # this seed gives both outcomes: the rate is not trivially 0 or 1


def test_transformers_baseline_is_the_same_model(engine):
    """The outside baseline must run our weights: transformers' greedy tokens == our ar's (the prompt starts
    with token 0, transformers' pad id here, which it would mask without an explicit attention mask)."""
    from studio.run.bench import hf_generate
    assert hf_generate(engine, encode_prompt(engine, "abc"), 10) == _tokens(engine, "ar", None, "abc")


def test_transformers_baseline_reads_the_base_weights_while_an_adapter_is_installed(tmp_path):
    """bench -s ar,r-isd: r-isd's adapter (a MASK row grows the embedding table) is on the shared model when the
    baseline is first built; it must still load the base weights (it failed with a size mismatch)."""
    from studio.run.bench import _HF_CACHE, hf_generate
    from tests.support.adapters import random_mask_adapter
    plain = tiny_engine("qwen3", vocab=16)
    plain.with_adapter(str(random_mask_adapter(tmp_path / "ad", plain.model))).activate()
    assert plain.model.model.embed_tokens.weight.shape[0] == 17
    try:
        assert hf_generate(plain, [1, 2, 3], 8) == _tokens(plain, "ar", None, "bcd", n=8)
    finally:
        _HF_CACHE.pop(id(plain), None)


def test_bench_table_output(engine, monkeypatch, tmp_path):
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    (tmp_path / "p.txt").write_text("abc\n")
    res = CliRunner().invoke(app, ["bench", "--prompts", str(tmp_path / "p.txt"), "-s", "isd", "--repeats", "2",
                                   "--warmup", "0", "--max-new-tokens", "6"])
    assert res.exit_code == 0, res.output
    assert "1 prompts × 2 repeats" in res.stdout and "transformers generate:" in res.stdout
    assert "100%" in res.stdout and "isd" in res.stdout


def test_bench_on_a_pipe_says_how_far_it_is(engine, monkeypatch, tmp_path):
    """stderr not a terminal (CliRunner's, like a CI log's): no bar, but a line at every tenth of the runs, the last
    one when all have run."""
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    (tmp_path / "p.txt").write_text("abc\npon\n")
    res = CliRunner().invoke(app, ["bench", "--prompts", str(tmp_path / "p.txt"), "-s", "isd", "--repeats", "2",
                                   "--warmup", "1", "--max-new-tokens", "4", "--no-transformers", "--json"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("bench: ")]
    total = 2 + 2 * 2 * 2   # warm-up of ar and isd, then 2 repeats x 2 prompts x 2 strategies: a tenth each
    assert [ln.split()[1] for ln in lines] == [f"{i}/{total}" for i in range(1, total + 1)]
    assert "(warm-up: ar)" in lines[0] and "(repeat 2/2: isd)" in lines[-1]
    assert json.loads(res.stdout)["repeats"] == 2   # stdout keeps only the report


def test_bench_html_report(engine, monkeypatch, tmp_path):
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    (tmp_path / "p.txt").write_text("abc\npon\n")
    out = tmp_path / "bench.html"
    res = CliRunner().invoke(app, ["bench", "--prompts", str(tmp_path / "p.txt"), "-s", "isd,jacobi", "--repeats", "1",
                                   "--warmup", "0", "--max-new-tokens", "6", "--no-transformers", "--json",
                                   "--html", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    page = out.read_text()
    assert "<script src=\"http" not in page and "Plotly" in page          # self-contained
    for s in rep["strategies"]:                                            # one table row per strategy, its numbers
        assert f"<td>{s['label']}</td>" in page
        assert f"{s['tpf']['median']:.2f}" in page
    assert "2 prompts × 1 repeats" in page


# -- prompts files ------------------------------------------------------------------------------------------
def test_load_prompts_lines_and_jsonl(tmp_path):
    assert load_prompts(None) == BUILTIN_PROMPTS and len(BUILTIN_PROMPTS) >= 4
    f = tmp_path / "p.txt"
    f.write_text('plain line\n\n   \n{"prompt": "from json", "id": 3}\n  {"prompt": "indented json"}\nlast\n')
    assert load_prompts(f) == ["plain line", "from json", "indented json", "last"]


@pytest.mark.parametrize("content, needle", [
    ('ok\n{"text": "no prompt key"}\n', ":2: expected a JSON object with a 'prompt' field"),
    ('{"prompt": 3}\n', ":1: 'prompt' must be a non-empty string"),
    ("{not json\n", ":1: expected a JSON object"),
    ("\n  \n", "is empty"),
])
def test_bad_prompts_file_is_badinput(tmp_path, content, needle):
    f = tmp_path / "bad.txt"
    f.write_text(content)
    with pytest.raises(BadInput) as e:
        load_prompts(f)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_prompts_file_exit_2_cli(tmp_path):
    """Through the real entry point: one line on stderr, exit 2, before any model is loaded."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"oops": 1}\n')
    for args, needle in (([ "--prompts", str(bad)], f"{bad}:2:"),
                         (["--prompts", str(tmp_path / "missing.txt")], "cannot read prompts file"),
                         (["--repeats", "0"], "--repeats")):
        r = subprocess.run([sys.executable, "-m", "studio", "bench", "-s", "isd", *args], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2, (r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr and needle in lines[0], r.stderr


def test_bench_forwards_json_and_table(engine, monkeypatch, tmp_path):
    """`bench forwards` times every shape on the model (no adapter here: the gated shape is left out) instead of
    decoding, and measures the by-rows cost table anew into the cache; `bench --forwards` is the same command."""
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    res = CliRunner().invoke(app, ["bench", "forwards", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert [f["shape"] for f in report["forwards"]] == ["1-token step", "7-token extend", "16-token extend",
                                                         "batch-8 1-token step"]
    assert report["forwards"][0]["ratio"] == 1.0 and report["lora_overhead"] is None
    assert report["device"] == "cpu" and report["threads"] >= 1
    assert report["weight_bytes"] == sum(p.numel() * 4 for p in engine.model.parameters())
    step_s = report["forwards"][0]["ms"] / 1e3
    assert report["step_stream_gbps"] == pytest.approx(report["weight_bytes"] / 1e9 / step_s, rel=0.01, abs=0.01)
    assert report["copy_gbps"] > 0 and report["verify_7_rows_us"] > 0 and report["verify_path"] in ("torch", "fused")
    assert report["moe_layer_vs_dense"] is None     # a dense model
    from studio.engine.cost_table import CostTable, table_key, table_path
    cached = CostTable.from_dict(json.loads(table_path(table_key(engine)).read_text()))
    assert cached.to_dict() == report["by_rows"] and cached.max_rows == 16 and cached.gated_ms is None
    res = CliRunner().invoke(app, ["bench", "--forwards", "--repeats", "1"])
    assert res.exit_code == 0 and "x 1-token step" in res.stdout and "batch-8 1-token step" in res.stdout
    assert "copy bandwidth" in res.stdout and "verifying 7 sampled drafts" in res.stdout
    assert "a forward of n rows, x the 1-row step" in res.stdout and "16: " in res.stdout


def test_bench_on_a_model_without_an_ar_mode_reports_its_baseline_and_each_cached_runs_exact_reference(monkeypatch,
                                                                                                     tmp_path):
    from tests.support.tiny import tiny_mdm
    engine = tiny_mdm(seed=4)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    prompts = tmp_path / "p.txt"
    prompts.write_text("abc\npon\n")
    res = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), "--json", "-s", "canvas", "--preset",
                                   "fast-dllm-prefix", "--max-new-tokens", "32",
                                   "--repeats", "1", "--warmup", "0"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    by = {s["label"]: s for s in rep["strategies"]}
    assert rep["baseline"] == "canvas" and rep["transformers_tok_s"] is None   # a diffusion model: no transformers
    cached, exact = by["fast-dllm-prefix"], by["fast-dllm-prefix · cache=none"]
    assert cached["reference"] == "fast-dllm-prefix · cache=none" and exact["reference"] is None
    firsts = cached["reference_first_difference"]
    assert len(firsts) == 2 and cached["exact_match_vs_reference"] == sum(k is None for k in firsts) / 2


def test_bench_task_scores_every_strategy_on_the_same_questions(engine, monkeypatch, tmp_path):
    """Accuracy beside speed: the answers are what ar says on two questions and nonsense on the third, so ar and the
    lossless isd score 2/3 on every repeat; the report names the task and marks each output; the HTML has the figure."""
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    said = [engine.tokenizer.decode(_tokens(engine, "ar", None, p, n=6)) for p in PROMPTS]
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                            for p, a in zip(PROMPTS, [said[0], [said[1], "x y"], "no such answer"])))
    html = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["bench", "--task", str(task), "-s", "isd", "--repeats", "2", "--warmup", "0",
                                   "--max-new-tokens", "6", "--no-transformers", "--json", "--html", str(html)])
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(res.stdout)
    assert rep["task"] == {"name": "task", "answers": [[said[0]], [said[1], "x y"], ["no such answer"]]}
    for row in rep["strategies"]:
        assert row["accuracy"] == pytest.approx(2 / 3)
        assert [p["correct"] for p in row["per_prompt"]] == [[True, True], [True, True], [False, False]]
    assert "Accuracy vs speed on task" in html.read_text()


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "abc"}', "expected a JSON object with 'prompt' and 'answer'"),
    ('{"prompt": "abc", "answer": []}', "'answer' one or a list of them"),
    ("", "has no questions"),
])
def test_bench_task_refuses_a_bad_question_file(bench, tmp_path, line, needle):
    from studio.evaluation.questions import load_task
    task = tmp_path / "bad.jsonl"
    task.write_text(line + "\n")
    with pytest.raises(BadInput, match=needle):
        load_task(str(task))


def test_a_shipped_question_set_loads_and_scores_whole_words():
    from studio.evaluation.questions import Question, load_task, shipped_tasks
    assert "quick" in shipped_tasks()
    name, questions = load_task("quick")
    assert name == "quick" and len(questions) >= 30 and len({q.prompt for q in questions}) == len(questions)
    five = Question("2 + 3?", ("5",))
    assert five.correct("2 + 3 = 5.") and not five.correct("It is 15.") and not five.correct("5.5")

"""`dlm-studio lm-eval --model dlm-studio`: lm-evaluation-harness runs a tiny local task (YAML + JSONL written here,
nothing downloaded) end to end on a tiny model, its scores those of our own runs and of transformers' log-probs."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("lm_eval")

from studio.cli import app  # noqa: E402
from studio.engine.engine import Engine  # noqa: E402
from studio.errors import BadInput  # noqa: E402
from studio.run.config import RunConfig  # noqa: E402
from studio.run.session import run_to_end# noqa: E402
from tests.support.tiny import hf_pair, tiny_engine  # noqa: E402

V = 128   # ASCII


class AsciiTokenizer:
    """One token per ASCII character (any text lm-eval builds)."""
    chat_template, name, bos_id = None, "ascii", None

    def __init__(self, eos: int):
        self.vocab_size, self.eos_ids = V, [eos]

    def encode(self, text: str) -> list[int]:
        return [min(ord(c), V - 2) for c in text]

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))

    def token_text(self, i: int) -> str:
        return chr(i)


QUESTIONS = [{"q": f"{a}+{b}=", "a": str(a + b), "choices": [str(a + b), str(a + b + 1)]}
             for a, b in ((1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (4, 4))]


def task_files(tmp_path) -> str:
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'qa.jsonl'}\ntest_split: test\n"
    (tmp_path / "gen.yaml").write_text(
        "task: dlm_tiny_gen\n" + common + 'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n'
        'target_delimiter: ""\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 3\n'
        "metric_list:\n  - metric: exact_match\n")
    (tmp_path / "choice.yaml").write_text(
        "task: dlm_tiny_choice\n" + common + 'output_type: multiple_choice\ndoc_to_text: "{{q}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: 0\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n')
    return str(tmp_path)


@pytest.fixture
def engine(monkeypatch):
    engine = tiny_engine("llama", vocab=V, seed=3, max_seq_len=64)
    engine.tokenizer = AsciiTokenizer(eos=10)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return engine


def lm_eval(tmp_path, *args) -> tuple[dict, dict]:
    """The harness's results by task, and its logged responses by task (in document order)."""
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["lm-eval", "--model", "dlm-studio", "--include_path", task_files(tmp_path),
                                   "--output_path", str(out), "--log_samples", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        docs = sorted(map(json.loads, path.read_text().splitlines()), key=lambda d: d["doc_id"])
        samples[path.name.split("_", 1)[1].rsplit("_", 1)[0]] = [d["resps"] for d in docs]
    return json.loads(next(out.rglob("results*.json")).read_text())["results"], samples


def test_lm_eval_scores_our_runs_and_transformers_log_probs(engine, tmp_path):
    """One harness run of both tasks (lm-eval indexes its thousands of built-in tasks on every start): the generation
    task scores what our r-isd runs answer, the multiple-choice task ranks the answers as transformers' log-probs of
    the same weights do."""
    hf, engine.model = hf_pair("llama", seed=4, vocab=V)
    results, samples = lm_eval(tmp_path, "--model_args", "strategy=r-isd,stride=3", "--tasks",
                               "dlm_tiny_gen,dlm_tiny_choice")

    strategy, settings = RunConfig("r-isd", params={"stride": 3}, max_new_tokens=3, stop=("\n",)).build()
    answers = [run_to_end(engine, strategy, settings, q["q"], engine.tokenizer.encode(q["q"])).footer["text"]
               for q in QUESTIONS]
    assert samples["dlm_tiny_gen"] == [[[a]] for a in answers]      # what the harness got from us
    want = sum(a.strip() == q["a"] for a, q in zip(answers, QUESTIONS)) / len(QUESTIONS)
    assert results["dlm_tiny_gen"]["exact_match,none"] == pytest.approx(want)

    def logp(context: str, answer: str) -> float:
        ids = engine.tokenizer.encode(context + answer)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        return float(sum(lp[i - 1, ids[i]] for i in range(len(ids) - len(answer), len(ids))))
    want = sum(logp(q["q"], q["choices"][0]) > logp(q["q"], q["choices"][1]) for q in QUESTIONS) / len(QUESTIONS)
    assert 0 < want < 1     # the two answers rank differently across questions: the score means something
    assert results["dlm_tiny_choice"]["acc,none"] == pytest.approx(want)


def test_loglikelihood_refuses_a_bidirectional_model(engine, tmp_path):
    import dataclasses

    from studio.evaluation.lm_eval_model import StudioLM
    engine.config = dataclasses.replace(engine.config, attention="bidirectional")
    lm = StudioLM(strategy="ar")
    with pytest.raises(BadInput, match="loglikelihood needs a causal model"):
        lm._score([1, 2], [3])


def test_a_preset_alone_runs_its_own_strategy_and_parameters(engine):
    from studio.evaluation.lm_eval_model import StudioLM
    lm = StudioLM(preset="jacobi-mr-cpu")
    assert lm.strategy.name == "jacobi-mr" and lm.config.label == "jacobi-mr-cpu"
    assert StudioLM(strategy="jacobi-mr-cpu").strategy.header_params() == lm.strategy.header_params()


def test_the_shipped_example_runs_as_documented_on_the_embedded_model(tmp_path, monkeypatch):
    """The README's command on `examples/lm-eval` through the real `Engine.load`, with lm-eval's own default device
    (cuda:0, refused on a machine without CUDA until `dlm-studio lm-eval` passed `auto`) and `device=cpu` in
    --model_args (once a duplicate keyword): scores, and the one-line decoding summary."""
    from pathlib import Path

    from tests.conftest import default_gguf_file
    default_gguf_file()
    monkeypatch.chdir(Path(__file__).parents[2])   # the task's data path is relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["lm-eval", "--model", "dlm-studio", "--model_args", "strategy=r-isd,device=cpu",
                                   "--tasks", "dlm_quick_sums", "--include_path", "examples/lm-eval",
                                   "--apply_chat_template", "--limit", "2", "--output_path", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    scores = json.loads(next(out.rglob("results*.json")).read_text())["results"]["dlm_quick_sums"]
    assert 0.0 <= scores["exact_match,last-number"] <= 1.0
    assert "dlm-studio r-isd:" in res.stderr and "forwards (TPF" in res.stderr


def test_lm_eval_device_settings():
    """lm-eval's --device is the default of ours (its cuda:0 is our cuda); a device in --model_args wins, and the two,
    differing, are one clear error."""
    from studio.evaluation.lm_eval_model import StudioLM
    made = []
    class Recorder(StudioLM):
        def __init__(self, **kw):
            made.append(kw)
    Recorder.create_from_arg_string("strategy=ar", {"device": "cuda:0", "batch_size": 1})
    Recorder.create_from_arg_string("strategy=ar,device=cpu", {"device": "auto", "batch_size": 1})
    Recorder.create_from_arg_obj({"strategy": "ar"}, {"device": None})
    assert [m["device"] for m in made] == ["cuda", "cpu", "auto"]
    assert made[0]["batch_size"] == 1
    with pytest.raises(BadInput, match="disagree"):
        Recorder.create_from_arg_string("device=cpu", {"device": "cuda:0"})


def test_lm_eval_says_when_it_measures_the_forward_costs(monkeypatch):
    """A first cost-aware answer waits ~15 s for the cost table; lm-eval's progress bar showed only '15.6s/answer'.
    The command arms the CLI's notice (one stderr line, as every other command) before lm-eval starts."""
    from studio.engine import cost_model
    monkeypatch.setattr(cost_model, "on_measure", None)
    CliRunner().invoke(app, ["lm-eval", "--no-such-option"])   # lm-eval refuses it; the notice is armed before
    assert cost_model.on_measure is not None

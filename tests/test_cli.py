"""The CLI end to end, as scripts call it: output contracts, traces, exit codes for bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studio.events import read_trace

CLI = [sys.executable, "-m", "studio"]


def cli(*args, check_rc=None, **kw):
    r = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=600, **kw)
    if check_rc is not None:
        assert r.returncode == check_rc, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ar", "isd"])
def test_run_json_and_trace_agree(tmp_path, strategy):
    trace = tmp_path / "t.jsonl"
    r = cli("run", "List three colors.", "-s", strategy, "--max-new-tokens", "24", "--temperature", "1.0",
            "--seed", "3", "--json", "--trace", str(trace), check_rc=0)
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "n_tokens", "forwards", "tpf", "accept_rate", "wall_s", "tok_s",
                        "strategy", "params", "model", "stop_reason"}
    assert out["strategy"] == strategy and out["model"]["name"] == "default"
    assert out["n_tokens"] == len(out["token_ids"]) > 0
    t = read_trace(trace)
    for key in ("text", "n_tokens", "forwards", "tpf", "accept_rate", "wall_s", "tok_s", "stop_reason"):
        assert t.footer[key] == out[key], key
    assert t.header["prompt"]["text"] == "List three colors." and t.header["strategy"] == strategy
    assert [tok for e in t.events if e["t"] == "emit" for tok in e["tok"]] == out["token_ids"]


@pytest.mark.slow
def test_run_streams_text_and_reports_metrics():
    r = cli("run", "What is the capital of France?", "-s", "isd", "--max-new-tokens", "16", check_rc=0)
    assert "Paris" in r.stdout
    assert "[isd]" in r.stderr and "TPF" in r.stderr and "forwards" in r.stderr


@pytest.mark.slow
def test_preset_sets_paper_configuration():
    r = cli("run", "Hi", "--preset", "isd-n4", "--max-new-tokens", "8", "--json", check_rc=0)
    params = json.loads(r.stdout)["params"]
    assert (params["stride"], params["temperature"], params["top_k"], params["top_p"]) == (4, 1.0, 50, 0.95)


def test_unknown_strategy_is_exit_2():
    assert_one_line_error(cli("run", "hi", "-s", "beam-search"), "unknown strategy", "beam-search")


def test_missing_weights_is_exit_2(tmp_path):
    assert_one_line_error(cli("run", "hi", "-s", "ar", "--model", str(tmp_path / "nope")), "not found")


def test_corrupt_weights_are_exit_2(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    assert_one_line_error(cli("run", "hi", "-s", "ar", "--model", str(bad)), str(bad))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                               "hidden_size": 8, "num_hidden_layers": 1,
                                               "num_attention_heads": 2, "intermediate_size": 8}))
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert_one_line_error(cli("run", "hi", "-s", "ar", "--model", str(d)), "safetensors")


@pytest.mark.slow
def test_prompt_longer_than_context_is_exit_2():
    assert_one_line_error(cli("run", "word " * 9000, "-s", "ar"), "longer than the model's context")


def test_bad_sampling_and_params_are_exit_2():
    assert_one_line_error(cli("run", "hi", "-s", "isd", "--param", "stride=1"), "stride")
    assert_one_line_error(cli("run", "hi", "-s", "ar", "--top-p", "1.5"), "top_p")
    assert_one_line_error(cli("run", "hi", "--preset", "no-such-preset"), "unknown strategy preset")


def test_no_prompt_is_usage_error():
    r = cli("run")
    assert r.returncode == 2 and "Traceback" not in r.stderr

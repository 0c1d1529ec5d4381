"""blockdiff, s2d2 (every routing policy) and simsd from the CLI: tiny SDAR-like and Fast-dLLM-v2-like
checkpoints on disk, and the embedded model with a random adapter supplying the MASK row."""
import json

import pytest
from typer.testing import CliRunner

from studio.cli import app
from studio.events import read_trace
from tests.support.adapters import random_mask_adapter
from tests.support.cli import assert_one_line_error, cli
from tests.support.hf_files import write_hf_dir

POLICIES = ["always", "never", "min-span", "score", "hysteresis", "ucb"]


def _dlm_dir(path, kind: str):
    """A tiny checkpoint whose config.json says SDAR (position-aligned) or Fast-dLLM v2 (right-shifted)."""
    cfg, _ = write_hf_dir(path, arch="qwen3" if kind == "sdar" else "qwen2")
    if kind == "sdar":
        cfg.update(architectures=["SDARForCausalLM"], model_type="sdar", block_size=4, mask_token_id=95)
    else:
        cfg.update(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="fast_dllm_qwen", bd_size=4,
                   mask_token_id=95)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def dlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dlm")
    return {kind: _dlm_dir(root / kind, kind) for kind in ("sdar", "fast")}


def _run_and_read(args, trace):
    """`dlm-studio run` in process (tiny models load in milliseconds; a subprocess would mostly import)."""
    r = CliRunner().invoke(app, ["run", "hello world the cat", "--raw", "--max-new-tokens", "12", "--json",
                                 "--trace", str(trace), *args])
    assert r.exit_code == 0, (r.output, r.exception)
    out = json.loads(r.stdout)
    back = read_trace(trace)
    assert back.footer["n_tokens"] == out["n_tokens"] and back.footer["forwards"] == out["forwards"]
    assert CliRunner().invoke(app, ["trace", "info", str(trace)]).exit_code == 0
    return out, back


@pytest.mark.parametrize("kind", ["sdar", "fast"])
def test_tiny_checkpoints_run_every_block_strategy(tmp_path, dlm_dirs, kind):
    model = str(dlm_dirs[kind])
    runs = [["-s", "blockdiff"], ["--preset", "blockdiff-b4-dynamic"], ["-s", "simsd"],
            ["-s", "simsd", "--draft-model", model, "--temperature", "1"]]
    runs += [["-s", "s2d2", "-p", f"policy={p}"] for p in POLICIES]
    for i, args in enumerate(runs):
        out, back = _run_and_read(["--model", model] + args, tmp_path / f"{i}.jsonl")
        assert back.header["tokenizer"]["mask_id"] == 95
        roles = {e["role"] for e in back.events if e["t"] == "forward"}
        if args[1] == "simsd":
            assert "verify" in roles and back.header["params"]["draft_model"] == ("self" if len(args) == 2 else
                                                                                  back.header["model"]["name"])
        if "policy=always" in args:
            assert "verify" in roles
        if "policy=never" in args:
            assert "verify" not in roles
        assert {e["t"] for e in back.events} >= {"block", "emit"}


def test_draft_flags_are_for_simsd_only(dlm_dirs):
    r = cli("run", "hello", "--raw", "--model", str(dlm_dirs["sdar"]), "-s", "s2d2", "--draft-model",
            str(dlm_dirs["sdar"]))
    assert_one_line_error(r, "simsd")
    r = cli("run", "hello", "--raw", "--model", str(dlm_dirs["sdar"]), "-s", "simsd", "--draft-model",
            str(dlm_dirs["fast"]))
    assert_one_line_error(r, "position-aligned")


@pytest.mark.slow
def test_embedded_model_with_a_random_adapter(tmp_path, default_engine):
    adapter = str(random_mask_adapter(tmp_path / "adapter", default_engine.model))
    runs = [["-s", "blockdiff"], ["-s", "s2d2"], ["-s", "s2d2", "-p", "policy=always"], ["-s", "s2d2", "-p", "policy=never"],
            ["--preset", "s2d2-config-a"], ["--preset", "s2d2-hysteresis"], ["-s", "s2d2", "-p", "policy=ucb"],
            ["--preset", "simsd-b4"], ["-s", "simsd", "--draft-adapter", adapter]]
    for i, args in enumerate(runs):   # in process: the subprocess path is tested elsewhere, torch's import is slow
        # every forward drafts (the presets' setting): cost-aware drafting takes AR steps here on a CPU
        fixed = ["-p", "drafting=fixed"] if args[:2] in (["-s", "s2d2"], ["-s", "simsd"]) else []
        r = CliRunner().invoke(app, ["run", "Write a numbered list from 1 to 10.", "--adapter", adapter,
                                     "--max-new-tokens", "16", "--json", "--trace", str(tmp_path / f"{i}.jsonl"), *args,
                                     *fixed])
        assert r.exit_code == 0, (args, r.output, r.exception)
        out = json.loads(r.stdout)
        back = read_trace(tmp_path / f"{i}.jsonl")
        assert out["n_tokens"] == back.footer["n_tokens"] > 0
        assert back.header["model"]["adapter"] and back.header["tokenizer"]["mask_id"] == 49152
        # the adapter works at MASK rows: draft forwards gate some rows on, commit forwards none
        fwd = [e for e in back.events if e["t"] == "forward"]
        assert any(e["lora_rows"] > 0 for e in fwd if e["role"] in ("draft", "target"))
        assert all(e["lora_rows"] == 0 for e in fwd if e["role"] == "commit")


@pytest.mark.parametrize("preset", ["sdar-1.7b-chat", "sdar-8b-chat", "fast-dllm-v2-7b", "llada-8b-instruct",
                                    "dream-v0-instruct-7b", "llada-moe-7b-a1b-instruct", "llada2-mini"])
def test_paper_model_presets_say_how_to_get_the_weights(preset, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))          # ~/models/... is certainly absent
    info = CliRunner().invoke(app, ["models", "info", preset])
    assert info.exit_code == 0 and "not found" in info.stdout and "hugging face" in info.stdout.lower()
    r = cli("run", "hi", "--model", preset, "-s", "s2d2", env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert_one_line_error(r, preset, "cannot download")

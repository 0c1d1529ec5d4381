"""A real Ctrl+C (SIGINT to a real `dlm-studio` process) at several moments of every command that writes files:
exit 130, one line on stderr, no traceback, and every file either complete, truncated at a line the reader
reports (traces), or absent / the old one (exports, reports: written under a temporary name and renamed).

A tiny random checkpoint with a 4096-token context and no EOS stands in for a model: it decodes ~100 tokens
a second on one core, so a 2000-token run leaves time to interrupt it; the tests poll the files it writes
(or its CPU time) instead of sleeping fixed times."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from studio.events import read_trace
from tests.support.hf_files import tiny_tokenizer_files

CLI = [sys.executable, "-m", "studio"]
LONG = ["--max-new-tokens", "2000"]      # ~20 s of decoding: never finishes before the interrupt


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny llama checkpoint (HF layout, random weights) with a 4096-token context whose EOS tokens can never
    win the greedy choice (their output rows are zero): runs go to --max-new-tokens."""
    import torch
    from safetensors.torch import save_file

    from studio.engine.families import read_config
    from studio.engine.model import Transformer
    path = tmp_path_factory.mktemp("interrupts") / "tiny"
    path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    torch.manual_seed(0)
    weights = {k: v.clone() for k, v in Transformer(read_config(cfg)).state_dict().items()}
    weights["lm_head.weight"][[2, 10]] = 0.0          # </s> and <|im_end|>: logit 0, below the best of the rest
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    tiny_tokenizer_files(path)
    (path / "generation_config.json").write_text("{}")
    return path


def _deliverable_sigint() -> None:
    """In the child: SIGINT with its default action and unblocked, as from a terminal (see tests/run/test_chat.py)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _spawn(*args, cwd: Path, stdout=subprocess.PIPE) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(cwd / ".cache"), PYTHONUNBUFFERED="1")
    return subprocess.Popen(CLI + [str(a) for a in args], cwd=cwd, stdout=stdout, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=_deliverable_sigint)


def _wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 60.0) -> None:
    """Poll `ready()` every 10 ms while `proc` runs; fail if it ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the command ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def _interrupt(proc: subprocess.Popen, progress: bool = False) -> tuple[str, str]:
    """Ctrl+C; (stdout, the stderr line it caused) after checking exit 130, one line, no traceback.
    `progress`: the command logs its progress on stderr (the train commands): the interrupt's line is the
    last one and the only one from dlm-studio itself."""
    proc.send_signal(signal.SIGINT)
    return _checked(proc, *proc.communicate(timeout=60), progress)


def _checked(proc: subprocess.Popen, out: str, err: str, progress: bool = False) -> tuple[str, str]:
    """`_interrupt`'s checks of an interrupted process's exit and output."""
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    lines = [line for line in err.splitlines() if line.strip()] if progress else err.splitlines()
    # a first run's notices: measuring the forward-cost table, and that the times were not steady (a tiny model's
    # sub-millisecond forwards on a loaded machine)
    notices = ("measuring this machine's forward costs", "while these forwards were timed")
    lines = [line for line in lines if not any(n in line for n in notices)]
    ours = [line for line in lines if line.startswith("dlm-studio:")] if progress else lines
    assert len(ours) == 1 and lines[-1] == ours[0] and ours[0].startswith("dlm-studio: interrupted"), err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    return out or "", ours[0]


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _cpu_s(proc: subprocess.Popen) -> float:
    """CPU seconds the process has used (a load-independent clock for 'it is past its start-up')."""
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _before_our_code(returncode: int, err: str) -> bool:
    """Whether an interrupt landed in the interpreter's own start (runpy finding the module), before any line of
    studio ran: Python's default KeyboardInterrupt exit (SIGINT, status -2) with no frame of ours. No guard can be
    armed that early, so a start-up test interrupts again a little later instead of failing."""
    ours = re.search(r'File "[^"]*/studio/[^"]*\.py"', err)
    return returncode == -signal.SIGINT and "KeyboardInterrupt" in err and ours is None


def _interpreter_start_cpu_s() -> float:
    """CPU seconds a bare start of this venv's Python takes (site and its .pth files, before any code of ours
    runs), the most of three: an interrupt before then is the interpreter's own fatal error, out of reach.
    Spawned as `_spawn` does (a preexec_fn means a fork of this big process, whose CPU time the child inherits)."""
    import resource
    spent = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", "pass"], check=True, preexec_fn=_deliverable_sigint)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return max(spent)


def _temps(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.endswith(".tmp")]


def _truncated_trace(path: Path):
    """A trace an interrupt left: every terminated line is whole JSON, a torn last line (if any) is not, and
    the reader reads it as truncated (no footer)."""
    data = path.read_bytes()
    *whole, last = data.split(b"\n")
    for line in whole:
        json.loads(line)
    if last:   # an incomplete last line: recognisably torn, never a silently different record
        with pytest.raises(ValueError):
            json.loads(last)
    t = read_trace(path, allow_truncated=True)
    assert t.footer is None and t.header["kind"] == "header"
    return t


def _reads_with_a_warning(*args, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run(CLI + [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlm-studio: warning:") and "truncated trace" in lines[0], r.stderr
    return r


# -- run --trace -------------------------------------------------------------------------------------
def test_run_interrupted_mid_generation_leaves_a_truncated_trace_every_reader_takes(tiny_dir, tmp_path):
    trace = tmp_path / "run.jsonl"
    p = _spawn("run", "hello world", "--raw", "-s", "ar", "--model", tiny_dir, *LONG, "--trace", trace,
               cwd=tmp_path, stdout=subprocess.DEVNULL)
    _wait_for(p, lambda: _lines(trace) >= 60, "60 trace lines")
    _, line = _interrupt(p)
    assert line == "dlm-studio: interrupted"
    t = _truncated_trace(trace)
    assert len(t.events) >= 59
    info = _reads_with_a_warning("trace", "info", trace, cwd=tmp_path)
    assert "TRUNCATED" in info.stdout and f"events:     {len(t.events)} " in info.stdout
    exp = _reads_with_a_warning("trace", "export", trace, "-f", "csv", cwd=tmp_path)
    assert exp.stdout.strip() == str(tmp_path / "run.csv")
    assert (tmp_path / "run.csv").read_text().count("\n") == len(t.events) + 1
    _reads_with_a_warning("trace", "replay", trace, "--speed", "0", cwd=tmp_path)
    assert _temps(tmp_path) == []


def test_run_interrupted_right_after_the_header(tiny_dir, tmp_path):
    trace = tmp_path / "run.jsonl"
    p = _spawn("run", "hello", "--raw", "-s", "jacobi", "--model", tiny_dir, *LONG, "--trace", trace, cwd=tmp_path)
    _wait_for(p, lambda: _lines(trace) >= 1, "the header line")
    _interrupt(p)
    t = _truncated_trace(trace)
    assert t.header["strategy"] == "jacobi"
    assert "TRUNCATED" in _reads_with_a_warning("trace", "info", trace, cwd=tmp_path).stdout


def test_an_interrupt_while_safetensors_loads_waits_for_the_load(tiny_dir):
    """safetensors turns a KeyboardInterrupt raised in the torch calls it makes into a ValueError, which read as a
    corrupt model file; under the CLI's handler the interrupt waits until the file is loaded (studio.interrupts).
    Alarms at random moments of many loads: each load ends loaded or interrupted, never "corrupt"."""
    import random

    from studio.cli import _hold_interrupts
    from studio.engine.lazy_tensors import read_safetensors
    restore, rng, outcomes = _hold_interrupts(), random.Random(0), {"loaded": 0, "interrupted": 0}
    try:
        for _ in range(200):
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0, 0.002))   # SIGALRM: the handler's own path
                read_safetensors(tiny_dir / "model.safetensors")
                signal.setitimer(signal.ITIMER_REAL, 0)
                outcomes["loaded"] += 1
            except KeyboardInterrupt:
                outcomes["interrupted"] += 1
    finally:
        restore()
    assert outcomes["loaded"] > 0 and outcomes["interrupted"] > 0, outcomes


@pytest.mark.parametrize("cpu_s", [0.05, 0.3, 0.6])
def test_run_interrupted_while_starting(tiny_dir, tmp_path, cpu_s):
    """During start-up (the CLI's imports, torch's, the model load): exit 130 and one line all the same (an
    interrupt inside an import is held until the import is over: torch would swallow it), and no trace unless
    the run had begun (then a truncated one). `cpu_s` counts from the end of the interpreter's own start."""
    trace = tmp_path / "run.jsonl"
    at = _interpreter_start_cpu_s() + cpu_s
    for attempt in range(3):
        p = _spawn("run", "hello", "--raw", "-s", "ar", "--model", tiny_dir, *LONG, "--trace", trace, cwd=tmp_path)
        _wait_for(p, lambda: _cpu_s(p) >= at, f"{at:.2f} s of start-up")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        if not _before_our_code(p.returncode, err):
            break
        at += 0.05   # the CPU clock ticks in 10 ms and a loaded machine's start-up varies: a little later
    _, line = _checked(p, out, err)
    assert line == "dlm-studio: interrupted"
    assert not trace.exists() or _truncated_trace(trace)


# -- compare --trace-dir --html ------------------------------------------------------------------------
def test_compare_interrupted_mid_generation(tiny_dir, tmp_path):
    d = tmp_path / "traces"
    p = _spawn("compare", "hello", "--raw", "-s", "ar,jacobi", "--model", tiny_dir, *LONG, "--trace-dir", d,
               "--html", d / "report.html", "--json", cwd=tmp_path)
    _wait_for(p, lambda: _lines(d / "ar.jsonl") >= 60, "60 lines of the ar trace")
    out, _ = _interrupt(p)
    assert out == ""                                          # no half a JSON table
    assert sorted(x.name for x in d.iterdir()) == ["ar.jsonl", "jacobi.jsonl"]   # no report, no temp file
    for name in ("ar", "jacobi"):
        assert _truncated_trace(d / f"{name}.jsonl").header["strategy"] == name


# -- bench --html --json ---------------------------------------------------------------------------------
def test_bench_interrupted_mid_measurement(tiny_dir, tmp_path):
    (tmp_path / "prompts.txt").write_text("hello world\nthe cat sat\n")
    html = tmp_path / "bench.html"
    p = _spawn("bench", "--prompts", "prompts.txt", "-s", "ar,jacobi", "--model", tiny_dir, *LONG, "--repeats", "1",
               "--warmup", "0", "--no-transformers", "--json", "--html", html, cwd=tmp_path)
    _wait_for(p, lambda: _cpu_s(p) >= 3.0, "3 s of CPU (past start-up, decoding)")
    out, line = _interrupt(p)
    assert out == "" and line == "dlm-studio: interrupted"
    assert not html.exists() and _temps(tmp_path) == []


# -- trace export -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_trace(tmp_path_factory):
    """A complete trace of 60,000 events (written directly, in a second): its CSV export takes a while to read
    and a while to write, so an interrupt can land in either phase."""
    from studio.events import SCHEMA
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    header = {"kind": "header", "schema": SCHEMA, "run_id": "big", "created": "2026-01-01T00:00:00.000Z",
              "strategy": "ar", "params": {},
              "model": {"name": "tiny", "arch": "llama", "dtype": "float32", "device": "cpu", "adapter": None},
              "tokenizer": {"name": "tiny", "vocab_size": 96, "eos_ids": [], "mask_id": None},
              "prompt": {"text": "hi", "token_ids": [1]}, "seed": 0}
    n = 60_000
    footer = {"kind": "footer", "text": "x" * n, "n_tokens": n, "forwards": 0, "tpf": 0.0, "accept_rate": 0.0,
              "accept_by_pos": [], "stop_reason": "max_new_tokens", "prefill_s": 0.0, "wall_s": 1.0, "tok_s": 1.0}
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        f.writelines(json.dumps({"t": "emit", "step": i, "ms": i * 0.5, "pos": [i], "tok": [5], "text": "x",
                                 "pieces": ["x"]}) + "\n" for i in range(n))
        f.write(json.dumps(footer) + "\n")
    assert read_trace(path).footer is not None
    return path


def test_export_interrupted_while_writing_keeps_the_old_file(big_trace, tmp_path):
    """--force over an existing export, Ctrl+C while the new one is being written: the old file stays whole."""
    out = tmp_path / "big.csv"
    out.write_text("the old export\n")
    p = _spawn("trace", "export", big_trace, "-f", "csv", "-o", out, "--force", cwd=tmp_path)
    _wait_for(p, lambda: any((tmp_path / t).stat().st_size > 0 for t in _temps(tmp_path)), "the temporary file")
    _interrupt(p)
    assert out.read_text() == "the old export\n" and _temps(tmp_path) == []


def test_export_interrupted_while_reading_writes_nothing(big_trace, tmp_path):
    out = tmp_path / "big.csv"
    p = _spawn("trace", "export", big_trace, "-f", "csv", "-o", out, cwd=tmp_path)
    _wait_for(p, lambda: _cpu_s(p) >= 0.4, "0.4 s of reading")
    _interrupt(p)
    assert not out.exists() and _temps(tmp_path) == []


# -- train data / idlm / block -----------------------------------------------------------------------------
def test_train_data_interrupted_keeps_whole_shards(tiny_dir, tmp_path):
    from studio.train import data
    d = tmp_path / "data"
    p = _spawn("train", "data", "--out", d, "--model", tiny_dir, "--n-prompts", "2048", "--max-new-tokens", "2",
               "--batch-size", "128", cwd=tmp_path)
    manifest = d / data.MANIFEST
    _wait_for(p, lambda: manifest.exists() and json.loads(manifest.read_text())["shards"], "the first shard")
    _, line = _interrupt(p, progress=True)
    m = data.read_manifest(d)
    assert line == (f"dlm-studio: interrupted: {sum(m['shard_sizes'])} sequences in {len(m['shards'])} whole "
                    f"shards kept in {d}; continue with --resume")
    assert 1 <= len(m["shards"]) < 8 and len(data.load_sequences(d)) == sum(m["shard_sizes"])
    assert len((d / data.PROMPTS).read_text().splitlines()) == 2048


@pytest.fixture(scope="module")
def train_data(tiny_dir, tmp_path_factory):
    """Eight greedy answers of the tiny model, made in-process (no subprocess start-up)."""
    from studio.engine.engine import Engine
    from studio.train import data, prompts
    d = tmp_path_factory.mktemp("train") / "data"
    data.generate(Engine.load(str(tiny_dir)), prompts.training_prompts(8, 0), d, 16, batch_size=8)
    return d


@pytest.mark.parametrize("kind", ["idlm", "block"])
def test_train_interrupted_saves_a_checkpoint(tiny_dir, train_data, tmp_path, kind):
    from studio.engine.lora import read_adapter
    ad = tmp_path / "adapter"
    p = _spawn("train", kind, "--data", train_data, "--out", ad, "--model", tiny_dir, "--steps", "1000",
               "--batch-size", "1", "--rows", "3", "--rank", "2", "--save-every", "1000", cwd=tmp_path)
    _wait_for(p, lambda: _lines(ad / "train_log.jsonl") >= 2, "two training steps")
    _, line = _interrupt(p, progress=True)
    state = json.loads((ad / "train_state.json").read_text())
    steps = [json.loads(x)["step"] for x in (ad / "train_log.jsonl").read_text().splitlines()]
    assert state["stopped"] == "interrupted" and state["step"] == steps[-1] >= 2
    assert line == f"dlm-studio: interrupted: checkpoint saved in {ad} (step {state['step']}); continue with --resume"
    read_adapter(ad)                                        # the adapter files are whole
    assert not (ad / ".checkpoint").exists()

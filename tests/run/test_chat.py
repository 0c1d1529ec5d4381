"""Chat sessions: slash commands, the plain REPL, and `dlm-studio chat --plain` on the embedded model
(two turns through a pipe; Ctrl+C cancelling an answer, not the chat)."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from studio.run.chat import ChatSession
from studio.run.config import RunConfig
from studio.events import read_trace
from studio.tui.repl import chat_repl
from studio.run.session import drive
from tests.support.tiny import tiny_engine


def session(name="ar", n=8, **kw):
    return ChatSession(tiny_engine("llama", vocab=20, seed=2), RunConfig(name, max_new_tokens=n, **kw))


def finish(s: ChatSession, text: str):
    run = s.start_turn(text)
    drive([run])
    return run.result


def test_strategy_and_set_commands_change_the_next_turn_and_refuse_bad_values():
    s = session()
    assert s.command("/strategy isd").message.startswith("strategy: isd")
    assert s.command("/set stride 3").message.startswith("set stride = 3")
    assert s.command("/set temperature 0.8").message.startswith("set temperature")
    assert s.command("/set top-k 5").message.startswith("set top-k")
    assert s.command("/set max-new-tokens 5").message.startswith("set max-new-tokens")
    result = finish(s, "bcdef")
    assert result.header["strategy"] == "isd" and result.header["params"]["stride"] == 3
    assert result.header["params"]["temperature"] == 0.8 and result.header["params"]["top_k"] == 5
    assert result.footer["n_tokens"] <= 5
    for line, words in [("/set stride 1", "stride must be >= 2"), ("/set nope 1", "has no parameter 'nope'"),
                        ("/set temperature hot", "temperature"), ("/strategy nope", "unknown strategy or preset"),
                        ("/frobnicate", "unknown command"), ("/set stride", "usage: /set KEY VALUE"),
                        ("/set max_new_tokens 0", "must be >= 1")]:   # 0 was once taken for "unset": 128
        reply = s.command(line)
        assert words in reply.message and reply.error and not reply.quit, line
    assert s.choice.params == {"stride": 3} and s.choice.label == "isd"   # refused changes left it as it was
    assert not s.command("/strategy isd-n4").error and s.choice.label == "isd-n4"
    for usage in ("/set", "/strategy", "/save", "/model a b c"):   # wrong usage is an error, not a success
        assert s.command(usage).message.startswith("usage:") and s.command(usage).error, usage
    assert s.choice.build()[0].params.stride == 4


def test_reset_help_quit_and_model_errors(tmp_path):
    s = session()
    finish(s, "bcdef")
    assert s.command("/reset").message == "conversation reset" and s.turns == []
    assert "/strategy NAME|PRESET" in s.command("/help").message
    assert s.command("/quit").quit and s.command("/exit").quit
    reply = s.command(f"/model {tmp_path / 'missing'}")
    assert reply.message.startswith("error:") and s.engine.name == "tiny-llama"


def test_save_the_last_turn_or_every_turn_and_never_overwrite_without_force(tmp_path, monkeypatch):
    s = session()
    assert "nothing to save" in s.command(f"/save {tmp_path / 'x.jsonl'}").message
    first, second = finish(s, "bcdef"), finish(s, "gh")
    assert s.command(f"/save {tmp_path / 'last.jsonl'}").message.startswith("saved")
    assert read_trace(tmp_path / "last.jsonl").footer["n_tokens"] == second.footer["n_tokens"]
    assert "exists; add --force" in s.command(f"/save {tmp_path / 'last.jsonl'}").message
    assert s.command(f"/save {tmp_path / 'last.jsonl'} --force").message.startswith("saved")
    s.command(f"/save {tmp_path / 'chat.jsonl'} --all")
    back = [read_trace(tmp_path / f"chat-{i}.jsonl") for i in (1, 2)]
    assert [t.events for t in back] == [first.events, second.events]
    # a bare name is saved as NAME.jsonl (what the web's upload takes), and the reply says where, in full
    monkeypatch.chdir(tmp_path)
    assert s.command("/save bare").message == f"saved {(tmp_path / 'bare.jsonl').resolve()}"
    assert read_trace(tmp_path / "bare.jsonl").footer["n_tokens"] == second.footer["n_tokens"]


def test_plain_repl_streams_two_answers_and_a_metrics_line_per_turn():
    s = session("isd", n=10)
    out, err = io.StringIO(), io.StringIO()
    chat_repl(s, stdin=io.StringIO("bcdefg\n\n/set stride 3\nhij\n"), stdout=out, stderr=err)
    answers = out.getvalue().splitlines()
    assert answers == [t.footer["text"] for t in s.turns] and len(answers) == 2
    metrics = [line for line in err.getvalue().splitlines() if line.startswith("[isd]")]
    assert len(metrics) == 2 and "set stride = 3" in err.getvalue()
    assert all(f"{t.footer['n_tokens']} tokens  {t.footer['forwards']} forwards" in m for t, m in zip(s.turns, metrics))


def test_plain_repl_reports_bad_turns_and_goes_on():
    s = session(n=8)
    err = io.StringIO()
    chat_repl(s, stdin=io.StringIO("b" * 200 + "\nbcd\n"), stdout=io.StringIO(), stderr=err)
    assert "longer than the model's context" in err.getvalue() and len(s.turns) == 1


# -- the command on the embedded model -------------------------------------------------------------
def _deliverable_sigint() -> None:
    """In the child, before exec: Ctrl+C as a terminal delivers it (default action, not blocked), whatever the
    test process's own signal state is by then (a disposition or mask set earlier would be inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _chat_process(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "studio.cli", "chat", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_deliverable_sigint)


@pytest.mark.slow
def test_piped_chat_answers_two_turns_and_the_second_prefills_only_its_new_tokens(tmp_path):
    p = _chat_process("-s", "isd", "--max-new-tokens", "48")
    out, err = p.communicate(f"Hello\nList three colours.\n/save {tmp_path / 'chat.jsonl'} --all\n", timeout=600)
    assert p.returncode == 0, err
    metrics = [line for line in err.splitlines() if line.startswith("[isd]")]
    assert len(metrics) == 2 and len([line for line in out.splitlines() if line.strip()]) >= 2
    turns = [read_trace(tmp_path / f"chat-{i}.jsonl") for i in (1, 2)]
    assert out.startswith(turns[0].footer["text"]) and turns[1].footer["text"] in out
    prefill = [next(e for e in t.events if e["t"] == "forward" and e["role"] == "prefill") for t in turns]
    reused = next(e for e in turns[1].events if e["t"] == "kv")["from_len"]
    history = turns[1].header["prompt"]["token_ids"]
    assert reused > len(turns[0].header["prompt"]["token_ids"])            # turn 1's answer stays in the KV
    planned = next(e["drafts"] for e in turns[1].events if e["t"] == "plan" and e["step"] == 0)
    assert prefill[1]["n_tokens"] == len(history) - reused + planned <= len(history) - reused + 3   # + MASK rows
    assert f"+ {reused} reused" in metrics[1]


@pytest.mark.slow
def test_ctrl_c_cancels_the_answer_not_the_chat():
    p = _chat_process("-s", "ar", "--max-new-tokens", "400")
    p.stdin.write("Write a numbered list from 1 to 200.\n")
    p.stdin.flush()
    chunks: list[str] = []   # stdout read on a thread, a character at a time, so the test sees the stream
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: p.stdout.read(1), "")), daemon=True)
    reader.start()
    deadline = time.time() + 120
    while len(chunks) < 20 and time.time() < deadline:   # the answer is streaming
        time.sleep(0.05)
    assert len(chunks) >= 20
    p.send_signal(signal.SIGINT)
    time.sleep(1.0)
    p.stdin.write("Say hi.\n")
    p.stdin.close()
    p.wait(timeout=300)
    reader.join()
    err = p.stderr.read()
    assert p.returncode == 0, err
    assert "[cancelled]" in err and "stop cancelled" in err
    metrics = [line for line in err.splitlines() if line.startswith("[ar]")]
    assert len(metrics) == 2 and "stop cancelled" in metrics[0] and "stop cancelled" not in metrics[1]


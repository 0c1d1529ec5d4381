"""`dlm-studio chat --plain`: a line REPL (also what `chat` runs when stdin or stdout is not a terminal).

Each line is a user turn (or a /command, see `studio.run.chat`); the answer streams to stdout as its tokens
become final, then one metrics line goes to stderr. Decoding runs on a worker thread, so Ctrl+C while an
answer streams cancels that answer (the partial answer stays in the conversation) and the chat goes on;
EOF or /quit ends it.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

from studio.run.chat import ChatSession
from studio.errors import BadInput
from studio.viz.text import run_summary_line
from studio.run.worker import Worker

POLL_S = 0.02


def chat_repl(session: ChatSession, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
              stderr: TextIO = sys.stderr) -> None:
    interactive = stdin.isatty()
    if interactive:
        stderr.write(f"dlm-studio chat · {session.engine.name} · {session.choice.describe()}\n"
                     "type /help for commands, Ctrl+C stops an answer, Ctrl+D leaves\n")
    while True:
        try:
            if interactive:
                stderr.write("> ")
                stderr.flush()
            line = stdin.readline()
        except KeyboardInterrupt:
            stderr.write("\n(Ctrl+D or /quit leaves)\n")
            continue
        if not line:
            return
        line = line.strip()
        if not line:
            continue
        if not interactive:   # no terminal echoes piped input: the transcript says what each answer answers
            stderr.write(f"> {line}\n")
        if not _answer(session, line, stdout, stderr):
            return
        if not interactive:
            stderr.write("\n")   # a blank line between one exchange and the next
        stderr.flush()


def _answer(session: ChatSession, line: str, stdout: TextIO, stderr: TextIO) -> bool:
    """Run one line: a command (its reply) or a turn (the answer, then its metrics line). False: the chat ends."""
    if line.startswith("/"):
        reply = session.command(line)
        stderr.write(reply.message + "\n")
        return not reply.quit
    try:
        run = session.start_turn(line)
    except BadInput as e:
        stderr.write(f"error: {e}\n")
        return True
    _stream(Worker([run]).start(), stdout, stderr)
    if run.done:
        stderr.write(run_summary_line(run.result.footer, session.choice.label, run.result.events) + "\n")
    return True


def _stream(worker: Worker, stdout: TextIO, stderr: TextIO) -> None:
    """Print the answer's text as it is emitted until the worker ends; Ctrl+C cancels the answer."""
    while True:
        try:
            finished = worker.done
            for _, events in worker.drain():
                for e in events:
                    if e["t"] == "emit" and e["text"]:
                        stdout.write(e["text"])
                        stdout.flush()
            if finished:
                break
            time.sleep(POLL_S)
        except KeyboardInterrupt:
            worker.cancel()
            stderr.write("[cancelled]\n")
    stdout.write("\n")
    stdout.flush()
    if worker.error is not None:
        e = worker.error
        stderr.write(f"error: {e}\n" if isinstance(e, BadInput) else f"internal error: {type(e).__name__}: {e}\n")

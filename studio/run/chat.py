"""A chat session: the conversation, what the next turn runs with, and the slash commands that change it.

Shared by the plain REPL (`dlm-studio chat --plain`) and the TUI's chat screen, so `/strategy`, `/set`,
`/reset`, `/save`, `/help` and `/quit` mean the same everywhere. No UI code here.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from studio.errors import BadInput
from studio.run.config import RunConfig, parse_value

if TYPE_CHECKING:   # studio.run.session imports torch; the TUI's replay screen runs without it
    from studio.run.session import Run, RunResult

HELP = """commands:
  /strategy NAME|PRESET   decode the next turns with a strategy or a strategy preset
  /set KEY VALUE          a strategy parameter (e.g. stride 3) or temperature, top_k, top_p, seed, max_new_tokens
  /reset                  forget the conversation (and its cached KV)
  /model SPEC [ADAPTER]   load another model (default, a preset, a HF directory or a .gguf) and start over
  /save FILE [--all] [--force]   write the last turn's trace (--all: every turn, FILE-1.jsonl, FILE-2.jsonl, ...)
  /help                   this list
  /quit                   leave (EOF does too)"""


@dataclass
class Reply:
    """What a command did: a message to show, whether it is an error (bad input or wrong usage: nothing changed),
    and whether the chat should end."""
    message: str
    quit: bool = False
    error: bool = False


class ChatSession:
    """`draft`: the engine SimSD turns draft with (`--draft-model`); None: SimSD drafts with the model itself.
    `drafter`: the DFlash drafter directory dflash turns draft with (`--draft-model`); None: the shipped one."""

    def __init__(self, engine, choice: RunConfig, chat: bool = True, draft=None, drafter: str | None = None):
        from studio.run.conversation import Conversation
        self.engine, self.choice, self.draft, self.drafter = engine, choice, draft, drafter
        self.conversation = Conversation(engine, chat=chat)

    @property
    def turns(self) -> list[RunResult]:
        return self.conversation.turns

    def start_turn(self, text: str, trace_path: str | None = None) -> Run:
        strategy, settings = self._build()
        return self.conversation.start_turn(text, strategy, settings, trace_path)

    def _build(self):
        """The next turn's strategy (with its drafter) and settings."""
        strategy, settings = self.choice.build()
        if self.draft is not None and hasattr(strategy, "use_draft"):
            strategy.use_draft(self.draft, self.engine.config)
        if self.drafter is not None and hasattr(strategy, "use_drafter"):
            strategy.use_drafter(self.drafter)
        return strategy, settings

    def costs_pending(self) -> bool:
        """Whether the next turn would first measure this machine's forward costs (`session.costs_pending`)."""
        from studio.run.session import costs_pending
        return costs_pending(self.engine, self._build()[0])

    def measure_costs(self) -> None:
        """Prepare the next turn's strategy (`session.prepare`: it measures and stores the forward costs it plans
        with): a front end runs this off its UI thread and starts the turn after it."""
        from studio.run.session import prepare
        prepare(self.engine, self._build()[0])

    def command(self, line: str) -> Reply:
        """Run one slash command; bad input comes back as the reply's message (BadInput is not raised)."""
        try:
            words = shlex.split(line.strip()[1:])
        except ValueError as e:
            return Reply(f"error: {e}", error=True)
        if not words:
            return Reply(HELP)
        name, args = words[0].lower(), words[1:]
        try:
            return self._commands().get(name, self._unknown)(args)
        except BadInput as e:
            return Reply(f"error: {e}", error=True)

    def _commands(self):
        return {"strategy": self._strategy, "set": self._set, "reset": self._reset, "model": self._model,
                "save": self._save,
                "help": lambda args: Reply(HELP), "quit": lambda args: Reply("bye", quit=True),
                "exit": lambda args: Reply("bye", quit=True)}

    def _unknown(self, args) -> Reply:
        return Reply(f"error: unknown command (type /help); commands: /{', /'.join(self._commands())}", error=True)

    def _strategy(self, args: list[str]) -> Reply:
        if len(args) != 1:
            return Reply(f"usage: /strategy NAME|PRESET (now: {self.choice.describe()})", error=True)
        self.choice = self.choice.use(args[0])
        return Reply(f"strategy: {self.choice.describe()}")

    def _set(self, args: list[str]) -> Reply:
        if len(args) != 2:
            return Reply("usage: /set KEY VALUE", error=True)
        self.choice = self.choice.set(args[0], parse_value(args[1]))
        return Reply(f"set {args[0]} = {args[1]} · {self.choice.describe()}")

    def _reset(self, args: list[str]) -> Reply:
        self.conversation.reset()
        return Reply("conversation reset")

    def _model(self, args: list[str]) -> Reply:
        if len(args) not in (1, 2):
            return Reply(f"usage: /model SPEC [ADAPTER] (now: {self.engine.name})", error=True)
        from studio.engine.engine import Engine
        from studio.run.conversation import Conversation
        engine = Engine.load(args[0], adapter=args[1] if len(args) == 2 else None)
        self.engine, self.conversation = engine, Conversation(engine, chat=self.conversation.chat)
        return Reply(f"model {engine.name} loaded in {engine.load_s:.1f}s; conversation reset")

    def _save(self, args: list[str]) -> Reply:
        flags = {a for a in args if a.startswith("--")}
        paths = [a for a in args if not a.startswith("--")]
        if len(paths) != 1 or flags - {"--all", "--force"}:
            return Reply("usage: /save FILE [--all] [--force]", error=True)
        written = save_traces(self.turns, Path(paths[0]), every_turn="--all" in flags, force="--force" in flags)
        return Reply("saved " + ", ".join(str(p.resolve()) for p in written))


def save_traces(turns: list[RunResult], path: Path, every_turn: bool = False, force: bool = False) -> list[Path]:
    """Write the last turn's trace to `path`, or every turn's to PATH-1.jsonl, PATH-2.jsonl, ...; a name without
    `.jsonl` gets it (what `trace` and the web's upload read)."""
    if not turns:
        raise BadInput("nothing to save yet: no turn has finished")
    if path.suffix != ".jsonl" and not every_turn:
        path = path.with_name(path.name + ".jsonl")
    if every_turn:
        stem = path.with_suffix("") if path.suffix == ".jsonl" else path
        targets = [(Path(f"{stem}-{i}.jsonl"), t) for i, t in enumerate(turns, 1)]
    else:
        targets = [(path, turns[-1])]
    clash = [str(p) for p, _ in targets if p.exists()]
    if clash and not force:
        raise BadInput(f"{clash[0]} exists; add --force to overwrite")
    for p, turn in targets:
        turn.save(p)
    return [p for p, _ in targets]

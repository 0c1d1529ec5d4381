"""The trajectory grid's data: a `Cell` per (step, output position), a `Row` per step, the block spans, the final
text's segments, and the `Grid` that holds them; each cell says in words what it is (hover text, inspectors).

`studio.viz.grid` builds a grid from trace events (its docstring says what each state means); this module only
holds and describes one, so it needs no events.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from studio.viz.palette import State, glyph, label


@dataclass
class Cell:
    state: State
    tok: int | None = None          # the token now at this position (draft, accepted, resampled, ...)
    text: str | None = None         # its text (from emit text, else token_text, else None)
    p: float | None = None          # target/verifier probability of the verified token
    q: float | None = None          # draft/proposal probability
    conf: float | None = None       # diffusion confidence (unmask)
    draft_tok: int | None = None    # a rejected draft token (the resample replaced it)
    draft_text: str | None = None
    draft_p: float | None = None    # p and q of that rejected draft (the correction has none of its own)
    draft_q: float | None = None
    src: str | None = None          # proposal source (mask, draft_model, jacobi, ngram, diffusion)
    kinds: tuple[str, ...] = ()     # event kinds that touched the position at this step, in order
    emitted: bool = False           # emitted (became final output) at this very step
    held: bool = False              # carried-over unmasked/edited token (no event at this step)
    committed_step: int | None = None  # the step it was emitted at (committed cells, final tokens)
    filled_step: int | None = None  # the step its token was filled (unmask) or last edited at
    old: int | None = None          # the token an edit replaced
    old_text: str | None = None
    guess: int | None = None        # a guess (propose) the noise of a remask at the same step replaced
    guess_text: str | None = None
    # a draft tree's candidates at this position when its step verified more than one (siblings in the trie): each
    # (token, text, verdict: "accepted path", "refused" or "pruned"), in the order they were tried
    branches: tuple[tuple[int, str | None, str], ...] = ()

    @property
    def ratio(self) -> float | None:
        """Acceptance ratio min(1, p/q) of this cell's accepted draft (None when p or q is unknown)."""
        return _ratio(self.p, self.q) if "accept" in self.kinds else None

    @property
    def glyph(self) -> str:
        return glyph(self.state, self.held)

    def reasons(self, canvas: bool = False) -> list[str]:
        """Why the cell is what it is, in words, for the events a canvas run adds (and a canvas's guesses):
        what filled, edited or re-noised it, and that a cell after an EOS is padding."""
        out = []
        if "propose" in self.kinds and canvas and self.guess is None:
            out.append("guess, not verified")
        if "unmask" in self.kinds:
            out.append("filled by the fill rule")
        if "edit" in self.kinds:
            out.append(f"T2T edit: {_token(self.old, self.old_text)} → {_token(self.tok, self.text)}")
        if self.guess is not None:
            out.append(f"guess {_token(self.guess, self.guess_text)} not taken")
        if "remask" in self.kinds:
            out.append("re-noised: a noise token" if self.state is State.NOISE else "remasked: back to MASK")
        if self.state is State.PADDING:
            out.append("after the EOS: never output")
        return out

    def describe(self) -> list[str]:
        """Human-readable lines (hover text)."""
        lines = [f"{self.glyph} {label(self.state)}" + (" (held: not yet emitted)" if self.held else "")]
        if self.tok is not None and self.state is not State.MASKED:
            lines.append(f"token {_token(self.tok, self.text)}")
        lines += self.reasons()
        lines += _probs(self.p, self.q, self.ratio)
        if self.draft_tok is not None:
            lines.append(f"rejected draft {_token(self.draft_tok, self.draft_text)}")
            lines += ["  " + line for line in _probs(self.draft_p, self.draft_q, _ratio(self.draft_p, self.draft_q))]
        if self.conf is not None:
            lines.append(f"confidence {_fmt(self.conf)}")
        if self.src:
            lines.append(f"proposed by {self.src}")
        if self.branches:
            lines.append(f"draft tree: {len(self.branches)} candidates here")
            lines += [f"  {_token(t, text)} {verdict}" for t, text, verdict in self.branches]
        if self.filled_step is not None and "unmask" not in self.kinds and "edit" not in self.kinds:
            lines.append(f"filled at step {self.filled_step}")
        if self.emitted:
            lines.append("emitted at this step")
        elif self.committed_step is not None and self.state is State.COMMITTED:
            lines.append(f"committed at step {self.committed_step}")
        if len(self.kinds) > 1:
            lines.append("events: " + ", ".join(self.kinds))
        return lines


@dataclass
class Row:
    """What happened at one step, besides the cells."""
    step: int
    role: str | None = None          # forward role ("prefill", "verify", ...); None: no forward event
    n_tokens: int = 0                # rows in the forward
    lora_rows: int = 0
    wall_ms: float | None = None     # forward time (summed if a step has several forward events)
    ms: float | None = None          # time of the step's last event, since run start
    n_forwards: int = 0
    emitted: list[int] = field(default_factory=list)  # token ids emitted at this step
    text: str = ""                   # their text
    route: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None   # cost-aware drafting's plan for this step's forward (a `plan` event)
    kv: list[dict[str, Any]] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)
    n_events: int = 0
    eos_pos: int | None = None       # the first EOS the canvas holds after this step: the cells after it are padding

    @property
    def refreshes(self) -> list[tuple[int, int]]:
        """The KV slot ranges [from, to) an approximate cache recomputed at this step (the KV length stays)."""
        return [(k["from_len"], k["to_len"]) for k in self.kv if k["op"] == "refresh"]


@dataclass
class BlockSpan:
    start: int
    end: int                 # exclusive
    open_step: int
    close_step: int | None   # None: still open at the end of the trace


@dataclass
class Segment:
    """A piece of the final text with the provenance of its token(s), for per-token colouring."""
    text: str
    positions: tuple[int, ...]
    state: State
    step: int


@dataclass
class Grid:
    steps: list[int]
    n_pos: int
    cells: dict[tuple[int, int], Cell]   # only non-empty cells
    rows: dict[int, Row] = field(default_factory=dict)
    blocks: list[BlockSpan] = field(default_factory=list)
    final: dict[int, Cell] = field(default_factory=dict)   # emitted positions: token, text, provenance
    segments: list[Segment] = field(default_factory=list)
    canvas: dict[str, int] | None = None   # the header's {length, block_size} of a canvas run

    def cell(self, step: int, pos: int) -> Cell:
        return self.cells.get((step, pos)) or _EMPTY

    def state(self, step: int, pos: int) -> State:
        return self.cell(step, pos).state

    def states(self) -> dict[tuple[int, int], State]:
        return {k: c.state for k, c in self.cells.items()}

    def row_cells(self, step: int) -> list[Cell]:
        return [self.cell(step, p) for p in range(self.n_pos)]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    def eos_before(self, pos: int, step: int | None = None) -> int | None:
        """The EOS position `pos` is padding after, as of `step` (default: the last), or None."""
        steps = [s for s in self.steps if step is None or s <= step]
        eos = self.rows[steps[-1]].eos_pos if steps else None
        return eos if eos is not None and pos > eos else None

    def fill_history(self, pos: int, upto_step: int | None = None) -> list[str]:
        """When the token at `pos` was filled (step, confidence), edited (old → new, confidence) and remasked, up to
        `upto_step`: one line each, oldest first (an inspector's summary of a canvas cell)."""
        lines = []
        for step in self.steps:
            if upto_step is not None and step > upto_step:
                break
            c = self.cells.get((step, pos))
            if c is None or not c.kinds:
                continue
            conf = f" (conf {_fmt(c.conf)})" if c.conf is not None else ""
            if "unmask" in c.kinds:
                lines.append(f"filled at step {step}{conf}")
            if "edit" in c.kinds:
                lines.append(f"edited at step {step}: {_token(c.old, c.old_text)} → {_token(c.tok, c.text)}{conf}")
            if "remask" in c.kinds:
                lines.append(f"{'re-noised' if c.state is State.NOISE else 'remasked'} at step {step}")
        return lines


_EMPTY = Cell(State.EMPTY)   # what `Grid.cell` returns for a cell nothing filled


def _token(tok: int, text: str | None) -> str:
    """'12 "abc"' (the id, and the text when known)."""
    return f"{tok}" + (f" {show_text(text)}" if text is not None else "")


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def _ratio(p: float | None, q: float | None) -> float | None:
    """min(1, p/q): the chance a draft with these probabilities is accepted (None when one is unknown)."""
    if p is None or q is None:
        return None
    return 1.0 if q <= 0 else min(1.0, p / q)


def _probs(p: float | None, q: float | None, ratio: float | None) -> list[str]:
    """'p=0.9  q=1  min(1,p/q)=0.9', or nothing when no number is known."""
    parts = [f"{k}={_fmt(v)}" for k, v in (("p", p), ("q", q), ("min(1,p/q)", ratio)) if v is not None]
    return ["  ".join(parts)] if parts else []


def visible_token(text: str | None, tok: int | None = None, limit: int = 9) -> str:
    """A token for a narrow label or cell: whitespace made visible (␣ ↵ ⇥ ␍), cut to `limit` characters
    with …; `#id` when the text is unknown."""
    if text is None:
        return f"#{tok}" if tok is not None else ""
    s = text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍") or "∅"
    return s if len(s) <= limit else s[: limit - 1] + "…"


def show_text(text: str | None) -> str:
    """A token's text with whitespace made visible (a JSON string literal), or '?' if unknown."""
    return "?" if text is None else json.dumps(text, ensure_ascii=False)

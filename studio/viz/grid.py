"""The trajectory grid: forward steps × output positions, built from trace events only.

Rows are steps (forward index, 0 = prefill), columns are output positions (0 = first new token).
A cell is the state of that position at that step: the strongest event that touched it at that step
(resample > reject > bonus > accept > edit > unmask > noise > propose > mask), or `committed` once the position
was emitted (from its emit step on, unless an event at that step says more). An unmasked (or edited) token still
waiting in a block is carried over with `held=True` until it is emitted (or a reject/resample at or before its
position, or a remask of it, invalidates it).

A canvas run (its header has `canvas: {length, block_size}`) shows every position of the canvas from the first
step: a cell nothing fills is `masked` (or `noise`, carried over from the remask that put a noise token there), a
`propose` is the model's current guess for a masked cell (shown at its step only), `unmask` fills it, `edit`
replaces a filled token. Once the canvas holds an EOS (filled or emitted), every cell after it is `padding`:
the run may still fill it, but it is never output.

Every consumer (plotly figures, Rich/plain text, the TUI, HTML) renders this one structure.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from studio.viz.palette import HOLDS, PRIORITY, State, glyph, label

TokenText = Callable[[int], str]


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


_EMPTY = Cell(State.EMPTY)
_MASKED = Cell(State.MASKED)


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


# -- token texts ------------------------------------------------------------------------------------
def _token_texts(emits: list[Mapping[str, Any]]) -> tuple[dict[int, str], dict[int, str]]:
    """Per-position and per-id texts from emit events.

    An emit's `text` covers all its tokens; per-token texts are known when the emit carries
    `pieces` (a list of str, one per token: an optional extra field), when it has one token, or by
    elimination: a multi-token emit where all tokens but one have a known text (from elsewhere in the
    trace) and the known ones match the text's prefix/suffix. Repeated to a fixpoint.
    """
    pos_text: dict[int, str] = {}
    id_text: dict[int, str] = {}
    pending: list[Mapping[str, Any]] = []
    for e in emits:
        pieces = e.get("pieces")
        if isinstance(pieces, list) and len(pieces) == len(e["tok"]) and all(isinstance(x, str) for x in pieces):
            pass
        elif len(e["tok"]) == 1:
            pieces = [e["text"]]
        else:
            pending.append(e)
            continue
        for p, t, s in zip(e["pos"], e["tok"], pieces):
            pos_text[p] = s
            id_text.setdefault(t, s)
    progress = True
    while pending and progress:
        progress = False
        rest = []
        for e in pending:
            toks, text = e["tok"], e["text"]
            unknown = [i for i, t in enumerate(toks) if t not in id_text]
            if len(unknown) > 1:
                rest.append(e)
                continue
            if not unknown:
                pieces = [id_text[t] for t in toks]
                if "".join(pieces) != text:
                    continue  # context-dependent decoding: leave these positions to the id table
            else:
                k = unknown[0]
                pre = "".join(id_text[t] for t in toks[:k])
                suf = "".join(id_text[t] for t in toks[k + 1:])
                if not (text.startswith(pre) and text.endswith(suf) and len(pre) + len(suf) <= len(text)):
                    continue
                middle = text[len(pre):len(text) - len(suf)]
                pieces = [id_text[t] if i != k else middle for i, t in enumerate(toks)]
                id_text[toks[k]] = middle
                progress = True
            for p, s in zip(e["pos"], pieces):
                pos_text[p] = s
        pending = rest
    return pos_text, id_text


# -- the grid ---------------------------------------------------------------------------------------
_EVENT_STATE = {"propose": State.PROPOSED, "accept": State.ACCEPTED, "reject": State.REJECTED,
                "resample": State.RESAMPLED, "bonus": State.BONUS, "unmask": State.UNMASKED, "edit": State.EDITED}
_PROVENANCE = (State.ACCEPTED, State.RESAMPLED, State.BONUS, State.UNMASKED, State.EDITED)


def _as_list(v: Any) -> list:
    return v if isinstance(v, list) else [v]


def _at(values: Any, i: int) -> Any:
    if isinstance(values, list):
        return values[i] if i < len(values) else None
    return values


def build_grid(header: Mapping[str, Any] | None, events: Iterable[Mapping[str, Any]],
               token_text: TokenText | None = None) -> Grid:
    """Build the trajectory grid from a trace's events. The header (optional) gives a canvas run's canvas, the
    EOS ids (padding after an EOS) and the MASK id (a remask to MASK, not noise). `token_text(id) -> str` decodes
    ids that no emit names."""
    events = list(events)
    builder = GridBuilder.of_events(events, token_text, header)
    builder.feed(events)
    return builder.grid


class GridBuilder:
    """Builds the grid step by step, for live views: `feed` the events of whole steps as a run produces
    them (a run's `advance()` hands out whole steps) and read `grid`, which grows in place.

    Token texts come from each step's emit events (their `pieces`) as they arrive, and `token_text` for
    ids no emit has named yet (proposals); `build_grid` passes the texts of the whole trace instead.
    """

    def __init__(self, token_text: TokenText | None = None,
                 texts: tuple[dict[int, str], dict[int, str]] | None = None,
                 header: Mapping[str, Any] | None = None):
        self.token_text = token_text
        self._live_texts = texts is None
        self.pos_text, self.id_text = texts if texts is not None else ({}, {})
        self.emitted_tok: dict[int, int] = {}
        canvas = (header or {}).get("canvas")
        canvas = dict(canvas) if isinstance(canvas, Mapping) and isinstance(canvas.get("length"), int) else None
        self.canvas_len = max(0, canvas["length"]) if canvas else 0
        self.grid = Grid(steps=[], n_pos=self.canvas_len, cells={}, canvas=canvas)
        tokenizer = (header or {}).get("tokenizer") or {}
        self.eos_ids = frozenset(tokenizer.get("eos_ids") or ())
        self.mask_id = tokenizer.get("mask_id")
        self._decoded: dict[int, str | None] = {}
        self._open_blocks: list[BlockSpan] = []
        self._committed: dict[int, Cell] = {}   # pos -> the shared committed cell shown after its emit step
        self._held: dict[int, Cell] = {}        # pos -> unmasked or edited, not yet emitted
        self._noise: dict[int, Cell] = {}       # pos -> the noise token a remask left there (canvas runs)
        self._eos_emitted: int | None = None    # the first emitted EOS

    @classmethod
    def of_events(cls, events: list[Mapping[str, Any]], token_text: TokenText | None = None,
                  header: Mapping[str, Any] | None = None) -> "GridBuilder":
        """An empty builder that already knows the token texts of all `events` (a whole trace): feed it those
        events, at once or step by step."""
        emits = [e for e in events if e["t"] == "emit"]
        builder = cls(token_text, _token_texts(emits), header)
        builder.emitted_tok.update((p, t) for e in emits for p, t in zip(e["pos"], e["tok"]))
        return builder

    def feed(self, events: Iterable[Mapping[str, Any]]) -> list[int]:
        """Add events (whole steps, in step order); returns the steps added."""
        by_step: dict[int, list[Mapping[str, Any]]] = {}
        for e in events:
            by_step.setdefault(e["step"], []).append(e)
        for step in sorted(by_step):
            self._add_step(step, by_step[step])
        return sorted(by_step)

    def _text_of(self, pos: int | None, tok: int | None) -> str | None:
        if tok is None:
            return None
        if pos is not None and pos in self.pos_text and self.emitted_tok.get(pos) == tok:
            return self.pos_text[pos]
        if tok in self.id_text:
            return self.id_text[tok]
        if self.token_text is not None:
            if tok not in self._decoded:
                try:
                    self._decoded[tok] = self.token_text(tok)
                except Exception:  # a decoder that cannot handle an id must not break a viewer
                    self._decoded[tok] = None
            return self._decoded[tok]
        return None

    def _add_step(self, step: int, step_events: list[Mapping[str, Any]]) -> None:
        g = self.grid
        committed, held, noise, final, segments = self._committed, self._held, self._noise, g.final, g.segments
        text_of = self._text_of
        if step not in g.rows:
            g.steps.append(step)
        row = g.rows[step] = Row(step)
        emits_now = [e for e in step_events if e["t"] == "emit"]
        for e in emits_now:
            for p, t in zip(e["pos"], e["tok"]):
                self.emitted_tok[p] = t
        if self._live_texts:
            for p, t in _token_texts(emits_now)[0].items():
                self.pos_text[p] = t
                self.id_text.setdefault(self.emitted_tok[p], t)
        for e in step_events:
            if "pos" in e and e["t"] != "block":
                ps = _as_list(e["pos"])
                if ps:
                    g.n_pos = max(g.n_pos, max(ps) + 1)
        touched: dict[int, dict[str, Any]] = {}
        emitted_now: dict[int, int] = {}

        def touch(pos: int, kind: str, st: State, **info: Any) -> None:
            c = touched.setdefault(pos, {"state": None, "kinds": []})
            c["kinds"].append(kind)
            if kind == "reject":   # the draft's numbers; the correction that replaces it has none
                c["draft_tok"], c["draft_p"], c["draft_q"] = info.pop("tok"), info.pop("p"), info.pop("q")
                c.pop("q", None)   # the proposal's q, now the draft's
            wins = c["state"] is None or PRIORITY[st] >= PRIORITY[c["state"]]
            if st is State.NOISE and c["state"] is State.PROPOSED:
                c["guess"] = c["tok"]   # the noise the canvas holds after the step shows; the guess is kept beside it
            elif kind == "propose" and c["state"] is State.NOISE:
                c["guess"] = info["tok"]
            if "tok" in info and wins:
                c["tok"] = info.pop("tok")
            info.pop("tok", None)
            c.update((k, v) for k, v in info.items() if v is not None)
            if c["state"] is None or PRIORITY[st] > PRIORITY[c["state"]]:
                c["state"] = st

        for e in step_events:
            t = e["t"]
            row.n_events += 1
            row.ms = e["ms"] if row.ms is None or (e["ms"] is not None and e["ms"] > row.ms) else row.ms
            if t == "forward":
                row.n_forwards += 1
                if row.role is None:
                    row.role = e["role"]
                row.n_tokens += e["n_tokens"]
                row.lora_rows += e["lora_rows"]
                if e["wall_ms"] is not None:
                    row.wall_ms = (row.wall_ms or 0.0) + e["wall_ms"]
            elif t == "propose":
                for i, p in enumerate(e["pos"]):
                    touch(p, t, State.PROPOSED, tok=e["tok"][i], q=_at(e["q"], i), src=e["src"])
            elif t == "accept":
                for i, p in enumerate(e["pos"]):
                    touch(p, t, State.ACCEPTED, tok=e["tok"][i], p=_at(e["p"], i), q=_at(e["q"], i))
            elif t == "reject":
                touch(e["pos"], t, State.REJECTED, tok=e["tok"], p=e["p"], q=e["q"])
            elif t in ("resample", "bonus"):
                touch(e["pos"], t, _EVENT_STATE[t], tok=e["tok"])
            elif t == "unmask":
                for i, p in enumerate(e["pos"]):
                    touch(p, t, State.UNMASKED, tok=e["tok"][i], conf=_at(e["conf"], i), filled_step=step)
            elif t == "edit":
                for i, p in enumerate(e["pos"]):
                    touch(p, t, State.EDITED, tok=e["tok"][i], old=e["old"][i], conf=_at(e["conf"], i),
                          filled_step=step)
            elif t == "remask":
                for p, tok in zip(e["pos"], e["tok"]):
                    touch(p, t, State.MASKED if tok == self.mask_id else State.NOISE, tok=tok)
            elif t == "emit":
                for p, tok in zip(e["pos"], e["tok"]):
                    emitted_now[p] = tok
                row.emitted.extend(e["tok"])
                row.text += e["text"]
            elif t == "block":
                row.blocks.append(dict(e))
                if e["op"] == "open":
                    span = BlockSpan(e["start"], e["end"], step, None)
                    g.blocks.append(span)
                    self._open_blocks.append(span)
                else:
                    for span in self._open_blocks:
                        if span.start == e["start"] and span.end == e["end"]:
                            span.close_step = step
                            self._open_blocks.remove(span)
                            break
                    else:  # a close without a matching open: still show the span
                        g.blocks.append(BlockSpan(e["start"], e["end"], step, step))
            elif t == "route":
                row.route = {"verify": e["verify"], "score": e["score"], "policy": e["policy"]}
            elif t == "plan":
                row.plan = {"drafts": e["drafts"], "max_drafts": e["max_drafts"], "gain": e["gain"]}
            elif t == "kv":
                row.kv.append({"op": e["op"], "from_len": e["from_len"], "to_len": e["to_len"]})
            # unknown kinds (a future minor version) are ignored here

        cells: dict[int, Cell] = {}   # this step's row
        # cells touched at this step
        for pos, c in touched.items():
            state = c["state"]
            tok = c.get("tok", emitted_now.get(pos))
            emitted = pos in emitted_now
            if emitted and state is State.PROPOSED:
                state = State.COMMITTED
            if emitted:
                tok = emitted_now[pos]
            draft, old, guess = c.get("draft_tok"), c.get("old"), c.get("guess")
            cell = Cell(state, tok=tok, text=text_of(pos, tok), p=c.get("p"), q=c.get("q"), conf=c.get("conf"),
                        draft_tok=draft, draft_text=text_of(None, draft), draft_p=c.get("draft_p"),
                        draft_q=c.get("draft_q"), src=c.get("src"),
                        kinds=tuple(c["kinds"]) + (("emit",) if emitted else ()), emitted=emitted,
                        committed_step=step if emitted else None, filled_step=c.get("filled_step"),
                        old=old, old_text=text_of(None, old), guess=guess, guess_text=text_of(None, guess))
            if cell.filled_step is None and pos in held and state not in (State.MASKED, State.NOISE):
                cell.filled_step = held[pos].filled_step   # e.g. the emit of a token filled earlier
            cells[pos] = cell
            if state in (State.MASKED, State.NOISE):   # a remask: the filled token is gone
                held.pop(pos, None)
                noise.pop(pos, None)
                if state is State.NOISE:
                    noise[pos] = replace(cell, kinds=(), guess=None, guess_text=None, q=None, src=None)
            elif state in HOLDS and not emitted:
                noise.pop(pos, None)
                if pos not in committed:
                    held[pos] = cell
            elif state in (State.REJECTED, State.RESAMPLED):
                # a rejection invalidates this position and every held token after it
                for p in [p for p in held if p >= pos]:
                    del held[p]
        # emitted without another event at this step
        for pos, tok in emitted_now.items():
            if pos not in touched:
                cells[pos] = Cell(State.COMMITTED, tok=tok, text=text_of(pos, tok), kinds=("emit",), emitted=True,
                                  committed_step=step, filled_step=held[pos].filled_step if pos in held else None)
        # provenance of what became final at this step
        for pos, tok in emitted_now.items():
            here = cells[pos]
            if here.state in _PROVENANCE:
                prov, src = here.state, here
            elif pos in held and held[pos].tok == tok:
                prov, src = held[pos].state, held[pos]
            else:
                prov, src = State.COMMITTED, here
            final[pos] = replace(src, state=prov, tok=tok, text=text_of(pos, tok), emitted=True, held=False,
                                 committed_step=step)
            held.pop(pos, None)
            noise.pop(pos, None)
            committed[pos] = Cell(State.COMMITTED, tok=tok, text=text_of(pos, tok), committed_step=step)
            if tok in self.eos_ids and (self._eos_emitted is None or pos < self._eos_emitted):
                self._eos_emitted = pos
        # carried-over cells: committed positions, held tokens, the noise or MASK of a canvas's other positions
        for pos, cell in committed.items():
            cells.setdefault(pos, cell)
        for pos, cell in held.items():
            if pos not in cells:
                cells[pos] = replace(cell, held=True, kinds=(), emitted=False)
        for pos in range(self.canvas_len):
            if pos not in cells:
                cells[pos] = noise.get(pos, _MASKED)
        # padding: every cell after the first EOS the canvas holds (emitted, or filled and held)
        eos = [p for p, c in held.items() if c.tok in self.eos_ids] if self.eos_ids else []
        if self._eos_emitted is not None:
            eos.append(self._eos_emitted)
        if eos:
            row.eos_pos = first = min(eos)
            for pos, cell in cells.items():
                if pos > first:
                    cells[pos] = replace(cell, state=State.PADDING, held=False)
        g.cells.update(((step, pos), cell) for pos, cell in cells.items())
        # text segments, one per token when the token's text is known, else one per emit event
        pos_text = self.pos_text
        for e in emits_now:
            ps = e["pos"]
            if all(p in pos_text for p in ps) and "".join(pos_text[p] for p in ps) == e["text"]:
                for p in ps:
                    segments.append(Segment(pos_text[p], (p,), final[p].state, step))
            elif ps:
                counts = Counter(final[p].state for p in ps)
                top = max(counts.items(), key=lambda kv: (kv[1], PRIORITY[kv[0]]))[0]
                segments.append(Segment(e["text"], tuple(ps), top, step))
            elif e["text"]:
                segments.append(Segment(e["text"], (), State.COMMITTED, step))

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

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from studio.viz.grid_model import BlockSpan, Cell, Grid, Row, Segment, show_text, visible_token
from studio.viz.palette import HOLDS, PRIORITY, State

# The grid's types live in grid_model; every viewer imports them, the builder and the token helpers from here.
__all__ = ["BlockSpan", "Cell", "Grid", "GridBuilder", "Row", "Segment", "TokenText", "build_grid", "show_text",
           "visible_token"]

TokenText = Callable[[int], str]


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
_PROVENANCE = (State.ACCEPTED, State.RESAMPLED, State.BONUS, State.UNMASKED, State.EDITED)
_MASKED = Cell(State.MASKED)


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


@dataclass
class _Step:
    """One step being added: its row, and what its events said about each position before the cells are made
    (`touched`: the strongest state and the merged fields of the events that touched it; `emitted`: pos -> token)."""
    step: int
    row: Row
    touched: dict[int, dict[str, Any]] = field(default_factory=dict)
    emitted: dict[int, int] = field(default_factory=dict)
    tree: dict[int, list[tuple[int, int]]] = field(default_factory=dict)   # pos -> a draft tree's (node, token)s
    on_path: set[int] = field(default_factory=set)                         # the tree's accepted nodes
    refused: set[int] = field(default_factory=set)                         # and the ones its walk refused

    def verdict(self, node: int) -> str:
        """A tree candidate's fate: on the accepted path, refused by the walk, or pruned (never reached)."""
        return "accepted path" if node in self.on_path else "refused" if node in self.refused else "pruned"

    def touch(self, pos: int, kind: str, st: State, **info: Any) -> None:
        """Event `kind` put `pos` in state `st`: the strongest state (PRIORITY) wins, its token with it; the
        other fields of every event that touched the position are kept."""
        c = self.touched.setdefault(pos, {"state": None, "kinds": []})
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
        """Read one step's events (a handler per kind, `_ON_EVENT`), then make its row of cells: the touched ones,
        the emitted ones, the provenance of what became final, the carried-over cells, padding after an EOS."""
        if step not in self.grid.rows:
            self.grid.steps.append(step)
        s = _Step(step, Row(step))
        self.grid.rows[step] = s.row
        emits = [e for e in step_events if e["t"] == "emit"]
        self._learn_emits(emits)
        self._widen(step_events)
        for e in step_events:
            s.row.n_events += 1
            if s.row.ms is None or (e["ms"] is not None and e["ms"] > s.row.ms):
                s.row.ms = e["ms"]
            handler = _ON_EVENT.get(e["t"])
            if handler is not None:   # unknown kinds (a future minor version) are ignored here
                handler(self, s, e)
        cells: dict[int, Cell] = {}   # this step's row
        for pos, c in s.touched.items():   # in order: a rejection drops the held tokens after it
            cells[pos] = self._touched_cell(s, pos, c)
            self._carry_forward(pos, cells[pos])
        for pos, tok in s.emitted.items():   # emitted without another event at this step
            if pos not in s.touched:
                cells[pos] = Cell(State.COMMITTED, tok=tok, text=self._text_of(pos, tok), kinds=("emit",),
                                  emitted=True, committed_step=step, filled_step=self._held_filled_step(pos))
        self._record_final(s, cells)
        self._carry_over(cells)
        self._pad_after_eos(s.row, cells)
        self.grid.cells.update(((step, pos), cell) for pos, cell in cells.items())
        self._add_segments(step, emits)

    def _learn_emits(self, emits: list[Mapping[str, Any]]) -> None:
        """The tokens this step emits, and (live) their texts."""
        for e in emits:
            for p, t in zip(e["pos"], e["tok"]):
                self.emitted_tok[p] = t
        if self._live_texts:
            for p, t in _token_texts(emits)[0].items():
                self.pos_text[p] = t
                self.id_text.setdefault(self.emitted_tok[p], t)

    def _widen(self, step_events: list[Mapping[str, Any]]) -> None:
        """Grow the grid to the furthest position an event names (a block's span is not a position)."""
        for e in step_events:
            if "pos" in e and e["t"] != "block":
                ps = _as_list(e["pos"])
                if ps:
                    self.grid.n_pos = max(self.grid.n_pos, max(ps) + 1)

    # -- one handler per event kind: what the event says about its positions (`_Step.touch`) or its row
    def _on_forward(self, s: _Step, e: Mapping[str, Any]) -> None:
        row = s.row
        row.n_forwards += 1
        if row.role is None:
            row.role = e["role"]
        row.n_tokens += e["n_tokens"]
        row.lora_rows += e["lora_rows"]
        if e["wall_ms"] is not None:
            row.wall_ms = (row.wall_ms or 0.0) + e["wall_ms"]

    def _on_propose(self, s: _Step, e: Mapping[str, Any]) -> None:
        for i, p in enumerate(e["pos"]):
            if e.get("parent") is not None:   # a draft tree (schema 1.3): siblings share a position
                s.tree.setdefault(p, []).append((i, e["tok"][i]))
                if len(s.tree[p]) > 1:        # the cell shows the first candidate; the rest are its branches
                    continue
            s.touch(p, "propose", State.PROPOSED, tok=e["tok"][i], q=_at(e["q"], i), src=e["src"])

    def _on_accept(self, s: _Step, e: Mapping[str, Any]) -> None:
        s.on_path.update(e.get("node") or ())
        for i, p in enumerate(e["pos"]):
            s.touch(p, "accept", State.ACCEPTED, tok=e["tok"][i], p=_at(e["p"], i), q=_at(e["q"], i))

    def _on_reject(self, s: _Step, e: Mapping[str, Any]) -> None:
        if e.get("node") is not None:   # a tree's refused candidate: its cell keeps the path's token, or the first
            s.refused.add(e["node"])    # refusal there (the rest are its branches)
            kinds = s.touched.get(e["pos"], {}).get("kinds", ())
            if "accept" in kinds or "reject" in kinds:
                return
        s.touch(e["pos"], "reject", State.REJECTED, tok=e["tok"], p=e["p"], q=e["q"])

    def _on_resample(self, s: _Step, e: Mapping[str, Any]) -> None:
        s.touch(e["pos"], "resample", State.RESAMPLED, tok=e["tok"])

    def _on_bonus(self, s: _Step, e: Mapping[str, Any]) -> None:
        s.touch(e["pos"], "bonus", State.BONUS, tok=e["tok"])

    def _on_unmask(self, s: _Step, e: Mapping[str, Any]) -> None:
        for i, p in enumerate(e["pos"]):
            s.touch(p, "unmask", State.UNMASKED, tok=e["tok"][i], conf=_at(e["conf"], i), filled_step=s.step)

    def _on_edit(self, s: _Step, e: Mapping[str, Any]) -> None:
        for i, p in enumerate(e["pos"]):
            s.touch(p, "edit", State.EDITED, tok=e["tok"][i], old=e["old"][i], conf=_at(e["conf"], i),
                    filled_step=s.step)

    def _on_remask(self, s: _Step, e: Mapping[str, Any]) -> None:
        for p, tok in zip(e["pos"], e["tok"]):
            s.touch(p, "remask", State.MASKED if tok == self.mask_id else State.NOISE, tok=tok)

    def _on_emit(self, s: _Step, e: Mapping[str, Any]) -> None:
        for p, tok in zip(e["pos"], e["tok"]):
            s.emitted[p] = tok
        s.row.emitted.extend(e["tok"])
        s.row.text += e["text"]

    def _on_block(self, s: _Step, e: Mapping[str, Any]) -> None:
        s.row.blocks.append(dict(e))
        if e["op"] == "open":
            span = BlockSpan(e["start"], e["end"], s.step, None)
            self.grid.blocks.append(span)
            self._open_blocks.append(span)
            return
        for span in self._open_blocks:
            if span.start == e["start"] and span.end == e["end"]:
                span.close_step = s.step
                self._open_blocks.remove(span)
                return
        self.grid.blocks.append(BlockSpan(e["start"], e["end"], s.step, s.step))   # a close without an open: show it

    def _on_route(self, s: _Step, e: Mapping[str, Any]) -> None:
        s.row.route = {"verify": e["verify"], "score": e["score"], "policy": e["policy"]}

    def _on_plan(self, s: _Step, e: Mapping[str, Any]) -> None:
        s.row.plan = {"drafts": e["drafts"], "max_drafts": e["max_drafts"], "gain": e["gain"]}

    def _on_kv(self, s: _Step, e: Mapping[str, Any]) -> None:
        s.row.kv.append({"op": e["op"], "from_len": e["from_len"], "to_len": e["to_len"]})

    # -- from what the events said to the step's cells
    def _held_filled_step(self, pos: int) -> int | None:
        """The step the token held at `pos` was filled at (None: nothing held there)."""
        return self._held[pos].filled_step if pos in self._held else None

    def _touched_cell(self, s: _Step, pos: int, c: dict[str, Any]) -> Cell:
        """The cell of a position an event touched at this step (`c`: what the events said about it)."""
        text_of = self._text_of
        emitted = pos in s.emitted
        state = State.COMMITTED if emitted and c["state"] is State.PROPOSED else c["state"]
        tok = s.emitted[pos] if emitted else c.get("tok")
        draft, old, guess = c.get("draft_tok"), c.get("old"), c.get("guess")
        cell = Cell(state, tok=tok, text=text_of(pos, tok), p=c.get("p"), q=c.get("q"), conf=c.get("conf"),
                    draft_tok=draft, draft_text=text_of(None, draft), draft_p=c.get("draft_p"),
                    draft_q=c.get("draft_q"), src=c.get("src"),
                    kinds=tuple(c["kinds"]) + (("emit",) if emitted else ()), emitted=emitted,
                    committed_step=s.step if emitted else None, filled_step=c.get("filled_step"),
                    old=old, old_text=text_of(None, old), guess=guess, guess_text=text_of(None, guess),
                    branches=tuple((t, text_of(None, t), s.verdict(node)) for node, t in s.tree.get(pos, ())
                                   if len(s.tree[pos]) > 1))
        if cell.filled_step is None and state not in (State.MASKED, State.NOISE):
            cell.filled_step = self._held_filled_step(pos)   # e.g. the emit of a token filled earlier
        return cell

    def _carry_forward(self, pos: int, cell: Cell) -> None:
        """What `cell` leaves for later steps: a filled token held until emitted, a remask's noise, or neither."""
        held, noise = self._held, self._noise
        if cell.state in (State.MASKED, State.NOISE):   # a remask: the filled token is gone
            held.pop(pos, None)
            noise.pop(pos, None)
            if cell.state is State.NOISE:
                noise[pos] = replace(cell, kinds=(), guess=None, guess_text=None, q=None, src=None)
        elif cell.state in HOLDS and not cell.emitted:
            noise.pop(pos, None)
            if pos not in self._committed:
                held[pos] = cell
        elif cell.state in (State.REJECTED, State.RESAMPLED):
            # a rejection invalidates this position and every held token after it
            for p in [p for p in held if p >= pos]:
                del held[p]

    def _record_final(self, s: _Step, cells: dict[int, Cell]) -> None:
        """The provenance of what became final at this step, and the committed cells later steps show."""
        for pos, tok in s.emitted.items():
            here, held = cells[pos], self._held.get(pos)
            if here.state in _PROVENANCE:
                prov, src = here.state, here
            elif held is not None and held.tok == tok:   # filled at an earlier step, emitted now
                prov, src = held.state, held
            else:
                prov, src = State.COMMITTED, here
            text = self._text_of(pos, tok)
            self.grid.final[pos] = replace(src, state=prov, tok=tok, text=text, emitted=True, held=False,
                                           committed_step=s.step)
            self._held.pop(pos, None)
            self._noise.pop(pos, None)
            self._committed[pos] = Cell(State.COMMITTED, tok=tok, text=text, committed_step=s.step)
            if tok in self.eos_ids and (self._eos_emitted is None or pos < self._eos_emitted):
                self._eos_emitted = pos

    def _carry_over(self, cells: dict[int, Cell]) -> None:
        """The cells no event touched: committed positions, held tokens, the noise or MASK of a canvas's others."""
        for pos, cell in self._committed.items():
            cells.setdefault(pos, cell)
        for pos, cell in self._held.items():
            if pos not in cells:
                cells[pos] = replace(cell, held=True, kinds=(), emitted=False)
        for pos in range(self.canvas_len):
            if pos not in cells:
                cells[pos] = self._noise.get(pos, _MASKED)

    def _pad_after_eos(self, row: Row, cells: dict[int, Cell]) -> None:
        """Padding: every cell after the first EOS the canvas holds (emitted, or filled and held)."""
        eos = [p for p, c in self._held.items() if c.tok in self.eos_ids] if self.eos_ids else []
        if self._eos_emitted is not None:
            eos.append(self._eos_emitted)
        if eos:
            row.eos_pos = first = min(eos)
            for pos, cell in cells.items():
                if pos > first:
                    cells[pos] = replace(cell, state=State.PADDING, held=False)

    def _add_segments(self, step: int, emits: list[Mapping[str, Any]]) -> None:
        """Text segments, one per token when the token's text is known, else one per emit event."""
        pos_text, final, segments = self.pos_text, self.grid.final, self.grid.segments
        for e in emits:
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


_ON_EVENT: dict[str, Callable[[GridBuilder, _Step, Mapping[str, Any]], None]] = {
    "forward": GridBuilder._on_forward, "propose": GridBuilder._on_propose, "accept": GridBuilder._on_accept,
    "reject": GridBuilder._on_reject, "resample": GridBuilder._on_resample, "bonus": GridBuilder._on_bonus,
    "unmask": GridBuilder._on_unmask, "edit": GridBuilder._on_edit, "remask": GridBuilder._on_remask,
    "emit": GridBuilder._on_emit, "block": GridBuilder._on_block, "route": GridBuilder._on_route,
    "plan": GridBuilder._on_plan, "kv": GridBuilder._on_kv,
}

"""The live token grid: one fixed-width cell per output position, styled by its state at one step.

Position p always sits at row p // per_row, column p % per_row, so nothing reflows while a run decodes:
proposals appear ahead of the committed text in their own cells and then snap in (accepted, resampled)
or vanish (rejected). A canvas run shows its whole canvas from the first step: masked cells ahead, the model's
guesses in them, filled and edited tokens, noise, and the padding after an early EOS. Each cell is a
block-boundary mark, the state's glyph (colour is never the only cue; NO_COLOR keeps the glyphs) and the token's
text with whitespace made visible (none in a masked cell).
"""
from __future__ import annotations

from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from studio.viz.grid import Grid, visible_token
from studio.viz.palette import RICH_FG, RICH_STYLE, State

CELL = 8           # mark + glyph + 6 characters of token text
TEXT_WIDTH = CELL - 2
BLOCK_MARK = "▏"
# committed tokens read as plain text; every other state is a coloured cell
CELL_STYLE = {s: ("" if s is State.COMMITTED else RICH_STYLE[s]) for s in State}
NO_TEXT = (State.EMPTY, State.MASKED)   # nothing to read in these (a remask to MASK shows the MASK, not its id)


@lru_cache(maxsize=None)
def _style(text: str) -> Style:
    return Style.parse(text) if text else Style()


class TokenGrid(Widget, can_focus=True):
    """Shows `grid` at `step` (None: its latest step). Arrow keys move a cursor over positions."""

    BINDINGS = [
        Binding("left", "move(-1)", "prev token", show=False, id="grid.left"),
        Binding("right", "move(1)", "next token", show=False, id="grid.right"),
        Binding("up", "move_row(-1)", "row up", show=False, id="grid.up"),
        Binding("down", "move_row(1)", "row down", show=False, id="grid.down"),
        Binding("home", "jump(0)", "first token", show=False, id="grid.home"),
        Binding("end", "jump(-1)", "last token", show=False, id="grid.end"),
    ]
    DEFAULT_CSS = """
    TokenGrid { height: auto; min-height: 1; }
    """

    cursor: reactive[int | None] = reactive(None)

    class CursorMoved(Message):
        def __init__(self, grid: "TokenGrid", pos: int | None) -> None:
            super().__init__()
            self.grid, self.pos = grid, pos

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes)
        self.grid: Grid | None = None
        self.step: int | None = None
        self._rows = 0
        self._width = 0   # the width `_rows` was reserved for
        self._row_cache: dict[int, tuple[tuple, Strip]] = {}

    def show(self, grid: Grid | None, step: int | None = None) -> None:
        self.grid, self.step = grid, step
        if grid is not None and self.cursor is not None and self.cursor >= grid.n_pos:
            self.cursor = grid.n_pos - 1 if grid.n_pos else None
        rows = self._needed_rows(self.size.width)
        if rows > self._rows or (self.step is not None and rows != self._rows):
            # a new row needs a layout pass (two at once while decoding), a changed cell only a repaint
            self._rows = rows if self.step is not None else rows + 2
            self.refresh(layout=True)
        else:
            self.refresh()

    @property
    def shown_step(self) -> int | None:
        if self.grid is None or not self.grid.steps:
            return None
        return self.grid.steps[-1] if self.step is None else self.step

    def per_row(self) -> int:
        return max(1, self.size.width // CELL)

    def _needed_rows(self, width: int) -> int:
        n = self.grid.n_pos if self.grid else 0
        return max(1, -(-n // max(1, width // CELL)))

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(self._needed_rows(width), self._rows)

    def on_resize(self, event: events.Resize) -> None:
        """A new width puts a new number of cells in a row: the rows reserved for the old width (many when it
        was narrow) would leave the scroll offset past the end, showing blank rows. Size for this width and
        bring the cursor, or the end of the output, back into view. (A new height is only the grid growing.)"""
        if event.size.width == self._width:
            return
        self._width = event.size.width
        self._rows = self._needed_rows(event.size.width)
        self.refresh(layout=True)
        if self._n():
            row = (self.cursor if self.cursor is not None else self._n() - 1) // self.per_row()
            self.call_after_refresh(self.reveal_row, row)

    def _block_marks(self, step: int) -> dict[int, str]:
        """pos -> style of a block boundary mark at that position (the open block's are bold)."""
        marks: dict[int, str] = {}
        for b in self.grid.blocks:
            if b.open_step > step:
                continue
            is_open = b.close_step is None or b.close_step > step
            style = "bold #E69F00" if is_open else "grey50"
            for p in (b.start, b.end):
                if is_open or p not in marks:
                    marks[p] = style
        return marks

    def render_line(self, y: int) -> Strip:
        """Row y of cells. Rows are cached by what they show, so a frame rebuilds only the rows whose
        cells changed (the open end of the output), however long the output is."""
        grid, step = self.grid, self.shown_step
        if grid is None or step is None or not grid.n_pos:
            return Strip([Segment("(no tokens yet)", _style("dim"))]) if y == 0 else Strip.blank(self.size.width)
        per_row, marks = self.per_row(), self._block_marks(step)
        cells = []
        for p in range(y * per_row, min(grid.n_pos, (y + 1) * per_row)):
            cell = grid.cell(step, p)
            style = RICH_FG[cell.state] if cell.held else CELL_STYLE[cell.state]
            if p == self.cursor:
                style = f"{style} reverse" if style else "reverse"
            label = visible_token(cell.text, cell.tok, TEXT_WIDTH) if cell.state not in NO_TEXT else ""
            if cell.branches:   # a draft tree's branch point: its candidates' count after the shown token
                label = visible_token(cell.text, cell.tok, TEXT_WIDTH - 2) + f"⑂{min(len(cell.branches), 9)}"
            cells.append((BLOCK_MARK if p in marks else " ", marks.get(p, ""), f"{cell.glyph}{label:<{TEXT_WIDTH}}",
                          style))
        key = (per_row, tuple(cells))
        cached = self._row_cache.get(y)
        if cached is None or cached[0] != key:
            base = self.rich_style   # the widget's own colours under every cell (a plain committed token)
            segments = [seg for mark, mark_style, body, style in cells
                        for seg in (Segment(mark, base + _style(mark_style)), Segment(body, base + _style(style)))]
            cached = self._row_cache[y] = (key, Strip(segments))
        return cached[1]

    # -- cursor -------------------------------------------------------------------------------
    def watch_cursor(self, pos: int | None) -> None:
        self.refresh()
        self.post_message(self.CursorMoved(self, pos))
        if pos is not None:
            self.reveal_row(pos // self.per_row())

    def reveal_row(self, row: int) -> None:
        """Scroll the container holding the grid so that `row` is visible."""
        from textual.geometry import Region
        parent = self.parent
        if isinstance(parent, Widget) and parent.is_scrollable:
            parent.scroll_to_region(Region(0, self.virtual_region.y + row, 1, 1), animate=False)

    def _n(self) -> int:
        return self.grid.n_pos if self.grid else 0

    def action_move(self, delta: int) -> None:
        if self._n():
            self.cursor = min(self._n() - 1, max(0, (self.cursor if self.cursor is not None else -1) + delta))

    def action_move_row(self, delta: int) -> None:
        self.action_move(delta * self.per_row())

    def action_jump(self, pos: int) -> None:
        if self._n():
            self.cursor = pos % self._n()

"""The step inspector: the whole history of one output position, read off the grid's cells — when it was
proposed (by what, with q), verified (p, q, the acceptance ratio), unmasked (confidence), what replaced a
rejected draft, and which forward committed it. A canvas cell adds the model's guess at each step, when it was
filled or edited (old → new) and why, and whether it is padding after an EOS (never output)."""
from __future__ import annotations

from rich.text import Text

from studio.tui.widgets.live_text import LiveText
from studio.viz.grid import Grid, show_text
from studio.viz.palette import RICH_STYLE, State, label


def _num(v: float | None) -> str:
    return "—" if v is None else (f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}")


def position_history(grid: Grid, pos: int, upto_step: int | None = None) -> Text:
    out = Text()
    final = grid.final.get(pos)
    canvas = grid.canvas is not None
    eos = grid.eos_before(pos, upto_step)
    out.append(f"position {pos}", style="bold")
    if final is not None and (upto_step is None or final.committed_step <= upto_step):
        row = grid.rows.get(final.committed_step)
        role = f" {row.role}" if row and row.role else ""
        out.append(f"  {show_text(final.text)}  committed at step {final.committed_step}{role} forward")
        out.append(f" · {label(final.state)}", style="dim")
    elif eos is not None:
        out.append(f"  padding after the EOS at position {eos}: never output", style="bold")
    else:
        out.append("  not committed yet", style="dim")
    if canvas:
        for line in grid.fill_history(pos, upto_step):
            out.append(f"\n {line}")
    for step in grid.steps:
        if upto_step is not None and step > upto_step:
            break
        cell = grid.cells.get((step, pos))
        if cell is None or not cell.kinds:
            continue
        role = grid.rows[step].role or "-"
        out.append(f"\n step {step:>4} {role:<8}", style="dim")
        out.append(f"{cell.glyph} {cell.state.value:<9}", style=RICH_STYLE[cell.state] if cell.state is not State.COMMITTED else "")
        out.append(f" {show_text(cell.text)}")
        details = cell.reasons(canvas)
        if cell.src and not (canvas and "propose" in cell.kinds):
            details.append(f"by {cell.src}")
        if cell.p is not None:
            details.append(f"p={_num(cell.p)}")
        if cell.q is not None:
            details.append(f"q={_num(cell.q)}")
        if cell.ratio is not None:
            details.append(f"ratio={_num(cell.ratio)}")
        if cell.conf is not None:
            details.append(f"conf={_num(cell.conf)}")
        if cell.draft_tok is not None:   # the rejected draft's own numbers, never the correction's
            details.append(f"replaced rejected draft {show_text(cell.draft_text)}: p={_num(cell.draft_p)} "
                           f"q={_num(cell.draft_q)}")
        if details:
            out.append("  " + "  ".join(details), style="dim")
    return out


class Inspector(LiveText):
    """Shows `position_history` for the grid cursor's position."""

    DEFAULT_CSS = """
    Inspector { height: auto; max-height: 12; overflow-y: auto; }
    """

    def show(self, grid: Grid | None, pos: int | None, upto_step: int | None = None) -> None:
        if grid is None or pos is None or pos >= grid.n_pos:
            self.show_text(Text("inspector: move the cursor over the tokens (Tab to the grid, then ← → ↑ ↓)",
                                style="dim"))
            return
        self.show_text(position_history(grid, pos, upto_step))

"""The help overlay (? or F1): every key binding of the app and of the screen below, and the chat commands."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from studio.run.chat import HELP
from studio.tui.widgets.token_grid import TokenGrid
from studio.viz.palette import FORWARD_ROLES


def _keys(key: str) -> str:
    names = {"question_mark": "?", "full_stop": ".", "comma": ",", "plus": "+", "equals_sign": "=",
             "minus": "-", "left_square_bracket": "[", "right_square_bracket": "]", "escape": "esc"}
    return ", ".join(names.get(k.strip(), k.strip()) for k in key.split(","))


def two_columns(title: str, rows) -> Table:
    """A titled table of (key or name, what it does) rows."""
    t = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold #56B4E9", min_width=14)
    t.add_column()
    for name, meaning in rows:
        t.add_row(name, meaning)
    return t


def bindings_table(title: str, bindings) -> Table:
    """A key's tooltip where it has one: the footer's word for it is short enough for 80 columns."""
    return two_columns(title, [(_keys(b.key), b.tooltip or b.description) for b in bindings
                               if isinstance(b, Binding) and b.description])


def roles_table() -> Table:
    """What each forward role (the grid's rows, the metrics panel's "step N · role") does."""
    return two_columns("forward roles", FORWARD_ROLES.items())


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,f1,question_mark", "dismiss", "close", id="help.close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-width: 100%; max-height: 90%; border: thick $primary; background: $surface;
                                  padding: 1 2; }
    """

    def __init__(self, screen_bindings, screen_name: str):
        super().__init__()
        self.screen_bindings, self.screen_name = screen_bindings, screen_name

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(Text("dlm-studio · keys (Esc closes)", style="bold"))
            yield Static(bindings_table("everywhere", self.app.BINDINGS))
            yield Static(bindings_table(f"{self.screen_name} screen", self.screen_bindings))
            yield Static(bindings_table("token grid (Tab or ctrl+g to focus it)", TokenGrid.BINDINGS))
            yield Static(roles_table())
            yield Static(Text(HELP))

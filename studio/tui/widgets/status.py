"""The one-line status bar every screen has: what just happened, or what went wrong (in red)."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from studio.errors import BadInput


def error_line(e: BaseException) -> str:
    """One line for the status bar: BadInput as it is, anything else named as an internal error."""
    text = str(e) if isinstance(e, BadInput) else f"internal error: {type(e).__name__}: {e}"
    return " ".join(text.split())


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; padding: 0 1; background: $boost; }
    """

    def say(self, text: str, error: bool = False) -> None:
        """Show `text` on one line (newlines folded, the end cut with … when too long)."""
        line = Text(" ".join(text.split()), style="bold red" if error else "", no_wrap=True, overflow="ellipsis")
        self.set_class(error, "error")
        self.update(line, layout=False)

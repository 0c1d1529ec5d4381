"""The screens' key footer: on a terminal narrower than 100 columns it goes compact and leaves out the command
palette's key, so every key of an 80-column screen fits on its line (ctrl+p still opens the palette)."""
from __future__ import annotations

from textual import events
from textual.widgets import Footer

COMPACT_BELOW = 100   # columns


class KeyFooter(Footer):
    # a compact footer sets a key group's label against the next key ("+- speed^o open")
    DEFAULT_CSS = "KeyFooter.-compact FooterLabel { margin: 0 1 0 0; }"

    def on_resize(self, event: events.Resize) -> None:
        self.compact = event.size.width < COMPACT_BELOW
        self.show_command_palette = not self.compact

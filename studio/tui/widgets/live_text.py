"""Text redrawn every frame without re-laying-out the screen.

A Static's `update` lays the whole screen out again (tens of milliseconds of Python on a busy screen),
and the decode thread waits for the GIL meanwhile. `LiveText.show_text` asks for a layout only when the
text's height changes, so most frames are a repaint of this widget alone.
"""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class LiveText(Static):
    _height = -1

    def show_text(self, text: Text) -> bool:
        """Show `text`; True when its height changed (a layout pass was needed)."""
        width = self.content_region.width
        height = len(text.wrap(self.app.console, width)) if width > 0 else -1
        changed = height != self._height or height < 0
        self.update(text, layout=changed)
        self._height = height
        return changed

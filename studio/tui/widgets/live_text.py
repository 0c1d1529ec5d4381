"""Text redrawn every frame without re-laying-out the screen.

A Static's `update` lays the whole screen out again and re-renders every widget (tens of milliseconds of
Python on a busy screen), and the decode thread waits for the GIL meanwhile. `LiveText.show_text` asks
for a layout only when the text outgrows the height it has, and then grows by `grow_by` lines at once,
so most frames repaint this widget alone; `final=True` settles on the exact height.
"""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class LiveText(Static):
    def __init__(self, content="", *, grow_by: int = 0, id: str | None = None, classes: str | None = None):
        super().__init__(content, id=id, classes=classes)
        self.grow_by = grow_by
        self._height = -1
        self._shown: Text | None = None

    def show_text(self, text: Text, final: bool = False) -> bool:
        """Show `text`; True when the widget changed height (a layout pass). The same text again costs nothing."""
        if text == self._shown and not final:
            return False
        self._shown = text
        width = self.content_region.width
        needed = len(text.wrap(self.app.console, width)) if width > 0 else -1
        if needed < 0 or final or self.grow_by == 0:
            height = needed
        else:
            height = self._height if needed <= self._height else needed + self.grow_by
        changed = height != self._height or height < 0
        self._height = height
        self.update(text, layout=changed)
        return changed

    def get_content_height(self, container, viewport, width: int) -> int:
        natural = super().get_content_height(container, viewport, width)
        return max(natural, self._height)

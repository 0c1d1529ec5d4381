"""Widgets shared by the chat, compare and replay screens."""
from studio.tui.widgets.footer import KeyFooter
from studio.tui.widgets.inspector import Inspector
from studio.tui.widgets.metrics import MetricsPanel
from studio.tui.widgets.status import StatusBar
from studio.tui.widgets.token_grid import TokenGrid

__all__ = ["Inspector", "KeyFooter", "MetricsPanel", "StatusBar", "TokenGrid"]

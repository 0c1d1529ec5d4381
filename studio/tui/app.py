"""`dlm-studio tui`: the Textual studio. Chat is the first screen; F3 compare, F4 replay, F1 or ? help.

Bindings carry ids, so users can remap them in `$XDG_CONFIG_HOME/dlm-studio/keymap.toml`
(`"chat.stop" = "ctrl+x"`): terminals, tmux and shells take some keys for themselves.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from textual.app import App
from textual.binding import Binding

from studio.run.chat import ChatSession
from studio.events import Trace
from studio.tui.screens.chat import ChatScreen
from studio.tui.screens.compare import CompareScreen
from studio.tui.screens.help import HelpScreen
from studio.tui.screens.replay import ReplayScreen
from studio.run.worker import reserve_cores_for_drawing

CSS_PATH = Path(__file__).with_name("studio.tcss")


def keymap_path() -> Path:
    from platformdirs import user_config_dir
    return Path(user_config_dir("dlm-studio")) / "keymap.toml"


class StudioApp(App):
    CSS_PATH = CSS_PATH
    TITLE = "dlm-studio"
    BINDINGS = [
        Binding("f1,question_mark", "help", "help", id="app.help"),
        Binding("f2", "show('chat')", "chat", id="app.chat"),
        Binding("f3", "show('compare')", "compare", id="app.compare"),
        Binding("f4", "show('replay')", "replay", id="app.replay"),
        Binding("ctrl+q", "quit", "quit", id="app.quit"),
    ]

    def __init__(self, session: ChatSession | None, trace: Trace | None = None):
        super().__init__()
        self.session, self.trace = session, trace

    def on_mount(self) -> None:
        self._load_keymap()
        if self.session is not None:   # (a replay alone never imports torch)
            reserve_cores_for_drawing()
            self.install_screen(ChatScreen(self.session), "chat")
            self.install_screen(CompareScreen(self.session), "compare")
        self.install_screen(ReplayScreen(self.trace), "replay")
        self.push_screen("replay" if self.trace is not None or self.session is None else "chat")

    def _load_keymap(self) -> None:
        path = keymap_path()
        if not path.exists():
            return
        try:
            keymap = tomllib.loads(path.read_text())
            self.set_keymap({str(k): str(v) for k, v in keymap.items()})
        except (OSError, tomllib.TOMLDecodeError, ValueError) as e:
            self.notify(f"{path}: {e}", severity="error")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The key of the screen already shown is left out of the footer (and does nothing)."""
        return not (action == "show" and parameters and parameters[0] == self.screen.id)

    def action_show(self, name: str) -> None:
        if name in ("chat", "compare") and self.session is None:
            self.notify("no model loaded (started with --trace): run dlm-studio tui --model ... to chat",
                        severity="warning")
            return
        if self.screen.id != name:
            self.switch_screen(name)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(self.screen.BINDINGS, self.screen.id or ""))

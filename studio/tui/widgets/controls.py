"""Run controls: strategy/preset picker, N, τ, temperature, top-k, top-p, seed, max tokens, step mode.

The widget only reports what the user changed (`Controls.Changed`); the screen applies it to the chat's
`RunChoice`, which validates it, and marks a refused value with `invalid(...)`.
"""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Checkbox, Input, Label, Select

from studio.run.chat import RunChoice

# What the generic N and τ fields set for each strategy ("—": not used by it)
N_PARAM = {"isd": "stride", "r-isd": "stride", "jacobi": "block_size", "jacobi-mr": "block_size",
           "blockdiff": "block_size", "s2d2": "block_size", "simsd": "block_size"}
TAU_PARAM = {"isd": "tau", "r-isd": "tau", "blockdiff": "threshold", "s2d2": "threshold", "simsd": "threshold"}
# field id -> (label, RunChoice key; "N"/"tau" are resolved per strategy)
FIELDS = [("n", "N"), ("tau", "τ"), ("temperature", "temperature"), ("top_k", "top-k"), ("top_p", "top-p"),
          ("seed", "seed"), ("max_new_tokens", "max tokens")]


def choices() -> list[tuple[str, str]]:
    """(label, value) for the picker: every strategy, then every strategy preset."""
    from studio.engine.strategies import STRATEGIES
    from studio.presets import list_presets
    return [(name, name) for name in STRATEGIES] + [(f"{p} (preset)", p) for p in list_presets("strategies")]


class Controls(Vertical):
    DEFAULT_CSS = """
    Controls { height: auto; }
    Controls Horizontal { height: 1; }
    Controls Label { width: 13; }
    Controls Input { width: 1fr; height: 1; }
    Controls Checkbox { margin: 1 0 0 0; }
    Controls Input.-invalid { border: tall $error; }
    Controls Select { width: 1fr; }
    """

    class Changed(Message):
        """The user set `key` (a RunChoice setting, "strategy", "N" or "tau") to `value` (raw text)."""
        def __init__(self, key: str, value: str) -> None:
            super().__init__()
            self.key, self.value = key, value

    class StepMode(Message):
        def __init__(self, on: bool) -> None:
            super().__init__()
            self.on = on

    def __init__(self, choice: RunChoice, *, id: str | None = None):
        super().__init__(id=id)
        self.initial = choice

    def compose(self) -> ComposeResult:
        yield Select(choices(), value=self.initial.label, allow_blank=False, id="ctl-strategy", compact=True)
        for key, text in FIELDS:
            with Horizontal():
                yield Label(text)
                yield Input(id=f"ctl-{key}", compact=True)
        yield Checkbox("step mode (ctrl+t; ctrl+n steps)", id="ctl-step", compact=True)

    def sync(self, choice: RunChoice) -> None:
        """Show `choice`'s current values (after any change, so the fields never lie)."""
        strategy, settings = choice.build()
        select = self.query_one("#ctl-strategy", Select)
        with select.prevent(Select.Changed):
            select.value = choice.label
        params = strategy.header_params()
        values = {"n": params.get(N_PARAM.get(strategy.name, ""), "—"),
                  "tau": params.get(TAU_PARAM.get(strategy.name, ""), "—"),
                  "temperature": settings.sampling.temperature, "top_k": settings.sampling.top_k,
                  "top_p": settings.sampling.top_p, "seed": settings.seed, "max_new_tokens": settings.max_new_tokens}
        for key, _ in FIELDS:
            field = self.query_one(f"#ctl-{key}", Input)
            with field.prevent(Input.Changed):
                field.value = str(values[key])
            field.remove_class("-invalid")
            field.disabled = values[key] == "—"

    def invalid(self, key: str) -> None:
        self.query_one(f"#ctl-{key}", Input).add_class("-invalid")

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self.post_message(self.Changed("strategy", str(event.value)))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.post_message(self.Changed(event.input.id.removeprefix("ctl-"), event.value))

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        event.stop()
        self.post_message(self.StepMode(event.value))


def apply_change(choice: RunChoice, key: str, value: str) -> RunChoice:
    """The choice after one control change (BadInput when refused)."""
    from studio.run.config import parse_value
    if key == "strategy":
        return choice.use(value)
    strategy, _ = choice.build()
    if key in ("n", "tau"):
        key = (N_PARAM if key == "n" else TAU_PARAM).get(strategy.name, key)
    return choice.set(key, parse_value(value))

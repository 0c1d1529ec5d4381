"""Run controls: strategy/preset picker, N, τ, temperature, top-k, top-p, seed, max tokens, step mode.

N and τ are the strategy's parameters with those roles in its `Params` metadata (`param_specs`): isd's stride
and tau, a block strategy's block_size and threshold. A block size of 0 (take it from the model or the block
adapter) shows the size a run would use, asked of the strategy with the engine's config, e.g. `8 (adapter)`.

The widget only reports what the user changed (`Controls.Changed`); the screen applies it to the chat's
`RunConfig`, which validates it, and marks a refused value with `invalid(...)`.
"""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Checkbox, Input, Label, Select

from studio.engine.strategies.params import N, TAU, role_param
from studio.run.config import RunConfig

# (field id, label): a RunConfig setting, or N / TAU, the strategy parameter with that role
FIELDS = [(N, "N"), (TAU, "τ"), ("temperature", "temperature"), ("top_k", "top-k"), ("top_p", "top-p"),
          ("seed", "seed"), ("max_new_tokens", "max tokens")]
UNUSED = "—"   # shown for a role the strategy has no parameter for


def step_mode_label(on: bool) -> str:
    """Says on or off in words: the checkbox's mark alone looks the same both ways without colour."""
    return f"step mode {'ON ' if on else 'off'} (ctrl+t; ctrl+n steps)"


def choices(model_config=None) -> list[tuple[str, str]]:
    """(label, value) for the picker: every strategy, then the strategy presets made for the model (`presets_for`;
    every preset without a model)."""
    from studio.engine.strategies import STRATEGIES
    from studio.presets import list_presets
    from studio.run.config import presets_for
    presets = list_presets("strategies") if model_config is None else presets_for(model_config)
    return [(name, name) for name in STRATEGIES] + [(f"{p} (preset)", p) for p in presets]


class StepModeBox(Checkbox):
    """The step-mode checkbox, its box empty when off: a compact Checkbox draws its X either way, in colours a
    terminal may not tell apart."""

    def render(self):
        self.BUTTON_INNER = "X" if self.value else " "
        return super().render()


class Controls(Vertical):
    DEFAULT_CSS = """
    Controls { height: auto; }
    Controls Horizontal { height: 1; }
    Controls Label { width: 13; }
    Controls Input { width: 1fr; height: 1; }
    Controls Checkbox { margin: 1 0 0 0; }
    Controls Checkbox.-on { text-style: bold; }
    Controls Input.-invalid { border: tall $error; }
    Controls Select { width: 1fr; }
    """

    class Changed(Message):
        """The user set `key` (a RunConfig setting, "strategy", "N" or "tau") to `value` (raw text)."""
        def __init__(self, key: str, value: str) -> None:
            super().__init__()
            self.key, self.value = key, value

    class StepMode(Message):
        def __init__(self, on: bool) -> None:
            super().__init__()
            self.on = on

    def __init__(self, choice: RunConfig, model_config=None, *, id: str | None = None):
        super().__init__(id=id)
        self.initial, self.model_config = choice, model_config
        self._shown: dict[str, str] = {}   # field id -> the text sync put there

    def compose(self) -> ComposeResult:
        options = choices(self.model_config)
        if all(value != self.initial.label for _, value in options):   # a preset given by name for another model
            options.append((f"{self.initial.label} (preset)", self.initial.label))
        yield Select(options, value=self.initial.label, allow_blank=False, id="ctl-strategy", compact=True)
        for key, text in FIELDS:
            with Horizontal():
                yield Label(text)
                yield Input(id=f"ctl-{key}", compact=True)
        yield StepModeBox(step_mode_label(False), id="ctl-step", compact=True)

    def sync(self, choice: RunConfig, engine=None) -> None:
        """Show `choice`'s current values (after any change, so the fields never lie). `engine`: the chat's,
        whose config resolves a block size of 0."""
        strategy, settings = choice.build()
        select = self.query_one("#ctl-strategy", Select)
        with select.prevent(Select.Changed):
            select.value = choice.label
        values = {N: shown_n(strategy, engine), TAU: shown_role(strategy, TAU),
                  "temperature": settings.sampling.temperature, "top_k": settings.sampling.top_k,
                  "top_p": settings.sampling.top_p, "seed": settings.seed, "max_new_tokens": settings.max_new_tokens}
        self._shown = {key: str(value) for key, value in values.items()}
        for key, _ in FIELDS:
            field = self.query_one(f"#ctl-{key}", Input)
            with field.prevent(Input.Changed):
                field.value = self._shown[key]
            field.remove_class("-invalid")
            field.disabled = values[key] == UNUSED

    def show_step_mode(self, on: bool) -> None:
        """Show step mode as `on` (set elsewhere, e.g. by ctrl+t) without reporting it back as a change."""
        box = self.query_one("#ctl-step", Checkbox)
        with box.prevent(Checkbox.Changed):
            box.value = on
        box.label = step_mode_label(on)

    def invalid(self, key: str) -> None:
        self.query_one(f"#ctl-{key}", Input).add_class("-invalid")

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self.post_message(self.Changed("strategy", str(event.value)))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        key = event.input.id.removeprefix("ctl-")
        if event.value != self._shown.get(key):   # Enter on what sync showed (e.g. `8 (adapter)`) changes nothing
            self.post_message(self.Changed(key, event.value))

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        event.stop()
        event.checkbox.label = step_mode_label(event.value)
        self.post_message(self.StepMode(event.value))


def apply_change(choice: RunConfig, key: str, value: str) -> RunConfig:
    """The choice after one control change (BadInput when refused)."""
    from studio.run.config import parse_value
    if key == "strategy":
        return choice.use(value)
    if key in (N, TAU):
        strategy, _ = choice.build()
        key = role_param(type(strategy).Params, key) or key
    return choice.set(key, parse_value(value))


def shown_role(strategy, role: str) -> object:
    """The value of the strategy's parameter with `role`, or UNUSED."""
    name = role_param(type(strategy).Params, role)
    return UNUSED if name is None else getattr(strategy.params, name)


def shown_n(strategy, engine) -> object:
    """N as a run would use it: a block size of 0 resolved with the `engine`'s config by the strategy itself
    (`block_size(config)`), or a drafter's block by the drafter the run would load (`drafts_for(engine)`), with where
    it came from."""
    value = shown_role(strategy, N)
    if value != 0 or engine is None:
        return value
    if hasattr(strategy, "drafts_for"):
        drafts = strategy.drafts_for(engine)
        return value if drafts is None else f"{drafts} (drafter)"
    if not hasattr(strategy, "block_size"):
        return value
    config = engine.for_strategy(strategy.name).config
    size = strategy.block_size(config)
    source = ("model" if size == config.block_size else "adapter" if size == config.adapter_block_size
              else "default")
    return f"{size} ({source})"

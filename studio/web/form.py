"""The run form: a strategy or preset, that strategy's parameters (a form generated from its `Params`, see
`paramspec`) and the generation settings. It reads back as a `RunConfig`, which validates everything, so
a bad value becomes a one-line message beside the form and never reaches a run.

Every strategy gets its own group of fields, shown while it is picked. Picking a strategy shows its
parameters' defaults and keeps the settings as they are; picking a preset fills its strategy's fields and
the settings the preset sets with its values. Handlers take the form as keyword arguments (`kwargs`), so
the web API names each field, e.g. `isd_stride`. Messages name fields as the form labels them
(`form_message`), never as CLI flags.
"""
from __future__ import annotations

import re

import gradio as gr

from studio.engine.strategies import STRATEGIES
from studio.errors import BadInput
from studio.presets import list_presets, load_strategy_preset
from studio.run.config import RunConfig, parse_value, presets_for
from studio.web.paramspec import ParamField, param_fields, toml_inline
from studio.web.render import esc, note_html

# generation settings: key -> (label, help, precision: 0 = an integer)
SETTINGS = {"temperature": ("temperature", "0 = greedy", None), "top_k": ("top-k", "0 = off", 0),
            "top_p": ("top-p", "1 = off", None), "max_new_tokens": ("max new tokens", None, 0),
            "seed": ("seed", None, 0)}
SETTING_LABELS = {key: label for key, (label, _, _) in SETTINGS.items()}


def pick_choices(model_config=None, keep: str | None = None) -> list[tuple[str, str]]:
    """Every strategy, then the strategy presets made for the model (`presets_for`; every one without a model) and
    `keep`, a preset the run was started with, wherever it was made for."""
    presets = list_presets("strategies") if model_config is None else presets_for(model_config)
    if keep and keep not in presets and keep not in STRATEGIES:
        presets.append(keep)
    presets = [p for p in presets if p not in STRATEGIES]   # a name means the strategy first
    return [(name, name) for name in STRATEGIES] + [(f"{p} (preset)", p) for p in presets]


def strategy_of(name: str) -> str:
    """The strategy a strategy or preset name runs (BadInput for neither)."""
    if name in STRATEGIES:
        return name
    RunConfig().use(name)   # the one place that knows what a valid name is
    return load_strategy_preset(name).strategy


def form_values(choice: RunConfig) -> dict[str, object]:
    """What the form shows for `choice`: its strategy's parameters and its settings, by form key."""
    strategy, settings = choice.build()
    values: dict[str, object] = {f.key: _shown(f, getattr(strategy.params, f.name))
                                 for f in param_fields(strategy.name)}
    s = settings.sampling
    values.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                  max_new_tokens=settings.max_new_tokens, seed=settings.seed)
    return values


def preset_settings(name: str) -> dict[str, object]:
    """The settings a preset sets (none for a strategy): picking it fills only these."""
    if name in STRATEGIES:
        return {}
    preset = load_strategy_preset(name)
    given = dict(preset.sampling, max_new_tokens=preset.max_new_tokens)
    return {k: v for k, v in given.items() if k in SETTINGS and v is not None}


def read_choice(values: dict) -> RunConfig:
    """The form's values (by key, as handlers receive them) as a RunConfig; BadInput, in the form's words
    (`form_message`), for a bad or missing value."""
    name = values.get("strategy") or ""
    strategy = None
    try:
        strategy = strategy_of(name)
        params = {f.name: _read(f, values.get(f.key, f.default)) for f in param_fields(strategy)}
        settings = read_settings(values)
        preset = None if name == strategy else name
        choice = RunConfig(None if preset else strategy, preset, params, **settings)
        choice.build()
    except BadInput as e:
        raise BadInput(form_message(str(e), strategy)) from None
    return choice


def form_message(text: str, strategy: str | None = None) -> str:
    """A message from the runner in the form's words: a CLI flag becomes its field's label (`--max-new-tokens`
    -> `max new tokens`), and a parameter named after the class that checks it ("isd stride" on r-isd,
    "strategy 'r-isd' parameter 'stride'") becomes the picked strategy's field (`r-isd stride (N)`)."""
    for key, label in SETTING_LABELS.items():
        text = text.replace("--" + key.replace("_", "-"), label)
    for f in param_fields(strategy) if strategy in STRATEGIES else ():
        owner = rf"(?:strategy )?'?[\w-]+'? (?:parameter )?'?{re.escape(f.name)}'?(?![\w-])"
        text = re.sub(rf"^{owner}", f"{strategy} {f.label}".replace("\\", "\\\\"), text)
    return text


def read_settings(values: dict) -> dict[str, object]:
    """The settings fields by key; BadInput for an empty one (never taken for "the default")."""
    empty = [key for key in SETTINGS if values.get(key) is None or values.get(key) == ""]
    if empty:
        raise BadInput(f"{SETTING_LABELS[empty[0]]}: enter a number")
    return {key: values[key] for key in SETTINGS}


def settings_fields(values: dict[str, object], prefix: str) -> dict[str, gr.Number]:
    """The settings as number fields (build inside a gr.Row), by key, showing `values`."""
    return {key: gr.Number(values[key], label=label, info=info, precision=precision, min_width=120,
                           elem_id=f"{prefix}-{key}")
            for key, (label, info, precision) in SETTINGS.items()}


def _shown(field: ParamField, value: object) -> object:
    return toml_inline(value) if field.kind is dict else value


def _read(field: ParamField, value: object) -> object:
    if value is None or (value == "" and field.kind is not str):
        raise BadInput(f"{field.strategy} {field.name}: enter a value")
    if field.kind is dict:
        parsed = parse_value(str(value))
        if not isinstance(parsed, dict):
            raise BadInput(f"{field.strategy} {field.name} must be a table like {{c = 1}}, got {value!r}")
        return parsed
    if field.kind is float and isinstance(value, int):
        return float(value)
    return value


class RunForm:
    """The form's components; build it inside a gr.Blocks context."""

    def __init__(self, initial: RunConfig, prefix: str, model_config=None):
        strategy, preset, _ = initial.resolved()   # with the model preset's recommendation
        picked = preset or strategy
        shown = form_values(initial)
        self.pick = gr.Dropdown(pick_choices(model_config, keep=picked), value=picked, label="Strategy or preset", elem_id=f"{prefix}-pick")
        self.groups: dict[str, gr.Group] = {}
        self.fields: dict[str, gr.components.Component] = {}   # by ParamField.key
        initial_strategy = strategy_of(picked)
        for name in STRATEGIES:
            with gr.Group(visible=name == initial_strategy) as group:
                if not param_fields(name):
                    gr.HTML(f'<div class="note info">{name} has no parameters</div>')
                with gr.Row():
                    for f in param_fields(name):
                        value = shown[f.key] if name == initial_strategy else _shown(f, f.default)
                        self.fields[f.key] = _component(f, value, f"{prefix}-{f.key}")
                if any(f.brief != f.help for f in param_fields(name)):
                    with gr.Accordion("What these parameters do", open=False):
                        gr.HTML(help_table(param_fields(name)))
            self.groups[name] = group
        with gr.Row():
            self.settings = settings_fields(shown, prefix)
        self.message = gr.HTML(elem_id=f"{prefix}-form-message")
        self.pick.input(self._on_pick, self.pick, self._outputs(), api_name=f"{prefix}_pick", concurrency_limit=None)

    def kwargs(self) -> dict[str, gr.components.Component]:
        """The form as handler keyword arguments: `strategy`, the settings, every parameter field."""
        return {"strategy": self.pick, **self.settings, **self.fields}

    def _outputs(self) -> list:
        return [*self.groups.values(), *self.fields.values(), *self.settings.values(), self.message]

    def _on_pick(self, name: str) -> dict:
        try:
            strategy = strategy_of(name)
            shown = form_values(RunConfig().use(name))
            settings = preset_settings(name)
        except BadInput as e:
            return {self.message: note_html(str(e), "error")}
        updates: dict = {group: gr.Group(visible=s == strategy) for s, group in self.groups.items()}
        updates.update({comp: shown[key] for key, comp in self.fields.items() if key in shown})
        updates.update({self.settings[key]: value for key, value in settings.items()})
        updates[self.message] = ""
        return updates


def help_table(fields) -> str:
    """Every parameter's whole help, a row each (the field shows its `brief`)."""
    rows = "".join(f"<tr><th>{esc(f.label)}</th><td>{esc(f.help)}</td></tr>" for f in fields)
    return f'<table class="param-help">{rows}</table>'


def _component(f: ParamField, value: object, elem_id: str) -> gr.components.Component:
    common = {"label": f.label, "info": f.brief or None, "elem_id": elem_id, "min_width": 140, "elem_classes": "param"}
    if f.kind is bool:
        return gr.Checkbox(value, **common)
    if f.kind is int:
        return gr.Number(value, precision=0, **common)
    if f.kind is float:
        return gr.Number(value, **common)
    if f.choices:
        return gr.Dropdown(list(f.choices), value=value, allow_custom_value=True, **common)
    return gr.Textbox(value, **common)

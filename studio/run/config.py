"""What to run, as one typed object: `RunConfig` (a strategy or preset, its parameters, sampling, seed, limits,
stop strings) and `ModelChoice` (the model, adapter, draft model, device and dtype it runs on).

Every front end builds these the same way (the CLI from its shared options in `studio.run.options`, the chat
commands with `use`/`set`, the TUI controls and the web form) and turns them into runs through `RunConfig.build`
and `studio.run.compare.make_runs`. Values merge as: explicit settings > the preset's > built-in defaults.
"""
from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from studio.errors import BadInput

if TYPE_CHECKING:   # torch-heavy modules; a config is built before anything loads
    from studio.engine.engine import Engine
    from studio.engine.strategies import Strategy
    from studio.run.session import Settings

DEFAULT_MAX_NEW_TOKENS = 128
SAMPLING_KEYS = ("temperature", "top_k", "top_p")
SETTING_KEYS = SAMPLING_KEYS + ("max_new_tokens", "seed")   # `set` keys that are not strategy parameters
ALIASES = {"top-k": "top_k", "top-p": "top_p", "max-new-tokens": "max_new_tokens", "max_tokens": "max_new_tokens",
           "max-tokens": "max_new_tokens"}


def parse_value(raw: str) -> object:
    """A parameter value as the user typed it: a TOML literal (3, 0.5, true, "x"), else the bare word."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    except (ValueError, RecursionError):  # a TOML literal Python cannot hold: 4300+ digits, nesting too deep
        shown = repr(raw) if len(raw) <= 40 else repr(raw[:37]) + "..."
        raise BadInput(f"value {shown} is too long a number or nested too deeply") from None


def parse_param(text: str) -> tuple[str, object]:
    """`KEY=VALUE` (the --param syntax)."""
    if "=" not in text:
        raise BadInput(f"--param expects KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    return key.strip(), parse_value(raw)


def strategy_or_preset(name: str) -> tuple[str | None, str | None]:
    """`name` as (strategy, None) or (None, preset); BadInput naming both lists when it is neither."""
    from studio.engine.strategies import STRATEGIES
    from studio.presets import list_presets
    if name in STRATEGIES:
        return name, None
    presets = list_presets("strategies")
    if name in presets or name.endswith(".toml"):
        return None, name
    raise BadInput(f"unknown strategy or preset {name!r} (strategies: {', '.join(STRATEGIES)}; "
                   f"presets: {', '.join(presets)})")


def presets_for(model_config) -> list[str]:
    """The strategy presets a model of `model_config` runs: its strategy fits the model, and the model is of a family
    the preset was made for when it names any (LLaDA2's own pipeline is not offered for SmolLM2)."""
    from studio.engine.strategies import STRATEGIES
    from studio.presets import list_presets, load_strategy_preset
    presets = [load_strategy_preset(name) for name in list_presets("strategies")]
    return [p.name for p in presets if STRATEGIES[p.strategy].fits(model_config)
            and (not p.families or model_config.family in p.families)]


@dataclass(frozen=True)
class RunConfig:
    """One run: a strategy or a strategy preset, parameter overrides, generation settings and, where a run needs
    another adapter than its engine's choice (a comparison's reference), its adapter. `None` settings take the
    preset's value, then the built-in default. `model`: the model spec whose preset (studio/presets/models) may
    recommend a strategy (taken when neither a strategy nor a preset is given) and an answer length (taken when no
    strategy preset gives one). Every preset is read here, in `build` (and `label`); `build` validates everything,
    so a front end builds once when the user changes something and a bad value never reaches a run."""
    strategy: str | None = "ar"
    preset: str | None = None
    params: Mapping[str, object] = field(default_factory=dict)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    seed: int = 0
    stop: tuple[str, ...] = ()
    oracle_accept: float | None = None   # bench: accept decisions are Bernoulli(P) draws (the output means nothing)
    adapter: str | None = None   # this run's adapter (a directory, a shipped name, "none"); None: the engine's choice
    model: str | None = None     # the model spec whose preset recommends a strategy and length; None: none

    @property
    def label(self) -> str:
        """What the user asked for (or the model preset recommended): the preset's name, else the strategy's."""
        from pathlib import Path
        strategy, preset, _ = self.resolved()
        return Path(preset).stem if preset else strategy or "?"

    def resolved(self) -> tuple[str | None, str | None, int | None]:
        """(strategy, strategy preset, the model preset's answer length or None) once the model preset's
        recommendation is applied; `ar` when nothing names a strategy."""
        return self._resolution

    @functools.cached_property
    def _resolution(self) -> tuple[str | None, str | None, int | None]:
        # read once per config (label and build ask on every UI refresh): a changed config is a new object
        from studio.presets import load_model_preset
        strategy, preset = self.strategy, self.preset
        model = load_model_preset(self.model) if self.model else None
        if model and strategy is None and preset is None and model.strategy:
            strategy, preset = strategy_or_preset(model.strategy)
        limit = model.max_new_tokens if model and preset is None else None
        return (strategy if strategy or preset else "ar"), preset, limit

    def length_given(self) -> int | None:
        """The answer length given on the command line, else the model preset's; None: a command's own default
        (bench's 64) applies, ahead of a strategy preset's."""
        return self.resolved()[2] if self.max_new_tokens is None else self.max_new_tokens

    def build(self) -> tuple[Strategy, Settings]:
        """The strategy and settings of a run; BadInput for an unknown strategy, preset or parameter, or a value
        out of range."""
        from studio.engine.sampling import SamplingParams
        from studio.engine.strategies import make_strategy
        from studio.presets import load_strategy_preset
        from studio.run.session import Settings

        strategy, preset, model_limit = self.resolved()
        base = load_strategy_preset(preset) if preset else None
        name = strategy or (base.strategy if base else None)
        if name is None:
            raise BadInput("give a strategy with -s/--strategy or a --preset")
        params = dict(base.params) if base and base.strategy == name else {}
        params.update(self.params)
        sampling = dict(base.sampling) if base else {}
        sampling.update({k: getattr(self, k) for k in SAMPLING_KEYS if getattr(self, k) is not None})
        given = (self.max_new_tokens, base.max_new_tokens if base else None, model_limit)
        limit = next((n for n in given if n is not None), DEFAULT_MAX_NEW_TOKENS)   # 0 is refused, never "unset"
        settings = Settings(max_new_tokens=limit, sampling=SamplingParams(**sampling), seed=self.seed,
                            stop=tuple(self.stop), oracle_accept=self.oracle_accept)
        return make_strategy(name, params), settings

    def use(self, name: str) -> "RunConfig":
        """This configuration running strategy or preset `name` with its own parameters (the old overrides are
        dropped; sampling, seed, limits and stop strings stay)."""
        strategy, preset = strategy_or_preset(name)
        config = dataclasses.replace(self, strategy=strategy, preset=preset, params={})
        config.build()
        return config

    def set(self, key: str, value: object) -> "RunConfig":
        """A copy with one setting or strategy parameter changed (BadInput if it does not build)."""
        key = ALIASES.get(key, key).replace("-", "_")
        if key in SETTING_KEYS:
            config = dataclasses.replace(self, **{key: value})
        else:
            config = dataclasses.replace(self, params={**self.params, key: value})
        try:
            config.build()
        except TypeError as e:   # a setting of the wrong type (`/set seed x`)
            raise BadInput(f"{key}: {e}") from None
        return config

    def describe(self) -> str:
        strategy, settings = self.build()
        s = settings.sampling
        params = ", ".join(f"{k}={v}" for k, v in strategy.header_params().items())
        return (f"{self.label} ({strategy.name}{': ' + params if params else ''}) · temperature {s.temperature:g} · "
                f"top_k {s.top_k} · top_p {s.top_p:g} · seed {settings.seed} · max_new_tokens {settings.max_new_tokens}")


@dataclass(frozen=True)
class ModelChoice:
    """The model runs decode with: a model spec (`default`, a preset, a directory, a .gguf, random:NAME), an adapter
    (None: each strategy's shipped one; 'none': the plain model), SimSD's drafter, the device and dtype, and
    whether prompts get the chat template."""
    model: str = "default"
    adapter: str | None = None
    draft_model: str | None = None
    draft_adapter: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    graphs: bool = True
    chat_template: bool = True
    tp: int = 1   # tensor-parallel ranks (studio.parallel)
    ep: int = 1   # expert-parallel ranks: an MoE model's experts placed across the same ranks
    quant: str = "none"   # weight-only quantisation of the layers' projections (studio.engine.quantize)
    compile: bool = False   # the forward through torch.compile (studio.engine.compiled)

    @property
    def world(self) -> int:
        """The ranks the model is split across (--ep N alone splits the attention across the same N ranks)."""
        if self.ep > 1 and self.tp not in (1, self.ep):
            raise BadInput(f"--ep {self.ep} with --tp {self.tp}: experts are placed across the tensor-parallel "
                           "ranks, so --ep is 1 or equal to --tp")
        return max(self.tp, self.ep)

    def load(self) -> Engine:
        from studio.engine.engine import Engine
        from studio.run.group import check_world, torchrun_world
        check_world(self.world)
        if self.world == 1 and torchrun_world() == 1:
            return Engine.load(self.model, adapter=self.adapter, device=self.device, dtype=self.dtype,
                               graphs=self.graphs, quant=self.quant, compile=self.compile)
        if self.quant != "none":
            raise BadInput(f"--quant {self.quant} with --tp: the shards are not quantised yet")
        if self.compile:
            raise BadInput("--compile with --tp: the shards' forwards are not compiled yet")
        if self.draft_model is not None or self.draft_adapter is not None:
            raise BadInput("--tp: SimSD's separate drafter is not split across ranks yet")
        from studio.engine.device import resolve_device
        from studio.run.launch import start
        device = resolve_device(self.device).type
        build = functools.partial(Engine.load, self.model, adapter=None, device=self.device, dtype=self.dtype,
                                  graphs=False)
        return start(self.world, build, device=device, adapter=self.adapter, place_experts=self.ep > 1)

    @property
    def dflash_drafter(self) -> bool:
        """Whether `--draft-model` is a DFlash drafter (a directory in the published layout), not a SimSD draft model."""
        from studio.engine.dflash import is_drafter_dir
        return self.draft_model is not None and is_drafter_dir(self.draft_model)

    def load_draft(self) -> Engine | None:
        """SimSD's drafter (`--draft-model`, default: the target model, with `--draft-adapter`) on the target's
        device and dtype; None without either flag (SimSD then drafts with the target itself) or when `--draft-model`
        is a DFlash drafter (`attach_draft` hands its directory to dflash runs)."""
        if self.draft_model is None and self.draft_adapter is None or self.dflash_drafter:
            return None
        from studio.engine.engine import Engine
        return Engine.load(self.draft_model or self.model, adapter=self.draft_adapter, device=self.device,
                           dtype=self.dtype)

    def attach_draft(self, strategies, engine: Engine, draft: Engine | None = None) -> None:
        """Give the runs among `strategies` their drafter: a DFlash drafter's directory to dflash runs, SimSD's draft
        model (`draft`, else `load_draft`) to simsd runs. BadInput for a --draft-model no run among them reads."""
        if self.draft_model is None and self.draft_adapter is None:
            return
        if self.dflash_drafter:
            takers = [s for s in strategies if hasattr(s, "use_drafter")]
            if not takers:
                raise BadInput(f"--draft-model {self.draft_model} is a DFlash drafter: it applies to dflash runs only")
            for s in takers:
                s.use_drafter(self.draft_model)
            return
        takers = [s for s in strategies if hasattr(s, "use_draft")]
        if not takers:
            raise BadInput("--draft-model/--draft-adapter apply to simsd runs (a DFlash drafter directory: to dflash "
                           "runs)")
        draft = draft or self.load_draft()
        for s in takers:
            s.use_draft(draft, engine.config)

"""What to run: a strategy (by name or preset) with its parameters, and the generation settings, merged
from a preset, user overrides and built-in defaults. The CLI, chat, the TUI and the web UI build runs here."""
from __future__ import annotations

import tomllib
from typing import Iterable, Mapping

from studio.errors import BadInput

DEFAULT_MAX_NEW_TOKENS = 128


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


def build_run(strategy: str | None, preset: str | None, params: Iterable[str] | Mapping[str, object],
              max_new_tokens: int | None, temperature: float | None, top_k: int | None, top_p: float | None,
              seed: int, stop: Iterable[str], oracle_accept: float | None = None):
    """Merge preset and overrides into (Strategy, Settings); overrides win. `params`: `KEY=VALUE` strings
    or a mapping; `oracle_accept`: bench's acceptance oracle (Settings). BadInput for an unknown strategy,
    preset or parameter, or a value out of range."""
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    from studio.presets import load_strategy_preset
    from studio.run.session import Settings

    base = load_strategy_preset(preset) if preset else None
    name = strategy or (base.strategy if base else None)
    if name is None:
        raise BadInput("give a strategy with -s/--strategy or a --preset")
    merged = dict(base.params) if base and base.strategy == name else {}
    merged.update(params.items() if isinstance(params, Mapping) else (parse_param(p) for p in params))
    sampling = dict(base.sampling) if base else {}
    for key, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if value is not None:
            sampling[key] = value
    mnt = max_new_tokens or (base.max_new_tokens if base else None) or DEFAULT_MAX_NEW_TOKENS
    return make_strategy(name, merged), Settings(max_new_tokens=mnt, sampling=SamplingParams(**sampling),
                                                 seed=seed, stop=tuple(stop), oracle_accept=oracle_accept)

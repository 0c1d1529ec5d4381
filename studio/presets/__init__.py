"""Presets: TOML files under studio/presets/ (package data) that name a model or a strategy configuration.

    studio/presets/models/NAME.toml      source = "default" | a path; optional capability overrides; the strategy
                                         (or strategy preset) and max_new_tokens a run takes when none is given
    studio/presets/strategies/NAME.toml  strategy = "isd"; [params] ...; [sampling] temperature/top_k/top_p; max_new_tokens

CLI flags override preset values; presets override built-in defaults.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from studio.errors import BadInput

PRESETS_DIR = Path(__file__).resolve().parent   # the TOML files and shipped adapters are package data
_MODEL_KEYS = {"description", "source", "mask_token_id", "block_size", "logit_shift", "note", "strategy",
               "max_new_tokens"}
_STRATEGY_KEYS = {"description", "strategy", "params", "sampling", "max_new_tokens", "paper", "families"}
_SAMPLING_KEYS = {"temperature", "top_k", "top_p"}


@dataclass
class StrategyPreset:
    name: str
    strategy: str
    params: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    max_new_tokens: int | None = None
    description: str = ""
    families: tuple[str, ...] = ()   # the model families (ModelConfig.family) it was made for; (): any model


@dataclass
class ModelPreset:
    name: str
    source: str
    overrides: dict = field(default_factory=dict)   # ModelConfig fields: mask_token_id, block_size, logit_shift
    description: str = ""
    note: str = ""
    strategy: str | None = None         # the strategy or strategy preset a run of this model takes by default
    max_new_tokens: int | None = None   # the generation length its own pipeline uses by default


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"preset not found: {path}") from None
    except OSError as e:  # a directory, no permission ...
        raise BadInput(f"cannot read preset {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"preset {path} is not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"preset {path} is not valid TOML: {e}") from None
    except (ValueError, RecursionError):  # valid TOML Python cannot hold: a 4300+ digit int, nesting too deep
        raise BadInput(f"preset {path} is not valid TOML: a number too long or nesting too deep") from None


def _short(v) -> str:
    try:
        r = repr(v)
    except ValueError:  # a TOML hex int of 4300+ decimal digits cannot be printed
        r = f"<{type(v).__name__}>"
    return r if len(r) <= 60 else r[:57] + "..."


def _is_number(v) -> bool:
    """A finite int or float (not a bool): 10**400 and nan are TOML numbers no sampler can use."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an int beyond the float range
        return False


def _integer(least: int):
    return lambda v: _is_number(v) and isinstance(v, int) and v >= least


# What each key must hold: TOML gives any value any type, and a wrong one would fail far from the preset.
_STRING, _TABLE = (lambda v: isinstance(v, str), "a string"), (lambda v: isinstance(v, dict), "a table")
_KINDS = {
    "description": _STRING, "paper": _STRING, "note": _STRING, "strategy": _STRING, "source": _STRING,
    "params": _TABLE, "sampling": _TABLE,
    "families": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "max_new_tokens": (_integer(1), "a positive integer"), "block_size": (_integer(1), "a positive integer"),
    "mask_token_id": (_integer(0), "a non-negative integer"), "top_k": (_integer(0), "a non-negative integer"),
    "logit_shift": (lambda v: isinstance(v, bool), "true or false"),
    "temperature": (_is_number, "a finite number"), "top_p": (_is_number, "a finite number"),
}


def _check_types(path: Path, data: dict, prefix: str = "") -> None:
    for key, value in data.items():
        ok, kind = _KINDS[key]
        if not ok(value):
            raise BadInput(f"preset {path}: {prefix}{key} must be {kind}, got {_short(value)}")


def _resolve(kind: str, name_or_file: str) -> Path:
    p = Path(name_or_file)
    if p.suffix == ".toml":
        return p
    candidate = PRESETS_DIR / kind / f"{name_or_file}.toml"
    if not candidate.exists():
        known = ", ".join(list_presets(kind)) or "none"
        noun = {"models": "model", "strategies": "strategy"}[kind]
        raise BadInput(f"unknown {noun} preset {name_or_file!r} (available: {known})")
    return candidate


def list_presets(kind: str) -> list[str]:
    return sorted(p.stem for p in (PRESETS_DIR / kind).glob("*.toml"))


def _check_keys(path: Path, data: dict, allowed: set[str]) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise BadInput(f"preset {path}: unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def load_strategy_preset(name_or_file: str) -> StrategyPreset:
    path = _resolve("strategies", name_or_file)
    data = _read(path)
    _check_keys(path, data, _STRATEGY_KEYS)
    if "strategy" not in data:
        raise BadInput(f"preset {path}: missing key 'strategy'")
    _check_types(path, data)
    _check_keys(path, data.get("sampling", {}), _SAMPLING_KEYS)
    _check_types(path, data.get("sampling", {}), "sampling.")
    return StrategyPreset(name=path.stem, strategy=data["strategy"], params=dict(data.get("params", {})),
                          sampling=dict(data.get("sampling", {})), max_new_tokens=data.get("max_new_tokens"),
                          description=data.get("description", ""), families=tuple(data.get("families", ())))


def load_model_preset(name_or_file: str) -> ModelPreset | None:
    """The preset for a model spec, or None when the spec is a plain path (not a preset)."""
    path = Path(name_or_file)
    if path.suffix != ".toml" and not (PRESETS_DIR / "models" / f"{name_or_file}.toml").exists():
        return None
    path = _resolve("models", name_or_file)
    data = _read(path)
    _check_keys(path, data, _MODEL_KEYS)
    if "source" not in data:
        raise BadInput(f"preset {path}: missing key 'source'")
    _check_types(path, data)
    overrides = {k: data[k] for k in ("mask_token_id", "block_size", "logit_shift") if k in data}
    return ModelPreset(name=path.stem, source=data["source"], overrides=overrides,
                       description=data.get("description", ""), note=data.get("note", ""),
                       strategy=data.get("strategy"), max_new_tokens=data.get("max_new_tokens"))

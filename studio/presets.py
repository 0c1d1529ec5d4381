"""Presets: TOML files under presets/ that name a model or a strategy configuration.

    presets/models/NAME.toml      source = "default" | a path; optional capability overrides
    presets/strategies/NAME.toml  strategy = "isd"; [params] ...; [sampling] temperature/top_k/top_p; max_new_tokens

CLI flags override preset values; presets override built-in defaults.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from studio.errors import BadInput

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
_MODEL_KEYS = {"description", "source", "mask_token_id", "block_size", "logit_shift", "note"}
_STRATEGY_KEYS = {"description", "strategy", "params", "sampling", "max_new_tokens", "paper"}
_SAMPLING_KEYS = {"temperature", "top_k", "top_p"}


@dataclass
class StrategyPreset:
    name: str
    strategy: str
    params: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    max_new_tokens: int | None = None
    description: str = ""


@dataclass
class ModelPreset:
    name: str
    source: str
    overrides: dict = field(default_factory=dict)   # ModelConfig fields: mask_token_id, block_size, logit_shift
    description: str = ""
    note: str = ""


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"preset not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"preset {path} is not valid TOML: {e}") from None


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
    _check_keys(path, data.get("sampling", {}), _SAMPLING_KEYS)
    return StrategyPreset(name=path.stem, strategy=data["strategy"], params=dict(data.get("params", {})),
                          sampling=dict(data.get("sampling", {})), max_new_tokens=data.get("max_new_tokens"),
                          description=data.get("description", ""))


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
    overrides = {k: data[k] for k in ("mask_token_id", "block_size", "logit_shift") if k in data}
    return ModelPreset(name=path.stem, source=data["source"], overrides=overrides,
                       description=data.get("description", ""), note=data.get("note", ""))

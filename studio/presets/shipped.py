"""Adapters and drafters shipped with the studio (studio/presets/adapters/NAME/, studio/presets/drafters/NAME/):
trained for a model, used by default.

Each directory is a PEFT adapter (adapter_config.json + adapter_model.safetensors) plus `studio.toml`:
    model = "default"                  the model preset it was trained for
    strategies = ["r-isd"]             the strategies that use it on that model when no --adapter is given
    description = "..."
`--adapter NAME` accepts a shipped adapter's name as well as a directory; `--adapter none` runs the plain
model. The README beside the adapters says how each was trained. A drafter directory is a DFlash drafter in the
published layout (config.json + model.safetensors, studio.engine.dflash) plus the same `studio.toml`.
"""
from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path

from studio.errors import BadInput
from studio.presets import PRESETS_DIR

ADAPTERS_DIR = PRESETS_DIR / "adapters"
DRAFTERS_DIR = PRESETS_DIR / "drafters"
META = "studio.toml"


def shipped() -> dict[str, dict]:
    """name -> {path, model, strategies, description} for every shipped adapter."""
    return _entries(ADAPTERS_DIR)


def shipped_drafter(model: str) -> str | None:
    """The directory of the DFlash drafter shipped for model preset `model`, or None."""
    return next((e["path"] for e in _entries(DRAFTERS_DIR).values() if e["model"] == model), None)


@lru_cache(maxsize=2)
def _entries(directory: Path) -> dict[str, dict]:
    out = {}
    if not directory.is_dir():
        return out
    for d in sorted(directory.iterdir()):
        f = d / META
        if not f.is_file():
            continue
        try:
            meta = tomllib.loads(f.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise BadInput(f"invalid {f}: {e}") from None
        out[d.name] = {"path": str(d), "model": meta.get("model", "default"),
                       "strategies": list(meta.get("strategies", [])), "description": meta.get("description", "")}
    return out


def adapter_path(choice: str) -> str:
    """A shipped adapter's name -> its directory; anything else is taken as a path."""
    entry = shipped().get(choice)
    return entry["path"] if entry and not Path(choice).exists() else choice


def shipped_for(model: str, strategy: str) -> str | None:
    """The directory of the adapter shipped for `strategy` on model preset `model`, or None."""
    for entry in shipped().values():
        if entry["model"] == model and strategy in entry["strategies"]:
            return entry["path"]
    return None


def shipped_name(path: str | None) -> str | None:
    """The name of the shipped adapter at `path`, else None: run records name it, since the path alone is
    wherever the package was installed."""
    if path is None:
        return None
    return next((name for name, entry in shipped().items() if Path(entry["path"]) == Path(path).resolve()), None)

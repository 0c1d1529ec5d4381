"""Checkpoint families whose config.json and tensor names are not Hugging Face Llama/Qwen's: each module says how
its config maps onto `ModelConfig` and how its tensor names map onto the one compact model's (`model.py`), so
the core stays one transformer and each family's differences live in a small module of its own. Their remote
code is never run. `hf` reads the Hugging Face Llama/Qwen layout itself. A family module has `matches(raw) -> bool`, `config(raw, name) -> ModelConfig`,
`state_dict(sd, cfg) -> sd` and, where adapters trained on it name modules its own way, `adapter_names`.

Design: docs/families.md
"""
from __future__ import annotations

from types import ModuleType

from studio.engine.config import ModelConfig
from studio.engine.families import diffusion_gemma, dream, hf, llada, llada2, llada_moe

FAMILIES: tuple[ModuleType, ...] = (llada, llada_moe, llada2, dream, diffusion_gemma)


def family_of(raw: dict) -> ModuleType | None:
    """The family module that reads this config.json, or None for the Hugging Face Llama/Qwen layout."""
    return next((f for f in FAMILIES if f.matches(raw)), None)


def read_config(raw: dict, name: str = "") -> ModelConfig:
    """The ModelConfig of a config.json: read by its family's module, else as the Hugging Face Llama/Qwen layout."""
    family = family_of(raw)
    return (family or hf).config(raw, name)


def adapter_names(base, tensors: dict, targets):
    """A PEFT adapter trained on a model of config `base` (its family's module names), its tensor keys and
    target_modules renamed onto the compact model's (unchanged for a family that keeps Hugging Face names)."""
    module = next((f for f in FAMILIES if f.NAME == base.family), None)
    rename = getattr(module, "adapter_names", None)
    return rename(tensors, targets, base) if rename else (tensors, targets)

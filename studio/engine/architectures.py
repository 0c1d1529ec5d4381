"""Which module a config builds: the one registry of model classes. The compact Transformer (studio.engine.model)
builds every causal and block-diffusion family; DiffusionGemma's encoder/decoder (studio.engine.gemma) shares its
parts and its forward's contract."""
from __future__ import annotations

from torch import nn

from studio.engine.config import ModelConfig
from studio.engine.gemma import DiffusionGemma
from studio.engine.model import Transformer

MODEL_CLASSES: dict[str, type[nn.Module]] = {"gemma4": DiffusionGemma}   # by ModelConfig.arch; others: Transformer


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return MODEL_CLASSES.get(cfg.arch, Transformer)

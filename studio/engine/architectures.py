"""Which module a config builds (the one registry of model classes), and the weights it implies. The compact Transformer (studio.engine.model)
builds every causal and block-diffusion family; DiffusionGemma's encoder/decoder (studio.engine.gemma) shares its
parts and its forward's contract."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from studio.engine.config import ModelConfig
from studio.engine.gemma import DiffusionGemma
from studio.engine.model import Transformer
from studio.errors import BadInput

MODEL_CLASSES: dict[str, type[nn.Module]] = {"gemma4": DiffusionGemma}   # by ModelConfig.arch; others: Transformer


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return MODEL_CLASSES.get(cfg.arch, Transformer)


def expected_shapes(cfg: ModelConfig):
    """(name, shape) of every weight `cfg` implies, read off the model built on the meta device (no memory), one
    layer at a time and lazily: a damaged n_layers of 2**60 fails at the first missing layer instead of building
    2**60 of them."""
    cls = model_class(cfg)
    with torch.device("meta"):
        top = cls(dataclasses.replace(cfg, n_layers=0, layer_types=[]))
        for name, t in top.state_dict().items():
            if not (name == "lm_head.weight" and cfg.tie_embeddings):
                yield name, tuple(t.shape)
        for i in range(cfg.n_layers):
            for name, t in cls.block(cfg, i).state_dict().items():
                yield f"model.layers.{i}.{name}", tuple(t.shape)


def check_shapes(cfg: ModelConfig, sd: dict[str, torch.Tensor], where: str) -> None:
    """Catch a config/weights mismatch here, as a one-line BadInput, instead of deep in the model."""
    for name, shape in expected_shapes(cfg):
        t = sd.get(name)
        if t is None:
            raise BadInput(f"{where}: missing weight {name}")
        if tuple(t.shape) != shape:
            raise BadInput(f"{where}: weight {name} has shape {tuple(t.shape)}, config implies {shape}")

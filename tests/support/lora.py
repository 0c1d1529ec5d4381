"""Random LoRA adapters for tiny models: non-zero A and B, so an adapter really changes the model."""
from __future__ import annotations

import torch

from studio.engine.lora import TARGETS, merge_adapter_weights, save_adapter
from studio.engine.model import Linear, Transformer


def random_lora(model, r: int = 4, seed: int = 0, targets=TARGETS) -> dict:
    """Random non-zero A and B for every targeted Linear (PEFT's B = 0 init would make every test pass)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name.rsplit(".", 1)[-1] in targets:
            A = torch.randn(r, m.in_features, generator=g) / m.in_features ** 0.5
            B = torch.randn(m.out_features, r, generator=g) / r ** 0.5
            out[name] = (A, B)
    return out


def random_adapter(path, model, r: int = 4, alpha: float = 4.0, seed: int = 0, targets=TARGETS, **kw):
    """Write a random adapter for `model`'s shapes to `path` (scale alpha/r = 1: a real change of the model)."""
    return save_adapter(random_lora(model, r, seed, targets), path, r=r, alpha=alpha, targets=list(targets), **kw)


def merged_model(model) -> Transformer:
    m = Transformer(model.config).eval()
    m.load_state_dict(merge_adapter_weights(model))
    return m

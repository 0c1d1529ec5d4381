"""Random adapters for tests on real-sized models (the embedded SmolLM2): the LoRA helpers of test_lora plus a
new, input-only MASK embedding row, as a trained R-ISD adapter for a plain AR model would bring."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.support.lora import random_adapter


def random_mask_adapter(path, model, r: int = 4, alpha: float = 4.0, seed: int = 0) -> Path:
    """Write a random adapter for `model` to `path`: random low-rank LoRA weights on q/k/v/o/gate/up/down
    (scale alpha/r) and a MASK embedding row appended at id V (the base vocab size), of the base table's scale.
    Fixed `seed`: the same adapter every time."""
    V, dim = model.lm_head.weight.shape
    g = torch.Generator().manual_seed(seed + 1)
    row = torch.randn(1, dim, generator=g) * model.model.embed_tokens.weight[:V].std().item()
    return random_adapter(path, model, r=r, alpha=alpha, seed=seed, mask_token_id=V, mask_embedding=row)

"""Tiny DFlash drafters for the tiny models, written in the published layout."""
from __future__ import annotations

import torch

from studio.engine.dflash import Drafter, DrafterConfig, save_drafter


def tiny_drafter(engine, path, layers: int = 1, taps=(0, 1), block: int = 4, seed: int = 0,
                 mask: int | None = None, vocab: list[int] | None = None) -> Drafter:
    """A random drafter for `engine`'s model (its width; MASK: `mask`, else the last vocab entry; its head reading
    the tokens `vocab`, else all), saved at `path`."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(engine.config, layers, list(taps), block,
                                   engine.config.vocab_size - 1 if mask is None else mask)
    drafter = Drafter(cfg).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    drafter.vocab = None if vocab is None else torch.tensor(vocab)
    save_drafter(drafter, path, engine.config.n_layers)
    return drafter

"""Whether a model fits this machine's memory, decided before any of it is allocated: a model that cannot fit is
one line and exit 2, not the kernel's OOM killer minutes into a load."""
from __future__ import annotations

import os

import torch

from studio.engine.architectures import model_class
from studio.engine.config import ModelConfig
from studio.errors import BadInput

# a file model's check counts the KV cache of one run this long (or of the model's context, when shorter)
KV_CHECK_TOKENS = 4096


def ram_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parameter_count(cfg: ModelConfig) -> int:
    """The parameters a model of shape `cfg` has, counted on the meta device: nothing is allocated (an 8B shape's
    fp32 weights would not fit a small machine's memory)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    tied_apart = cfg.tie_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight
    return n - (model.lm_head.weight.numel() if tied_apart else 0)


def kv_bytes(cfg: ModelConfig, tokens: int, element_size: int = 4) -> int:
    """The K and V of `tokens` positions on every layer (at the sliding layers' geometry: a lower bound for Gemma's
    wider full-attention layers)."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * element_size * tokens


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_weights_fit(what: str, weights: int, dtype: str, ram: int, hint: str) -> None:
    """BadInput when `weights` bytes (in `dtype`) exceed `ram`, the machine's memory."""
    if weights > ram:
        raise BadInput(f"{what}: its weights take {_gib(weights)} in {dtype}, more than this machine's {_gib(ram)} "
                       f"of memory ({hint})")


def check_file_model_fits(what: str, cfg: ModelConfig, ram: int) -> None:
    """BadInput when a model read from files (in fp32 on the CPU first, whatever its final device and dtype) and the
    KV cache of one run of `KV_CHECK_TOKENS` would not fit `ram`."""
    weights = parameter_count(cfg) * 4
    kv = kv_bytes(cfg, min(cfg.max_seq_len, KV_CHECK_TOKENS))
    if weights + kv > ram:
        raise BadInput(f"{what}: its weights take {_gib(weights)} in float32 (as they are read, before any --dtype) "
                       f"and a {min(cfg.max_seq_len, KV_CHECK_TOKENS)}-token run's KV cache {_gib(kv)}, more than this "
                       f"machine's {_gib(ram)} of memory")

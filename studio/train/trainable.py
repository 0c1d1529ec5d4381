"""The trainable part of an adapter: LoRA pairs on the model's Linear layers and a learned MASK embedding.

Everything else stays frozen. The LoRA tensors are set on `model.Linear` exactly where an attached
adapter would be, so training runs the inference forward (gates included); the MASK row is served by a
small embedding module (base table + one trainable row) swapped in for the duration of training.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from studio.engine.lora import TARGETS, Adapter, save_adapter
from studio.engine.model import Linear


class EmbeddingWithMask(nn.Module):
    """The base embedding table plus one trainable row at id `mask_id` (= the base vocab size)."""

    def __init__(self, base: nn.Embedding, row: torch.Tensor):
        super().__init__()
        self.base = base
        self.mask_id = base.weight.shape[0]
        self.row = row

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens.clamp(max=self.mask_id - 1), self.base.weight)
        return torch.where((tokens == self.mask_id)[..., None], self.row.to(x.dtype), x)


class Trainable:
    """LoRA A/B (rank r) on `targets` of every layer, and the MASK row: the tensors AdamW updates."""

    def __init__(self, model, r: int, alpha: float, targets: tuple[str, ...] = TARGETS, seed: int = 0,
                 init: Adapter | None = None):
        self.model, self.r, self.alpha, self.targets = model, r, alpha, list(targets)
        gen = torch.Generator().manual_seed(seed)
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.modules: dict[str, Linear] = {n: m for n, m in model.named_modules()
                                           if isinstance(m, Linear) and n.rsplit(".", 1)[-1] in targets}
        for name, m in self.modules.items():
            if init is not None:
                A, B = init.lora[name]
            else:  # PEFT's init: A ~ U(±1/sqrt(in)) (kaiming-uniform, a=sqrt(5)), B = 0 (starts as the base)
                bound = 1 / math.sqrt(m.in_features)
                A = (torch.rand(r, m.in_features, generator=gen) * 2 - 1) * bound
                B = torch.zeros(m.out_features, r)
            # the trained tensors stay fp32 (AdamW's small steps vanish in bf16); a half-precision model computes
            # with their casts (`bind`)
            like = dict(dtype=torch.float32, device=m.weight.device)
            self.pairs[name] = (A.to(**like).clone().requires_grad_(True), B.to(**like).clone().requires_grad_(True))
            m.lora_scale = alpha / r
        emb = model.model.embed_tokens
        V = model.lm_head.weight.shape[0]
        if init is not None and init.mask_embedding is not None:
            row = init.mask_embedding[0]
        else:  # the mean token embedding: a neutral start
            row = emb.weight[:V].detach().float().mean(0)
        self.mask_row = row.to(dtype=torch.float32, device=emb.weight.device).clone().requires_grad_(True)
        self._base_embedding = emb
        model.model.embed_tokens = EmbeddingWithMask(emb, self.mask_row)
        self.mask_id = V
        self.bind()

    def bind(self) -> None:
        """Put the trained tensors on their Linear layers, cast to the model's dtype: once per step on a
        half-precision model (a cast is a snapshot of its fp32 tensor), once for all on an fp32 one."""
        for name, m in self.modules.items():
            A, B = self.pairs[name]
            m.lora_A, m.lora_B = (A, B) if m.weight.dtype == A.dtype else (A.to(m.weight.dtype), B.to(m.weight.dtype))

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every trainable tensor, in a fixed order (the optimizer state is saved by these names)."""
        out = []
        for name, (A, B) in self.pairs.items():
            out += [(f"{name}.lora_A", A), (f"{name}.lora_B", B)]
        return out + [("mask_embedding", self.mask_row)]

    def save(self, path, block_size: int | None = None, adapted_rows: str | None = None,
             attention: str | None = None) -> None:
        """`adapted_rows`: the rows the LoRA was trained on, "mask" or "all" (the training's --gate); `attention`:
        the attention it was trained with, when not the base model's (`train mdm`: bidirectional)."""
        save_adapter(self.pairs, path, r=self.r, alpha=self.alpha, targets=self.targets,
                     mask_token_id=self.mask_id, mask_embedding=self.mask_row[None], block_size=block_size,
                     adapted_rows=adapted_rows, attention=attention)

    def n_params(self) -> int:
        return sum(t.numel() for _, t in self.named_tensors())

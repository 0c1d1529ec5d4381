"""A mixture-of-experts feed-forward layer: experts stacked per layer, a softmax top-k router (OLMoE / LLaDA-MoE).

Tokens are grouped by expert (one stable sort of the token→expert assignments), so each expert that received
tokens runs one SwiGLU over all of them: a Python loop over experts, never over tokens. The weighted outputs
are scattered back with one `index_add_`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from studio.engine.config import ModelConfig


class Experts(nn.Module):
    """E SwiGLU experts as stacked tensors: gate_proj, up_proj [E, I, D], down_proj [E, D, I]."""

    def __init__(self, n: int, dim: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, ffn, dim))
        self.up_proj = nn.Parameter(torch.empty(n, ffn, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, ffn))

    def run(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(h, self.gate_proj[e])) * F.linear(h, self.up_proj[e]), self.down_proj[e])


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k, self.renormalize = cfg.n_experts_per_tok, cfg.moe_renormalize
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)   # the router
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.moe_ffn_dim)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) [N, k]: softmax over every expert in fp32, the top k, renormalised if configured."""
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, experts = probs.topk(self.k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(flat.dtype), experts

    def forward(self, x: torch.Tensor, gate=None) -> torch.Tensor:
        """`gate` (the LoRA row gate) is accepted for the Block's sake: adapters do not reach the experts."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)
        order = experts.flatten().argsort(stable=True)       # assignments grouped by expert
        token = order // self.k
        counts = torch.bincount(experts.flatten(), minlength=self.gate.out_features).tolist()
        grouped = flat[token]
        out = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = self.experts.run(e, grouped[start:start + n])
                start += n
        y = torch.zeros_like(flat).index_add_(0, token, out * weights.flatten()[order, None])
        return y.view_as(x)

"""A mixture-of-experts feed-forward layer: experts stacked per layer behind a router, and optionally a shared
expert every token goes through.

Routers: `softmax` (OLMoE, LLaDA-MoE): softmax over every expert, the top k. `sigmoid` (Ling/Bailing v2, LLaDA2,
DeepSeek-V3): sigmoid scores; the selection adds a per-expert bias and keeps only the best groups (a group's score is
the sum of its two best experts), the weights are the unbiased scores of the chosen experts, normalised, times a
scaling factor.

Tokens are grouped by expert (one stable sort of the token→expert assignments), so each expert that received
tokens runs one SwiGLU over all of them: a Python loop over experts, never over tokens. The weighted outputs
are scattered back with one `index_add_`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from studio.engine.config import ModelConfig


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): a shared expert (Hugging Face names gate_proj, up_proj, down_proj)."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E SwiGLU experts as stacked tensors: gate_proj, up_proj [E, I, D], down_proj [E, D, I]."""

    def __init__(self, n: int, dim: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, ffn, dim))
        self.up_proj = nn.Parameter(torch.empty(n, ffn, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, ffn))

    def run(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(h, self.gate_proj[e])) * F.linear(h, self.up_proj[e]), self.down_proj[e])


class Router(nn.Module):
    """Which k experts each token goes to, with what weight. Parameters: `weight` [E, D], `expert_bias` [E]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        self.expert_bias = nn.Parameter(torch.zeros(cfg.n_experts)) if cfg.moe_expert_bias else None
        self.kind, self.k, self.renormalize = cfg.moe_router, cfg.n_experts_per_tok, cfg.moe_renormalize
        self.groups, self.topk_groups, self.scale = cfg.moe_groups, cfg.moe_topk_groups, cfg.moe_scale

    def forward(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) [N, k]; the scores are computed in fp32."""
        logits = F.linear(flat.float(), self.weight.float())
        if self.kind == "softmax":
            weights, experts = torch.softmax(logits, dim=-1).topk(self.k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            choose = scores if self.expert_bias is None else scores + self.expert_bias.float()
            by_group = choose.view(len(flat), self.groups, -1)
            best_groups = by_group.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            choose = by_group.masked_fill(~keep[..., None], float("-inf")).view(len(flat), -1)
            experts = choose.topk(self.k, dim=-1).indices
            weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scale).to(flat.dtype), experts


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k = cfg.n_experts_per_tok
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.moe_ffn_dim)
        self.shared_experts = SwiGLU(cfg.dim, cfg.moe_shared_ffn_dim) if cfg.moe_shared_ffn_dim else None
        self.experts_run = 0   # distinct experts the last forward ran

    def forward(self, x: torch.Tensor, gate=None) -> torch.Tensor:
        """`gate` (the LoRA row gate) is accepted for the Block's sake: adapters do not reach the experts."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        order = experts.flatten().argsort(stable=True)       # assignments grouped by expert
        token = order // self.k
        counts = torch.bincount(experts.flatten(), minlength=self.experts.gate_proj.shape[0]).tolist()
        self.experts_run = sum(1 for n in counts if n)   # read by DecodeContext for the forward event
        grouped = flat[token]
        out = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = self.experts.run(e, grouped[start:start + n])
                start += n
        y = torch.zeros_like(flat).index_add_(0, token, out * weights.flatten()[order, None])
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view_as(x)

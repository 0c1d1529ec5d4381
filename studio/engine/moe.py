"""A mixture-of-experts feed-forward layer: experts stacked per layer behind a router, and optionally a shared
expert every token goes through.

Routers: `softmax` (OLMoE, LLaDA-MoE): softmax over every expert, the top k. `sigmoid` (Ling/Bailing v2, LLaDA2,
DeepSeek-V3): sigmoid scores; the selection adds a per-expert bias and keeps only the best groups (a group's score is
the sum of its two best experts), the weights are the unbiased scores of the chosen experts, normalised, times a
scaling factor. `gemma` (Gemma-4, DiffusionGemma): the input RMS-normalised without a gain, times a learned `scale`
and 1/sqrt(D), softmax, the top k renormalised, each times its expert's learned `per_expert_scale`.

Experts are SwiGLU (silu) or GeGLU (tanh-approximated gelu: Gemma) by `ModelConfig.hidden_act`. Tokens are grouped
by expert (one stable sort of the token→expert assignments), so each expert that received tokens runs once over all of
them: a Python loop over experts, never over tokens -- or, on CUDA in bf16, three grouped GEMMs over all experts at
once (`F.grouped_mm`), the loop being its oracle. The weighted outputs are scattered back with one `index_add_`.
Under expert parallelism a rank holds some of the experts (`Experts.held`): the assignments to the other ranks'
experts sort after its own and contribute nothing; the ranks' partial outputs are added up by one all-reduce
(`MoE.reduce`).

The grouped path reads nothing on the host: every shape is the assignments' count, N × k, and the group sizes stay on
the device (counted with a scatter-add, not `bincount`, whose CUDA kernel reads the largest id on the host). So a
CUDA graph captures it, and an MoE model decodes under graphs (`Experts.captured_on`); the loop sizes its GEMMs on
the host and runs eagerly. Experts with 1-byte weights (`--quant int8|fp8`, `Experts.scales`) run on CUDA through
one Triton kernel (`kernels/quant_triton.py`: the assignments laid out by expert in blocks, the weights widened in
registers), which reads nothing on the host either; the loop, widening each expert's weight, is its oracle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from studio.engine.config import ModelConfig

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), act silu unless told: a shared expert (Hugging Face names gate_proj, up_proj,
    down_proj)."""

    def __init__(self, dim: int, ffn: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E gated experts as stacked tensors: gate_proj, up_proj [E, I, D], down_proj [E, D, I]."""
    # auto: grouped GEMMs on CUDA in bf16 (the Triton kernel for 1-byte weights), else the loop (their oracle); or
    # force "grouped" | "blocked" (the Triton kernel) | "loop"
    path = "auto"
    # expert parallelism: the router's experts this rank holds (E of them, studio.engine.tensor_parallel); None: all of them
    held: slice | None = None
    # weight-only int8/fp8 (studio.engine.quantize): each stacked weight is 1-byte, times these row scales [E, out]
    scales: dict[str, torch.Tensor] | None = None
    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, n: int, dim: int, ffn: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, ffn, dim))
        self.up_proj = nn.Parameter(torch.empty(n, ffn, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, ffn))
        self.act = ACTIVATIONS[act]

    def _apply(self, fn, recurse=True):
        if self.scales is not None:   # plain attributes: a move must reach them too
            self.scales = {name: fn(s) for name, s in self.scales.items()}
        return super()._apply(fn, recurse)

    def weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight `name` in `dtype` (a 1-byte one widened and scaled: the loop's way, the kernel's
        oracle)."""
        w = getattr(self, name)[e]
        return w if self.scales is None else w.to(dtype) * self.scales[name][e, :, None].to(dtype)

    def run(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self.weight(name, e, h.dtype) for name in self.PROJECTIONS)
        return F.linear(self.act(F.linear(h, gate)) * F.linear(h, up), down)

    def mix(self, flat: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """sum_k weights[:, k] * expert_{experts[:, k]}(flat) for flat [N, D], weights and experts [N, k]; and the
        number of distinct experts that ran (a 0-d tensor: reading it is the caller's sync)."""
        n, k = self.gate_proj.shape[0], experts.shape[1]
        assignment = experts.flatten()
        if self.held is not None:   # another rank's expert becomes n: its rows sort last and no GEMM reaches them
            local = assignment - self.held.start
            assignment = torch.where((local >= 0) & (local < n), local, n)
        path = self.path_on(flat.device, flat.dtype)
        if path == "blocked":
            return self._blocked(flat, weights, assignment, k)
        order = assignment.argsort(stable=True)               # assignments grouped by expert
        token = order // k
        # counted by a scatter-add, not bincount: bincount's CUDA kernel reads the ids' range on the host
        counts = torch.zeros(n + 1, dtype=torch.long, device=flat.device).scatter_add_(
            0, assignment, torch.ones_like(assignment))[:n]
        grouped = flat[token]
        out = self._grouped(grouped, counts) if path == "grouped" else self._looped(grouped, counts)
        weight = weights.flatten()[order, None]                 # routers weigh in fp32: back to the stream's dtype
        if self.held is not None:   # the rows past this rank's groups hold whatever the GEMMs left there
            weighted = torch.where(assignment[order, None] < n, out * weight, 0)
        else:
            weighted = out * weight
        y = torch.zeros_like(flat).index_add_(0, token, weighted.to(flat.dtype))
        return y, (counts > 0).sum()

    def path_on(self, device: torch.device, dtype: torch.dtype) -> str:
        """What `path` comes to there: auto is the Triton kernel for 1-byte weights on CUDA, grouped GEMMs on CUDA in
        bf16, else the loop (on the CPU the fastest)."""
        if self.path != "auto":
            return self.path
        if device.type == "cuda" and self.scales is not None:
            return "blocked"
        if device.type == "cuda" and dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
            return "grouped"
        return "loop"

    def captured_on(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a CUDA graph can capture these experts there: the grouped GEMMs and the Triton kernel read nothing
        on the host, the loop sizes its GEMMs there."""
        return device.type == "cuda" and self.path_on(device, dtype) != "loop"

    def _blocked(self, flat: torch.Tensor, weights: torch.Tensor, assignment: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernel over the assignments laid out by expert in blocks (kernels/quant_triton.py): three
        launches, no host read, every shape fixed by the assignment count."""
        from studio.engine.kernels.quant_triton import expert_blocks, quant_grouped_mm
        n = self.gate_proj.shape[0]
        slot, rows, blocks = expert_blocks(assignment, n)
        token_rows = torch.where(rows >= 0, rows // k, -1)
        gate, up = (quant_grouped_mm(flat, getattr(self, name), self.scales[name], token_rows, blocks)
                    for name in self.PROJECTIONS[:2])
        out = quant_grouped_mm(self.act(gate) * up, self.down_proj, self.scales["down_proj"], None, blocks)
        weighted = torch.where((slot >= 0)[:, None], out[slot.clamp(min=0)] * weights.flatten()[:, None], 0)
        token = torch.arange(len(assignment), device=flat.device) // k
        y = torch.zeros_like(flat).index_add_(0, token, weighted.to(flat.dtype))
        ran = torch.zeros(n + 1, dtype=torch.long, device=flat.device)
        return y, ran.scatter_(0, torch.where(blocks >= 0, blocks, n), 1)[:n].sum()

    def _looped(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One GEMM per expert that received tokens: the group sizes are read on the host."""
        out = torch.zeros_like(grouped)   # rows of no held expert stay 0
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                out[start:start + n] = self.run(e, grouped[start:start + n])
                start += n
        return out

    def _grouped(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same three projections as grouped GEMMs over every expert at once (PyTorch's grouped_mm: the group
        boundaries stay on the device, no per-expert launch)."""
        ends = counts.cumsum(0).to(torch.int32)
        gate = F.grouped_mm(grouped, self.gate_proj.transpose(1, 2), offs=ends)
        up = F.grouped_mm(grouped, self.up_proj.transpose(1, 2), offs=ends)
        return F.grouped_mm(self.act(gate) * up, self.down_proj.transpose(1, 2), offs=ends)


class Router(nn.Module):
    """Which k experts each token goes to, with what weight. Parameters: `weight` [E, D], `expert_bias` [E]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        self.expert_bias = nn.Parameter(torch.zeros(cfg.n_experts)) if cfg.moe_expert_bias else None
        if cfg.moe_router == "gemma":
            self.scale = nn.Parameter(torch.ones(cfg.dim))
            self.per_expert_scale = nn.Parameter(torch.ones(cfg.n_experts))
        self.kind, self.k, self.renormalize = cfg.moe_router, cfg.n_experts_per_tok, cfg.moe_renormalize
        self.groups, self.topk_groups, self.routed_scale = cfg.moe_groups, cfg.moe_topk_groups, cfg.moe_scale
        self.eps = cfg.rms_eps

    def forward(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) [N, k]; the scores are computed in fp32."""
        if self.kind == "gemma":
            flat = F.rms_norm(flat.float(), flat.shape[-1:], eps=self.eps) * self.scale.float() * flat.shape[-1] ** -0.5
        logits = F.linear(flat.float(), self.weight.float())
        if self.kind in ("softmax", "gemma"):
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
        if self.kind == "gemma":
            weights = weights * self.per_expert_scale.float()[experts]
        return (weights * self.routed_scale).to(flat.dtype), experts


class MoE(nn.Module):
    # tensor/expert parallelism: the routed and shared outputs are this rank's partial sum, which this adds up
    # across the ranks (studio.engine.tensor_parallel); None on one process
    reduce = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.moe_ffn_dim, cfg.hidden_act)
        self.shared_experts = SwiGLU(cfg.dim, cfg.moe_shared_ffn_dim, cfg.hidden_act) if cfg.moe_shared_ffn_dim else None
        self.experts_run = torch.tensor(0)   # distinct experts the last forward ran

    def forward(self, x: torch.Tensor, gate=None, expert_input: torch.Tensor | None = None) -> torch.Tensor:
        """The router reads x; the experts read `expert_input` (Gemma normalises it apart), else x too. `gate` (the
        LoRA row gate) is accepted for the Block's sake: adapters do not reach the experts."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        expert_flat = flat if expert_input is None else expert_input.reshape(flat.shape)
        y, self.experts_run = self.experts.mix(expert_flat, weights, experts)   # read for the forward event
        if self.experts.held is not None:   # every expert the router chose, not only this rank's
            chosen = experts.flatten()
            self.experts_run = torch.zeros(self.gate.weight.shape[0], dtype=torch.long,
                                           device=chosen.device).scatter_(0, chosen, 1).sum()
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return (y if self.reduce is None else self.reduce(y)).view_as(x)

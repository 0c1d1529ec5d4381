"""Weight-only int8 (`--quant int8`): every projection of the layers (`model.Linear`: attention, dense MLPs) keeps its
weight as int8 with one scale per output row (symmetric, the row's largest magnitude / 127), and the head an int8
copy beside the float one (a tied embedding keeps reading its float rows); activations, norms, the embedding and
an MoE's stacked experts stay in the model's dtype. A decode step streams its weights, so a quarter of their bytes
is the point (`kernels/skinny.c`'s int8 kernel for up to 16 rows on the CPU).

The quantised model is a model of its own: the strategies are exact to it (a strategy equals greedy `ar` of the
model it runs), and it is close to `dequantized(model)` -- the same numbers in float -- by the order of
accumulation only, which the tests bound. How far it is from the float model is a matter of measurement
(`dlm-studio bench --quant int8` against a float run), not of exactness."""
from __future__ import annotations

import copy

import torch
from torch import nn

from studio.engine.model import Linear, unfuse_projections

QUANTS = ("none", "int8")


def _rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, D] as int8 [N, D] and fp32 scales [N]: each row over its largest magnitude / 127, rounded."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)   # a zero row: any scale
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.contiguous()


def quantize_int8(model: nn.Module) -> None:
    """Every `Linear` of the model in int8 with fp32 row scales, and an int8 copy of the head beside the float one
    (which a tied embedding keeps reading), in place. Call it once the model is on its device and dtype, before
    `fuse_projections` (a fused product concatenates its parts' int8 rows and scales)."""
    for m in model.modules():
        if isinstance(m, Linear) and m.scale is None:
            assert not m.fused, "quantise before fusing"
            q, m.scale = _rows_int8(m.weight)
            m.weight = nn.Parameter(q, requires_grad=False)
    if model.head_scale is None:
        model.head_int8, model.head_scale = _rows_int8(model.lm_head.weight)


def is_quantized(model: nn.Module) -> bool:
    return model.head_scale is not None   # quantize_int8 makes the int8 head with the layers


def dequantized(model: nn.Module) -> nn.Module:
    """A copy of a quantised model with float weights holding the same numbers (int8 x scale), unfused: the oracle
    the int8 kernels are tested against, and a float model's stand-in for timing."""
    twin = copy.deepcopy(model)
    unfuse_projections(twin)
    for m in twin.modules():
        if isinstance(m, Linear) and m.scale is not None:
            m.weight = nn.Parameter(m.weight.float() * m.scale[:, None], requires_grad=False)
            m.scale = None
    if twin.head_scale is not None:   # a head of its own (a tied embedding keeps its float rows)
        twin.lm_head.weight = nn.Parameter(twin.head_int8.float() * twin.head_scale[:, None], requires_grad=False)
        twin.head_int8 = twin.head_scale = None
    return twin

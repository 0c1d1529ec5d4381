"""RMSNorm with the residual add before it: h = x + delta (in x's dtype), y = weight * (h / rms(h), computed in fp32
and cast back) -- the Llama/Qwen norm. The plain path writes it as eight small kernels (the add, the casts, the
square, the mean, the rsqrt, two products): on CUDA, outside autograd and with Triton installed, one program per
row does it all (`norm_triton.py`); elsewhere torch's `F.rms_norm` computes the same in one op, bit for bit the
formula written out on the CPUs tested (tests/engine/test_norm.py holds both to it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from studio.engine.kernels import _triton_installed


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), computed in fp32, without a gain."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y) for x, delta [..., D] (delta None: h is x), weight [D]."""
    if x.is_cuda and not torch.is_grad_enabled() and _triton_installed():
        from studio.engine.kernels.norm_triton import add_rms_norm_fused
        return add_rms_norm_fused(x, delta, weight, eps)
    h = x if delta is None else x + delta
    return h, weight * rms_norm(h, eps)

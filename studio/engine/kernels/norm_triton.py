"""The fused residual add + RMSNorm as one Triton program per row (its torch twin: `norm.add_rms_norm` off CUDA).

The row is read once: the add rounds to the activations' dtype before the norm reads it, as the plain add does; the
sum of squares and the rsqrt are fp32; the product by the weight is in the activations' dtype. Only the sum's order
differs from torch's. Under TRITON_INTERPRET=1 it runs on the CPU (the tests)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(X, DELTA, W, H, Y, n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=keep, other=0.0)
    if HAS_DELTA:
        x = (x + tl.load(DELTA + row * n_cols + cols, mask=keep, other=0.0)).to(X.dtype.element_ty)
        tl.store(H + row * n_cols + cols, x, mask=keep)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=keep, other=0.0)
    tl.store(Y + row * n_cols + cols, (w * normed).to(Y.dtype.element_ty), mask=keep)


def add_rms_norm_fused(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y) as `norm.add_rms_norm` computes them, in one launch."""
    D = x.shape[-1]
    flat = x.reshape(-1, D).contiguous()
    d = None if delta is None else delta.reshape(-1, D).contiguous()
    h = flat if d is None else torch.empty_like(flat)
    y = torch.empty_like(flat, dtype=torch.promote_types(x.dtype, weight.dtype))
    _add_rms_norm[(flat.shape[0],)](flat, flat if d is None else d, weight, h, y, D, eps, HAS_DELTA=d is not None,
                                    BLOCK=triton.next_power_of_2(D))
    return h.view(x.shape), y.view(x.shape)

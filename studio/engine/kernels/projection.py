"""How a projection runs: on the CPU in fp32 a product of at most WIDE_ROWS rows goes around torch's F.linear -- 1-4
rows through our own kernel (`kernels/cpu.py`), 3-128 rows through oneDNN on a pre-packed copy of the weight -- and
everything else through F.linear (docs/architecture.md#cpu-projections). The packed copies are
made by `pack_weights` before a run's clock starts, kept across a head's MASK-row writes (`keep_packed_copy`) and
forgone for a model large against the machine's memory (`forgo_packed_copies`)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from studio.engine.compiled import opaque_to_compile
from studio.engine.kernels import cpu as cpu_kernel

SMALL_ROWS = 16
# The most rows a CPU product runs through oneDNN on its packed weight: 1.5-3.7x faster than F.linear at 17-128 rows
# on the embedded model's shapes (a Jacobi window of 16 with its pending row, Jacobi MR's layout, a short prompt's
# prefill); SMALL_ROWS bounds the decode-sized products of the other paths (the LoRA's, CUDA's 1-byte weights)
WIDE_ROWS = 128
# Row counts from which a CPU projection runs through oneDNN on a pre-packed copy of its weight (`linear`)
PACKED_ROWS = 3
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _w_xt(w: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """flat [R, D] through w [N, D] as w @ flat.T, [R, N]. One row is doubled: a one-column product would take
    torch's GEMV path, which on the CPU runs ~2x slower than this GEMM with two columns."""
    r = flat.shape[0]
    cols = torch.cat([flat, flat]) if r == 1 and flat.device.type == "cpu" else flat
    return torch.mm(w, cols.t())[:, :r].t()


def _packed(w: torch.Tensor) -> torch.Tensor | None:
    """w in oneDNN's blocked layout, made on first use and remade when w changes (its storage or version); None for
    a weight `forgo_packed_copies` marked, and for an inference tensor, which has no version to tell a change by."""
    cached = getattr(w, "_onednn", None)
    if cached is False or w.is_inference():
        return None
    key = (w.data_ptr(), w._version)
    if cached is None or cached[0] != key:
        cached = key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        w._onednn = cached
    return cached[1]


def cpu_small(x: torch.Tensor, rows: int = SMALL_ROWS) -> bool:
    """A decode-sized fp32 product on the CPU outside autograd (at most `rows` rows): the shapes `linear` routes around
    F.linear."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled()
            and x.numel() <= rows * x.shape[-1])


def _rows_by_n(w: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The shape of a product's output, [R, N], for the compiled graph (`opaque_to_compile`)."""
    return flat.new_empty(flat.shape[0], w.shape[0])


@opaque_to_compile("small_product", fake=_rows_by_n)
def _small_product(w: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """flat [R, D] through w [N, D] for R <= WIDE_ROWS on the CPU, contiguous [R, N]: 1-4 rows through our own kernel
    (each weight row read once for all of them, a row's result the same bits at any of those row counts), 5+ through
    oneDNN on the packed weight, whose time barely grows with the rows where MKL's small-M kernels grow ~linearly.
    Without the kernel (no C compiler) 1-2 rows run as w @ flat.T (docs/architecture.md#cpu-projections)."""
    if flat.shape[0] <= cpu_kernel.MAX_ROWS:
        y = cpu_kernel.skinny(w, flat.contiguous())
        if y is not None:
            return y
    packed = _packed(w) if flat.shape[0] >= PACKED_ROWS and _HAS_ONEDNN else None
    if packed is None:
        return _w_xt(w, flat).contiguous()   # the layout the op's fake promises the compiled graph
    return torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")


def pack_weights(model: nn.Module) -> None:
    """Make the packed copies of the model's projections and head now (a run whose forwards are 3-128 rows wide calls
    this before its clock starts), not inside its first forwards: ~0.4 s for the embedded model on a 2-core CPU."""
    if not _HAS_ONEDNN or model.lm_head.weight.device.type != "cpu" or model.lm_head.weight.dtype != torch.float32:
        return
    with torch.no_grad():
        head = [model.lm_head.weight] if model.head_scale is None else []   # a quantised model reads its 1-byte head
        for w in model.projection_weights() + head:
            if w.dtype == torch.float32:   # 1-byte weights have their own kernels
                _packed(w)


def keep_packed_copy(w: torch.Tensor, write: Callable[[], None]) -> None:
    """Run `write`, which must leave w's values alone, and keep w's packed copy if it was current. A tied head is a
    view of the embedding table, so writing an adapter's MASK rows past it bumps its version too: without this, a
    comparison that switches adapters every step re-packed the whole head (a fifth of a small model) every switch."""
    cached = getattr(w, "_onednn", None)
    current = isinstance(cached, tuple) and cached[0] == (w.data_ptr(), w._version)
    write()
    if current:
        w._onednn = (w.data_ptr(), w._version), cached[1]


def forgo_packed_copies(model: nn.Module) -> None:
    """Keep `model`'s projections to their one fp32 copy: the packed copies `_small_product` makes hold as many
    bytes again, which a model large against the machine's memory cannot spare."""
    for p in model.parameters():
        p._onednn = False


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] @ w.T (+ b). On the CPU in fp32 a product of at most WIDE_ROWS rows goes around torch's
    F.linear, whose GEMV for one row and small-M GEMMs read the weights slowly (`_small_product`); wider products
    (a long prefill), training and other devices keep F.linear. With `scale`, w is 1-byte and row n of it stands for
    w[n] * scale[n] (`quant_linear`)."""
    if scale is not None:
        return quant_linear(x, w, scale, b)
    if not cpu_small(x, WIDE_ROWS):
        return F.linear(x, w, b)
    y = _small_product(w, x.reshape(-1, x.shape[-1]))
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[0])


def quant_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] @ (w * scale[:, None]).T (+ b) for a 1-byte w [N, D] (int8, or fp8 on CUDA): up to SMALL_ROWS rows
    read the weights as they are stored -- on the CPU in fp32 through our int8 kernel (a row's bits the same at every
    such row count), on CUDA through the Triton kernel (`quant_triton.py`) -- and wider products (a prefill) widen the
    weight to x's dtype for one product and scale its result (for a 34-token prefill on the CPU ~25x faster than
    torch's `_weight_int8pack_mm` in fp32)."""
    y = _quant_product(w, scale, x.reshape(-1, x.shape[-1]).contiguous())
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], w.shape[0])


@opaque_to_compile("quant_product", fake=lambda w, scale, flat: _rows_by_n(w, flat))
def _quant_product(w: torch.Tensor, scale: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """flat [R, D] @ (w * scale[:, None]).T, contiguous: a kernel where one takes the operands, else w widened."""
    if flat.is_cuda and flat.shape[0] <= SMALL_ROWS:
        from studio.engine.kernels.quant_triton import quant_mm
        return quant_mm(flat, w, scale)
    y = cpu_kernel.skinny_int8(w, scale, flat) if flat.device.type == "cpu" and flat.dtype == torch.float32 else None
    return F.linear(flat, w.to(flat.dtype)) * scale.to(flat.dtype) if y is None else y


def vocab_logits(head: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float logits of x [..., D] through the head [V, D], as W @ x.T for any row count: BLAS streams the head once,
    where F.linear's small-M GEMM is ~3x slower at 7 rows on CPU (the head is a fifth of a small model)."""
    flat = x.reshape(-1, x.shape[-1])
    out = _small_product(head, flat) if cpu_small(flat, WIDE_ROWS) else _w_xt(head, flat)
    return out.reshape(*x.shape[:-1], -1).float().contiguous()

"""The gated LoRA term of a projection: which rows of a forward get it (`RowGate`) and adding it to the base
projection for those rows only (`add_gated_lora`), so rows whose gate is off get exactly the base projection --
R-ISD's clean rows and their KV stay bit-identical to the base model -- and a forward with 3 MASK rows of 7 pays
for 3 rows of LoRA. `studio.engine.model.Linear` composes it with the base projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from studio.engine.compiled import opaque_to_compile
from studio.engine.kernels import cpu as cpu_kernel
from studio.engine.kernels.projection import cpu_small


class RowGate:
    """Which rows of a forward get the LoRA term: the flat indices of the gated rows, or every row.
    Built once per forward; every adapted Linear reads it. `dense=True` (CUDA graphs) takes a 0/1
    float gate instead: every row computes the low-rank term, times its gate -- fixed shapes, no nonzero()."""

    def __init__(self, gate: torch.Tensor, dense: bool = False):
        self.mult = gate[..., None] if dense else None   # [B, T, 1]
        self.rows = None if dense or bool(gate.all()) else gate.flatten().nonzero().squeeze(1)
        # gated rows in one run (R-ISD's MASK rows are the tail of the forward): slices instead of a
        # gather and a scatter -- views, no copies
        self.span = None
        if self.rows is not None and int(self.rows[-1] - self.rows[0]) == len(self.rows) - 1:
            self.span = slice(int(self.rows[0]), int(self.rows[-1]) + 1)


@opaque_to_compile("lora_rows", fake=lambda x, y, first, a, b, scale: None, mutates_args=("y",))
def _add_lora_rows(x: torch.Tensor, y: torch.Tensor, first: int, a: torch.Tensor, b: torch.Tensor,
                   scale: float) -> None:
    """y[first:first + len(x)] += scale * (x @ a.T) @ b.T in place: our kernel where it takes the operands, else two
    products. It takes all of y and slices the rows itself: torch 2.13's compiled graph writes a custom op's
    mutation of a view sliced in both dims (gated rows of a fused product's columns) to the wrong place."""
    y = y[first:first + x.shape[0]]
    if not cpu_kernel.lora_rows(x, y, a, b, scale):
        y.addmm_(torch.mm(x, a.t()), b.t(), alpha=scale)


def add_gated_lora(x: torch.Tensor, y: torch.Tensor, gate: RowGate, lora_A: torch.Tensor, lora_B: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """y (the base projection of x, fresh: added to in place) plus the LoRA term on the rows `gate` picks."""
    flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])   # y is fresh: add in place
    if gate.mult is None and (gate.rows is None or gate.span is not None) and cpu_small(x):
        rows = slice(None) if gate.rows is None else gate.span
        # a decode forward on the CPU: one call for the gated run of rows, where torch's small ops cost ~20 us
        # each in every projection
        _add_lora_rows(flat_x[rows].contiguous(), flat_y, rows.start or 0, lora_A, lora_B, scale)
        return y
    if gate.rows is None:
        delta = F.linear(F.linear(x, lora_A), lora_B) * scale
        return y + delta if gate.mult is None else y + delta * gate.mult   # gate 0: y + 0 == y exactly
    rows = gate.rows if gate.span is None else gate.span
    low = torch.mm(flat_x[rows], lora_A.t())
    if gate.span is None:
        flat_y.index_add_(0, rows, torch.mm(low, lora_B.t()).to(y.dtype), alpha=scale)
    else:   # one product-and-add into the rows' view: a decode forward runs this in every projection
        flat_y[rows].addmm_(low, lora_B.t(), alpha=scale)
    return y

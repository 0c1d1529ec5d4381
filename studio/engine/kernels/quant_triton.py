"""Weight-only int8 and fp8 products on a GPU: one Triton kernel reads the 1-byte weights, widens them to the
activations' dtype in registers and scales each output column by its row's scale, so a decode step streams half the
bytes of bf16 (`studio.engine.quantize`). Without such a kernel a GPU would widen every weight in memory at every
product, which is slower than bf16.

The same kernel runs a mixture of experts with static shapes (what a CUDA graph captures): the token->expert
assignments are laid out by expert in blocks of BLOCK_M slots (`expert_blocks`, all on the device: a scatter-add of
the group sizes and a stable sort, the padded layout's size fixed by the assignment count), and each program reads
its block's expert id and the rows it gathers; a block with no expert (-1) reads nothing. It is vLLM's fused-MoE
layout, written for weight-only int8/fp8.

Tested on the CPU in Triton's interpreter (TRITON_INTERPRET=1) against the dequantised weights' product.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16   # tl.dot's smallest tile: a decode step's 1-16 rows are one block


@triton.jit
def _quant_mm(x_ptr, w_ptr, s_ptr, out_ptr, rows_ptr, experts_ptr, M, N, K,
              stride_x, stride_we, stride_se, stride_out,
              GATHER: tl.constexpr, GROUPED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_k x[row(m), k] * w[e, n, k] * s[e, n] for the slots m of this program's block: row(m) = rows[m]
    (GATHER; -1 = a padding slot) or m, e = experts[block] (GROUPED; -1 = an empty block, nothing read) or 0."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    if GATHER:
        rows = tl.load(rows_ptr + slots, mask=slots < M, other=-1)
    else:
        rows = tl.where(slots < M, slots, -1)
    expert = tl.load(experts_ptr + pid_m) if GROUPED else tl.full((), 0, tl.int64)
    live_rows = rows >= 0
    live_cols = cols < tl.where(expert >= 0, N, 0)   # an empty block reads no weight
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=live_rows[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * K + k[:, None],
                    mask=live_cols[None, :] & (k[:, None] < K), other=0.0)
        acc += tl.dot(x, w.to(x.dtype))
    s = tl.load(s_ptr + tl.maximum(expert, 0) * stride_se + cols, mask=live_cols, other=0.0)
    out = (acc * s[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + slots[:, None].to(tl.int64) * stride_out + cols[None, :], out,
             mask=(slots[:, None] < M) & (cols[None, :] < N))


def _launch(x, w, scale, out, rows, experts, n_slots: int) -> torch.Tensor:
    N, K = w.shape[-2], w.shape[-1]
    block_n, block_k = 64, min(128, triton.next_power_of_2(K))
    grid = (triton.cdiv(n_slots, BLOCK_M), triton.cdiv(N, block_n))
    _quant_mm[grid](x, w, scale, out, rows if rows is not None else x, experts if experts is not None else x,
                    n_slots, N, K, x.stride(0), w.stride(0) if w.dim() == 3 else 0,
                    scale.stride(0) if scale.dim() == 2 else 0, out.stride(0),
                    GATHER=rows is not None, GROUPED=experts is not None,
                    BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def quant_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (w * scale[:, None]).T for 1-byte w [N, K] (int8 or fp8), scale [N] fp32: [M, N] in x's dtype."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, w, scale, out, None, None, x.shape[0])


def expert_blocks(assignment: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The assignments [A] (expert ids; n_experts or more: none of this rank's) laid out by expert in blocks of
    BLOCK_M slots: (slot [A] of each assignment, -1 for none; rows [P]: the assignment in each slot, -1 for padding;
    experts [P / BLOCK_M]: each block's expert, -1 for an empty block). P, the padded layout's size, depends on A and
    n_experts alone (every expert's group padded by at most BLOCK_M - 1), and nothing is read on the host."""
    A, dev = assignment.numel(), assignment.device
    n_blocks = triton.cdiv(A, BLOCK_M) + min(n_experts, A)
    P = n_blocks * BLOCK_M
    held = assignment < n_experts
    expert = torch.where(held, assignment, n_experts)
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts[:n_experts] + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = padded.cumsum(0) - padded                        # each expert's first slot
    order = expert.argsort(stable=True)                       # assignments by expert, in order within one
    by_expert = expert[order]
    group_start = counts.cumsum(0) - counts                   # each expert's first place in `order`
    rank = torch.arange(A, device=dev) - group_start[by_expert]
    sorted_slot = torch.where(by_expert < n_experts, starts[by_expert.clamp(max=n_experts - 1)] + rank, P)
    slot = torch.empty_like(sorted_slot).scatter_(0, order, sorted_slot)
    rows = torch.full((P + 1,), -1, dtype=torch.long, device=dev).scatter_(0, sorted_slot, order)[:P]
    experts = torch.full((n_blocks + 1,), -1, dtype=torch.long, device=dev).scatter_(
        0, sorted_slot // BLOCK_M, torch.where(by_expert < n_experts, by_expert, -1))[:n_blocks]
    return torch.where(held, slot, -1), rows, experts


def quant_grouped_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None,
                     experts: torch.Tensor) -> torch.Tensor:
    """For each slot m of `expert_blocks`' layout: x[rows[m]] (x[m] when rows is None: x already in slot order)
    through expert experts[m // BLOCK_M]'s w [E, N, K] (1-byte) * scale [E, N]: [P, N] in x's dtype; padding slots
    and empty blocks hold zeros or whatever was there."""
    x = x.contiguous()
    P = experts.numel() * BLOCK_M
    out = torch.zeros(P, w.shape[1], dtype=x.dtype, device=x.device)
    return _launch(x, w, scale, out, rows, experts, P)

"""Training layouts: which noisy rows see what (the I-DLM paper's appendix E; block diffusion, SDAR-style).

The reference I-DLM layout is one sequence `[x_t | x_0]` of 2L rows (`app_e_mask`): noisy blocks of b
MASKs, causal inside a block, each seeing the clean tokens of strictly earlier blocks; the clean copy is
plain causal and never sees x_t. Positions are duplicated (x_t[i] and x_0[i] share position i).

We train the same thing in two passes (a clean pass whose K/V the noisy rows then read), because on a
CPU the clean pass of an R-ISD adapter is the base model: no gradient, computed once per batch, and only
a sample of noisy blocks needs a backward. `noisy_rows_mask` is the noisy rows' part of the layout over
[clean K/V | noisy rows], for blocks starting anywhere (inference opens a block after any token); with
the aligned starts 0, b, 2b, … it is exactly App. E's noisy rows (a test checks it against a brute-force
reading of the reference's `allowed`). With `bidirectional=True` it is the block-diffusion variant:
bidirectional inside a block, as `blockdiff`, `s2d2` and `simsd` draft.
"""
from __future__ import annotations

import torch


def app_e_mask(n: int, b: int) -> torch.Tensor:
    """The reference [x_t | x_0] mask, bool [2n, 2n] (True = may attend), built with tensor ops."""
    idx = torch.arange(2 * n)
    clean = idx >= n
    blk = torch.where(clean, idx - n, idx) // b
    qc, kc = clean[:, None], clean[None, :]
    qb, kb = blk[:, None], blk[None, :]
    causal = idx[:, None] >= idx[None, :]
    noisy = (qb == kb) & ~qc & ~kc & causal
    cross = (qb > kb) & kc & ~qc
    clean_causal = qc & kc & causal
    return noisy | cross | clean_causal


def noisy_rows_mask(starts: list[int], b: int, n_clean: int, bidirectional: bool = False) -> torch.Tensor:
    """bool [K*b, n_clean + K*b]: block k (rows k*b … k*b+b-1, at positions starts[k] …) sees clean slots
    < starts[k] and its own rows (causal, or all of them when `bidirectional`); never another block."""
    K = len(starts)
    row_blk = torch.arange(K * b) // b
    row_off = torch.arange(K * b) % b
    s = torch.tensor(starts, dtype=torch.long)[row_blk]
    see_clean = torch.arange(n_clean)[None, :] < s[:, None]
    same = row_blk[:, None] == row_blk[None, :]
    own = same if bidirectional else same & (row_off[None, :] <= row_off[:, None])
    return torch.cat([see_clean, own], dim=1)


def block_positions(starts: list[int], b: int) -> torch.Tensor:
    """RoPE positions of the noisy rows: block k covers starts[k] … starts[k]+b-1."""
    return (torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(b)[None, :]).reshape(-1)


def jacobi_forcing_layout(prompt_len: int, n: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jacobi Forcing's packed sequence `prompt + [k_0, l_0, k_1, l_1, ...]` (noisy block k_j, clean block l_j, n
    tokens each): (positions [N], mask bool [N, N]), N = prompt_len + 2 * n_blocks * n. k_j and l_j share the
    positions prompt_len + j*n + (0..n-1). The noise-aware causal mask: the prompt is causal; a noisy block sees the
    prompt, the earlier noisy blocks and itself causally; a clean block the prompt, the earlier clean blocks and
    itself causally; noisy and clean never see each other. One forward reads both streams."""
    P, N = prompt_len, prompt_len + 2 * n_blocks * n
    idx = torch.arange(N)
    rel = (idx - P).clamp(min=0)
    pair, offset = rel // (2 * n), rel % (2 * n)
    stream = torch.where(idx < P, 0, torch.where(offset < n, 1, 2))          # 0 prompt, 1 noisy, 2 clean
    order = torch.where(idx < P, idx, P + pair * n + offset % n)            # the position within its stream
    q, k = (stream[:, None], order[:, None]), (stream[None, :], order[None, :])
    causal = k[1] <= q[1]
    mask = (k[0] == 0) & causal | (k[0] == q[0]) & (q[0] > 0) & causal
    return order, mask

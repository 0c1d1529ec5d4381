"""Attention-mask builders. A mask is bool [T_new, n_past + T_new]; True = may attend.

The first n_past columns are the committed KV slots, the rest are the new rows in input order, so
every mask plugs straight into `Transformer.forward(tokens, positions, kv, mask=...)` with
`kv.length == n_past`. Layouts whose RoPE positions are not simply `pos0 + arange(T_new)` (the 2L
verifier, SimSD) also return those position ids; `pos0` defaults to n_past (slot index = position).

Builders: `causal` (optionally sliding-window), `bidirectional` (LLaDA / Dream / DiffusionGemma over a canvas), `block_causal` (SDAR / Fast-dLLM v2 drafting and commit), `partially_causal_draft`
(S2D2 Eq. 4), `s2d2_verifier` (S2D2 Eq. 3, the "2L trick"), `simsd_temporal` (SimSD §3.1).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _with_past(new: torch.Tensor, n_past: int, past_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Prepend n_past committed columns, visible to every row (or to `past_rows` only)."""
    past = torch.ones(new.shape[0], n_past, dtype=torch.bool, device=new.device)
    if past_rows is not None:
        past &= past_rows[:, None]
    return torch.cat([past, new], dim=1)


def causal(n_new: int, n_past: int, device="cpu", window: int = 0) -> torch.Tensor:
    """Row i sees all committed slots and new rows 0..i (plain causal attention); with a `window`, only the last
    `window` slots up to itself (a sliding-window layer: slot > own slot - window)."""
    cols = torch.arange(n_past + n_new, device=device)
    rows = torch.arange(n_new, device=device) + n_past
    mask = cols[None, :] <= rows[:, None]
    return mask & (cols[None, :] > rows[:, None] - window) if window else mask


def bidirectional(n_new: int, n_past: int, device="cpu", window: int = 0) -> torch.Tensor:
    """Every row sees every committed slot and every new row (a bidirectional model's canvas forward); with a
    `window`, only the last `window - 1` committed slots (DiffusionGemma's sliding layers over a canvas: every canvas
    row sees the same recent prefix, what its encoder's sliding cache keeps)."""
    mask = torch.ones(n_new, n_past + n_new, dtype=torch.bool, device=device)
    if window:
        mask[:, :max(0, n_past - (window - 1))] = False
    return mask


def block_causal(n_new: int, n_past: int, block_size: int, offset: int = 0, device="cpu") -> torch.Tensor:
    """Block-causal mask of block diffusion (SDAR / Fast-dLLM v2 drafting, prefill and commit; S2D2 §3).

    New row i lies in block (offset + i) // block_size (offset = the first new token's index inside its
    block) and sees every committed slot plus every new row of its own block (bidirectional) and of earlier
    blocks (causal). A last block shorter than block_size is just a partial block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    blk = (torch.arange(n_new, device=device) + offset) // block_size
    return _with_past(blk[None, :] <= blk[:, None], n_past)


def partially_causal_draft(n_new: int, n_past: int, first_mask: int, device="cpu") -> torch.Tensor:
    """S2D2's optional partially causal drafting mask (S2D2 §4.2 Eq. 4, App. Fig. 4; `draft_ver`).

    The new rows are one open block whose first `first_mask` tokens (left of its first MASK) count as
    committed: those rows are token-causal (committed slots + rows 0..i); rows >= first_mask see the
    committed slots and the whole block (bidirectional).
    """
    j = max(0, min(first_mask, n_new))
    new = causal(n_new, 0, device=device)
    new[j:] = True
    return _with_past(new, n_past)


def s2d2_verifier(n_draft: int, n_past: int, pos0: int | None = None, verify_block: int = 1,
                  device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """S2D2's "2L trick" verifier for position-aligned models (S2D2 §4.2 Eq. 3; D2F's generalisation).

    Layout (2L rows, L = n_draft): rows [0, L) are the clean draft-filled tokens x_0..x_{L-1}, rows
    [L, 2L) are L MASK tokens; both halves share positions pos0..pos0+L-1. Mask [[A, 0], [A<, I]]: clean
    row i sees committed + clean j <= i; MASK row L+i sees committed + clean j < i + itself only, so its
    logits are those of a block-size-1 forward predicting token i. With verify_block b > 1 (D2F) clean
    rows are block-causal in blocks of b, MASK rows see clean rows of earlier b-blocks and MASK rows of
    their own b-block. Returns (mask [2L, n_past + 2L], positions [2L]).
    """
    if verify_block < 1:
        raise ValueError(f"verify_block must be >= 1, got {verify_block}")
    vb = torch.arange(n_draft, device=device) // verify_block
    row, col = vb[:, None], vb[None, :]
    top = torch.cat([col <= row, torch.zeros(n_draft, n_draft, dtype=torch.bool, device=device)], dim=1)
    bottom = torch.cat([col < row, col == row], dim=1)
    pos = torch.arange(n_draft, device=device) + (n_past if pos0 is None else pos0)
    return _with_past(torch.cat([top, bottom]), n_past), torch.cat([pos, pos])


def _step_maps(step_maps) -> list[list[int]]:
    """One step map (ints) or several (one per draft block) -> a list of int lists."""
    sm = step_maps.tolist() if hasattr(step_maps, "tolist") else list(step_maps)
    try:
        return [[int(x) for x in m] for m in sm] if sm and iter(sm[0]) else [[]]
    except TypeError:  # sm[0] is a number: a single step map
        return [[int(x) for x in sm]]


# SimSD row kinds.
_CTX, _DATA, _MASK, _PAD = 0, 1, 2, 3
_NEVER = 1 << 30  # the time of a drafted slot the draft never revealed (step -1): still MASK "forever"


def simsd_temporal(step_maps: Sequence[int] | Sequence[Sequence[int]], n_past: int = 0,
                   context: int | Sequence[int] = 0, pos0: int | None = None, n_pad: int = 0,
                   device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """SimSD's verification layout and temporal mask (SimSD §3.1 Eq. 1, §3.2; release `create_multi_block_causal_mask`).

    Rows: [context | D_0 | D~_0 | D_1 | D~_1 | ... | pad]. `context` = in-query prompt-like tokens (the
    uncached prompt tail / accepted tokens of the open block), one group or a list of group lengths that
    are block-causal among themselves; D_b = the n_b drafted tokens of draft block b, D~_b = n_b MASKs,
    D~_b[k] at D_b[k]'s position (RoPE copy). step_maps[b][k] = 0-based draft step that revealed D_b[k]
    (-1: never revealed), time t = step + 1. Committed slots and context are visible to every non-pad row;
    context rows see no draft rows. Same block: D_i->D_j iff t_j <= t_i, D_i->D~_j iff t_j > t_i,
    D~_i->D_j iff t_j < t_i, D~_i->D~_j iff t_j >= t_i; a later block sees earlier blocks' D only. Pad
    rows are isolated (they see only themselves, so their outputs stay finite). Returns (mask, positions).
    """
    maps = _step_maps(step_maps)
    groups = [context] if isinstance(context, int) else [int(n) for n in context]
    kind, blk, time, pos = [], [], [], []
    p = n_past if pos0 is None else pos0

    def add(k: int, b: int, t: list[int], ps: list[int]) -> None:
        kind.extend([k] * len(t))
        blk.extend([b] * len(t))
        time.extend(t)
        pos.extend(ps)

    for g, n in enumerate(groups):
        add(_CTX, g, [0] * n, list(range(p, p + n)))
        p += n
    for b, sm in enumerate(maps, start=len(groups)):
        t, ps = [s + 1 if s >= 0 else _NEVER for s in sm], list(range(p, p + len(sm)))
        add(_DATA, b, t, ps)
        add(_MASK, b, t, ps)  # D~ shares D's times (same within-block rank) and positions (RoPE copy)
        p += len(sm)
    add(_PAD, -1, [0] * n_pad, [0] * n_pad)

    k, b, t = (torch.tensor(v, dtype=torch.long, device=device) for v in (kind, blk, time))
    ki, kj, bi, bj, ti, tj = k[:, None], k[None, :], b[:, None], b[None, :], t[:, None], t[None, :]
    draft_i, same = (ki == _DATA) | (ki == _MASK), bi == bj
    new = ((ki == _CTX) & (kj == _CTX) & (bj <= bi)) \
        | (draft_i & (kj == _CTX)) \
        | (draft_i & (kj == _DATA) & (bj < bi)) \
        | (same & (ki == _DATA) & (kj == _DATA) & (tj <= ti)) \
        | (same & (ki == _DATA) & (kj == _MASK) & (tj > ti)) \
        | (same & (ki == _MASK) & (kj == _DATA) & (tj < ti)) \
        | (same & (ki == _MASK) & (kj == _MASK) & (tj >= ti))
    pad = k == _PAD
    new = (new & ~pad[:, None] & ~pad[None, :]) | torch.diag(pad)
    return _with_past(new, n_past, ~pad), torch.tensor(pos, dtype=torch.long, device=device)

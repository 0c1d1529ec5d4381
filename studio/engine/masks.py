"""Attention-mask builders. A mask is bool [T_new, n_past + T_new]; True = may attend.

Committed KV (the first n_past columns) is always visible; the masks differ only in how the
new rows see each other.
"""
from __future__ import annotations

import torch


def causal(n_new: int, n_past: int, device="cpu") -> torch.Tensor:
    """Row i sees all committed slots and new rows 0..i (plain causal attention)."""
    cols = torch.arange(n_past + n_new, device=device)
    rows = torch.arange(n_new, device=device) + n_past
    return cols[None, :] <= rows[:, None]

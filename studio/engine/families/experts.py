"""Per-expert checkpoint tensors (`…mlp.experts.{e}.gate_proj.weight`, as MoE checkpoints publish them) stacked into the
compact model's one [E, …] tensor per layer and projection (`…mlp.experts.gate_proj`, studio.engine.moe)."""
from __future__ import annotations

import re

import torch

from studio.engine.lazy_tensors import stack
from studio.errors import BadInput

EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert tensors of `sd` stacked (unread ones stay unread: studio.engine.lazy_tensors)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in sd.items():
        m = EXPERT_KEY.match(key)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = tensor
        else:
            out[key] = tensor
    for (prefix, proj), by_index in experts.items():
        missing = sorted(set(range(max(by_index) + 1)) - set(by_index))
        if missing:
            raise BadInput(f"{prefix}: {proj} of experts {missing[:5]} missing from the checkpoint")
        out[f"{prefix}.{proj}"] = stack([by_index[e] for e in range(len(by_index))])   # unread: a rank reads its own
    return out

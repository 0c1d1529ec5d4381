"""Batched greedy decoding: B prompts in one stationary batch over one KV cache with a batch dimension.

Prompts are left-padded to one length so every sequence writes its next token at the same slot; each
sequence's positions start at 0 at its first real token, and its pad slots are masked out of every
attention row (a pad row sees only itself, so its values stay finite and never reach a real row). So
each sequence computes what it would alone: its greedy tokens equal its batch-1 greedy tokens up to
float reduction order (a test checks equality on tiny models). Finished sequences leave the batch once
a quarter of it is done, so long answers do not drag dead rows along. Used by `train data`.
"""
from __future__ import annotations

import torch

from studio.engine.masks import causal


@torch.no_grad()
def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int]) -> list[list[int]]:
    """Greedy continuations of `prompts` (each up to and including its first EOS, or max_new_tokens)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("greedy_batch needs non-empty prompts")
    device = model.lm_head.weight.device
    B, P = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device=device)
    positions = (torch.arange(P, device=device)[None] - pad[:, None]).clamp(min=0)
    kv = model.new_cache(P + max_new_tokens, batch=B)
    real = torch.arange(P + max_new_tokens, device=device)[None] >= pad[:, None]     # [B, S] slot holds a token
    eye = torch.eye(P, dtype=torch.bool, device=device)
    mask = (causal(P, 0, device=device)[None] & real[:, None, :P]) | eye              # [B, P, P]
    logits = model(tokens, positions, kv, mask=mask[:, None], logits_rows=[P - 1])
    kv.commit(P)
    out: list[list[int]] = [[] for _ in range(B)]
    alive = torch.arange(B, device=device)          # original index of each batch row
    running = torch.ones(B, dtype=torch.bool, device=device)
    pos = positions[:, -1]
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
    nxt = logits[:, -1].argmax(-1)
    for step in range(max_new_tokens):
        for b, tok, r in zip(alive.tolist(), nxt.tolist(), running.tolist()):
            if r:
                out[b].append(tok)
        running &= ~torch.isin(nxt, eos)
        if not bool(running.any()) or step == max_new_tokens - 1:
            break
        if int((~running).sum()) * 4 >= len(alive):     # compact: drop the finished rows
            keep = running.nonzero()[:, 0]
            kv.select_batch(keep)
            alive, nxt, pos, real, running = alive[keep], nxt[keep], pos[keep], real[keep], running[keep]
        pos = pos + 1
        logits = model(nxt[:, None], pos[:, None], kv, mask=real[:, None, None, :kv.length + 1])
        kv.commit(1)
        nxt = logits[:, -1].argmax(-1)
    return out

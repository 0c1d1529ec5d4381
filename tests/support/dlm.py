"""Helpers for block-diffusion tests: runs, a context opened by a strategy, naive references."""
from __future__ import annotations

import torch

from studio.engine.sampling import SamplingParams, process_logits
from studio.engine.strategies import DecodeContext, Output, make_strategy
from studio.run.session import Settings, run_to_end


def generate(engine, name, params=None, prompt=(1, 2, 3, 4, 5), n=20, temperature=0.0, seed=0, trace=None):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=seed)
    return run_to_end(engine, make_strategy(name, params), s, "", list(prompt), trace_path=trace)


def opened(engine, strategy, prompt, temperature=0.0, seed=0) -> DecodeContext:
    """A decode context after `strategy.start` (prefill done, first block open)."""
    out = Output(engine.tokenizer, 1000, frozenset(), ())
    ctx = DecodeContext(engine.model, engine.tokenizer, SamplingParams(temperature), seed, out,
                        engine.config.mask_token_id, 256)
    strategy.start(ctx, list(prompt))
    ctx.drain()
    return ctx


def full_forward_row(model, ids: list[int], row: int = -1, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of one row of a forward over `ids` (fresh cache): plain causal, or under `mask` [T, T]."""
    kv, dev = model.new_cache(len(ids)), model.lm_head.weight.device
    with torch.inference_mode():
        return model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), kv,
                     mask=None if mask is None else mask.to(dev), logits_rows=[row % len(ids)])[0, 0]


def verifier_grid(block: int, origin: int = 0):
    """The attention a block-size-1 verifier reads when committed blocks were computed block-causally: `grid(n)` gives
    block ids to the n positions before the predicted one (i attends j iff id j <= id i). Positions before `origin`
    are one bidirectional block (D2F's prompt; 0 for a grid from position 0, LLaDA2), then blocks of `block` up to
    the predicted position's own block, inside which every position is its own block (the verifier's causal rows).
    block = 1: token-causal after `origin`."""
    def grid(n: int) -> list[int]:
        open_at = origin + max(0, n - origin) // block * block
        return [0 if p < origin else 1 + (p - origin) // block if p < open_at else n + p for p in range(n)]
    return grid


def block_size_one_row(engine, prefix: list[int], grid=None) -> torch.Tensor:
    """The model in block-size-1 mode predicting the token after `prefix`: a causal forward (or one under the block ids
    `grid(len(prefix))`, `verifier_grid`), then the MASK row (position-aligned) or the last row (right-shifted). The
    MASK logit is removed."""
    cfg = engine.config
    ids = prefix if cfg.logit_shift else prefix + [cfg.mask_token_id]
    mask = None
    if grid is not None:
        ids_block = torch.tensor(grid(len(prefix)) + ([] if cfg.logit_shift else [1 << 30]))
        mask = ids_block[None, :] <= ids_block[:, None]
    row = full_forward_row(engine.model, ids, mask=mask).clone()
    row[cfg.mask_token_id] = float("-inf")
    return row


def block_size_one_greedy(engine, prompt: list[int], n: int, grid=None) -> list[int]:
    """Greedy decoding of the model in block-size-1 mode, by full forwards (the S2D2 verifier's law)."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(block_size_one_row(engine, list(prompt) + out, grid).argmax()))
    return out


def block_size_one_probs(engine, prefix: list[int], sampling: SamplingParams, grid=None) -> torch.Tensor:
    return process_logits(block_size_one_row(engine, prefix, grid).double(), sampling).double()


def block_size_one_law(engine, prompt: list[int], length: int, sampling: SamplingParams,
                       grid=None) -> dict[tuple, float]:
    """P(x_1..x_length | prompt) of the block-size-1 model sampled token by token (MASK never emitted)."""
    import itertools
    cond: dict[tuple, torch.Tensor] = {}
    law = {}
    for seq in itertools.product(range(engine.config.vocab_size), repeat=length):
        prob = 1.0
        for i in range(length):
            if seq[:i] not in cond:
                cond[seq[:i]] = block_size_one_probs(engine, list(prompt) + list(seq[:i]), sampling, grid)
            prob *= float(cond[seq[:i]][seq[i]])
        law[seq] = prob
    return law

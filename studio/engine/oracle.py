"""The bench's acceptance oracle (`bench --oracle-accept P`): every verified draft is accepted by an
independent Bernoulli(P) draw instead of the exact rule (docs/verification.md), so the engine's efficiency can be measured
at a controlled acceptance. The output is then not the model's and means nothing; the forwards, KV moves
and events are exactly those a real verdict with the same accepted length would cause."""
from __future__ import annotations

import torch

from studio.engine.sampling import ChainResult, SamplingParams, sample


def oracle_chain(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, sampling: SamplingParams,
                 gen: torch.Generator, accept: float) -> ChainResult:
    """Accept d_0, d_1, ... while Bernoulli(`accept`) draws succeed; the first failure rejects its draft and
    the correction is the target's token at that row (argmax when greedy, else a draw from p). p(d) and
    q(d) (1.0 without q) are reported for every verified draft, as `verify_chain` does."""
    k = len(drafts)
    decisions = (torch.rand(k, generator=gen, device=gen.device) < accept).tolist()
    n_accepted = decisions.index(False) if False in decisions else k
    n_verified = min(n_accepted + 1, k)
    idx = torch.tensor(drafts[:n_verified], dtype=torch.long, device=p.device)[:, None]
    p_draft = p[:n_verified].gather(1, idx)[:, 0].tolist()
    q_draft = [1.0] * n_verified if q is None else q[:n_verified].gather(1, idx)[:, 0].tolist()
    result = ChainResult(n_accepted, None, p_draft, q_draft)
    if n_accepted < k:
        row = p[n_accepted]
        result.correction = int(row.argmax()) if sampling.greedy else sample(row, gen)
        result.resampled_from = "oracle"
    return result

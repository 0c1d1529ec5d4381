"""Helpers for exactness tests: the exact AR law over short continuations, and a chi-square against it."""
from __future__ import annotations

import itertools
from collections import Counter

import torch
from scipy.stats import chisquare

from studio.engine.sampling import SamplingParams, process_logits


def exact_sequence_law(model, prompt: list[int], length: int, sampling: SamplingParams) -> dict[tuple, float]:
    """P(x_1..x_length | prompt) under plain AR sampling with `sampling`, by enumeration (full forwards)."""
    V = model.config.vocab_size
    law = {}
    for seq in itertools.product(range(V), repeat=length):
        law[seq] = 1.0
    cond: dict[tuple, torch.Tensor] = {}

    def next_probs(prefix: tuple) -> torch.Tensor:
        if prefix not in cond:
            ids = torch.tensor(prompt + list(prefix))
            kv = model.new_cache(len(ids))
            with torch.inference_mode():
                logits = model(ids, torch.arange(len(ids)), kv, logits_rows=[len(ids) - 1])[0, 0]
            cond[prefix] = process_logits(logits.double(), sampling).double()
        return cond[prefix]

    for seq in law:
        prob = 1.0
        for i in range(length):
            prob *= next_probs(seq[:i])[seq[i]].item()
            if prob == 0.0:
                break
        law[seq] = prob
    return law


def chi_square_pvalue(samples: list[tuple], law: dict[tuple, float], min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; bins with small expected counts are pooled into one."""
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= {s for s, p in law.items() if p > 0}, "sampled a sequence of probability 0"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for seq, p in law.items():
        if p * n >= min_expected:
            obs.append(counts.get(seq, 0))
            exp.append(p * n)
        else:
            pool_o += counts.get(seq, 0)
            pool_e += p * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    total = sum(exp)
    exp = [e * n / total for e in exp]
    return chisquare(obs, exp).pvalue

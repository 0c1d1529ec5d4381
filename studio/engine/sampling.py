"""Logits processing, sampling and lossless draft verification (docs/verification.md).

Everything here is CPU, float32, batch 1, written for clarity. The same `process_logits` produces both the
target distribution p and the draft distribution q, so verification compares like with like.

Verification rules (`verify_chain`), applied to drafts d_0..d_{k-1} left to right, stopping at the first rejection:

* greedy (temperature 0): accept d_i iff d_i == argmax p[i]; the correction is argmax p[i]. No randomness.
* sampled draft (d ~ q): u ~ U[0,1); accept iff u * q(d) < (1+tau) * p(d), i.e. u < min(1, (1+tau) p(d)/q(d));
  on rejection the correction is drawn from normalize(max(0, p - q)) ("residual"), or from p when that residual
  has (numerically) no mass ("p").
* deterministic draft (q one-hot at d): accept iff u < (1+tau) * p(d); on rejection the correction is drawn from
  p with d removed, renormalised ("p_minus_draft"), or from p when nothing is left ("p").
* reference=True with a deterministic draft: the I-DLM reference code's biased scoring, which treats the argmax
  draft as if it had been sampled from q = softmax(draft logits): the sampled-draft rule with the caller's q.

With tau = 0 the sampled and deterministic rules are exact (the committed token is distributed as p); tau > 0
is the lossy relaxed acceptance of the I-DLM paper. Randomness comes only from the caller's generator: one
`torch.rand(1, generator=gen)` per verified draft, in order, then one multinomial draw for a correction.
`verify_chain_with_noise` applies the same rules to randomness the caller supplies (one uniform per draft and
one row of Gumbel noise per draft, the correction being a Gumbel-max draw): the oracle of the fused Triton
kernel (`studio.engine.kernels`), which takes the same uniforms and noise.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from studio.errors import BadInput

# A residual (max(0, p - q), or p without the draft) whose total mass is at or below this is treated as empty
# and the correction is drawn from p instead. Exactly-equal p and q give a mass of exactly 0.0; this only has to
# catch that case (and denormal dust), not float32 noise between two near-identical distributions.
RESIDUAL_EPS = 1e-12


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1.0 = off

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not _finite(t) or t < 0:
            raise BadInput(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise BadInput(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):   # NaN fails the range
            raise BadInput(f"top_p must be in (0, 1] (1 = off), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


# --------------------------------------------------------------------------------------------------------------
# Logits -> probabilities
# --------------------------------------------------------------------------------------------------------------

def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:   # an int beyond the float range
        return False


def _stable_desc_order(x: Tensor) -> Tensor:
    """Indices sorting the last dim in descending order; equal values keep ascending index order."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices


# How many of a row's most likely tokens the nucleus is first looked for among (without top-k): a full sort of a
# 49k vocabulary costs ~10x a top-k of this many, and a nucleus is almost always inside it
NUCLEUS_CANDIDATES = 256


def _top_k_keep(x: Tensor, k: int) -> Tensor:
    """The first k of each row in `_stable_desc_order` (equal values lowest index first), without sorting the row:
    every value above the k-th largest, and as many of those equal to it as are left, by index."""
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    above, ties = x > kth, x == kth
    left = k - above.sum(dim=-1, keepdim=True)
    return above | (ties & (torch.cumsum(ties, dim=-1) <= left))


def _nucleus_order(probs: Tensor, candidates: int) -> Tensor:
    """Each row's `candidates` most likely tokens in `_stable_desc_order` when in every row they are strictly more
    likely than all the others; else the whole rows' order (a tie across the cut is ordered by index, as a sort
    orders it)."""
    m = min(candidates, probs.shape[-1])
    if m < probs.shape[-1]:
        cut = torch.topk(probs, m, dim=-1).values[..., -1:]
        inside = probs >= cut
        if bool((inside.sum(dim=-1) == m).all()):
            idx = inside.nonzero()[:, -1].view(*probs.shape[:-1], m)   # ascending index in each row
            return torch.gather(idx, -1, _stable_desc_order(torch.gather(probs, -1, idx)))
    return _stable_desc_order(probs)


def _top_p_keep(probs: Tensor, top_p: float, candidates: int) -> Tensor:
    """The nucleus of each row: the shortest prefix of its tokens in `_stable_desc_order` whose mass is >= top_p
    (the top token always). Found among the `candidates` most likely tokens when they hold at least top_p in every
    row (no later token can then join: the mass before it is already >= top_p), else over the whole row."""
    order = _nucleus_order(probs, candidates)
    sorted_probs = torch.gather(probs, -1, order)
    # Mass strictly before each sorted token (in float64 so the cut is not moved by float32 rounding):
    # a token is in the nucleus iff the tokens ranked above it hold less than top_p.
    total = torch.cumsum(sorted_probs.double(), dim=-1)
    if order.shape[-1] < probs.shape[-1] and not bool((total[..., -1] >= top_p).all()):
        order = _stable_desc_order(probs)
        sorted_probs = torch.gather(probs, -1, order)
        total = torch.cumsum(sorted_probs.double(), dim=-1)
    keep_sorted = (total - sorted_probs.double()) < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)


def _one_hot_argmax(x: Tensor) -> Tensor:
    # torch.argmax returns the first maximal index, so ties go to the lowest index.
    idx = torch.argmax(x, dim=-1, keepdim=True)
    return torch.zeros_like(x, dtype=torch.float32).scatter_(-1, idx, 1.0)


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p.

    top-p is the nucleus of the top-k-filtered, renormalised distribution: the shortest prefix of the tokens
    sorted by probability (ties: lower index first) whose mass is >= top_p; the top token is always kept.
    Greedy params give a one-hot at argmax (ties: lowest index). Computed in float32.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise BadInput(f"logits must have a non-empty last (vocab) dimension, got shape {tuple(logits.shape)}")
    x = logits.detach().to(torch.float32)
    if torch.isnan(x).any():
        raise BadInput("model produced NaN logits")
    if torch.isposinf(x).any():
        raise BadInput("model produced +inf logits")
    if torch.isneginf(x).all(dim=-1).any():
        raise BadInput("model produced logits that are all -inf at some position")
    if params.greedy:
        return _one_hot_argmax(x)

    vocab = x.shape[-1]
    x = x / params.temperature

    top_k = 0 < params.top_k < vocab
    if top_k:
        x = x.masked_fill(~_top_k_keep(x, params.top_k), float("-inf"))

    probs = torch.softmax(x, dim=-1)

    if params.top_p < 1.0:
        keep = _top_p_keep(probs, params.top_p, min(params.top_k, NUCLEUS_CANDIDATES) if top_k else NUCLEUS_CANDIDATES)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)

    return probs


# --------------------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------------------

def sample(probs: Tensor, gen: torch.Generator) -> int | Tensor:
    """One multinomial draw per row: [V] -> int, [R, V] -> LongTensor[R]. Rows need not be normalised."""
    if probs.dim() == 1:
        return int(torch.multinomial(probs.to(torch.float32), 1, generator=gen).item())
    if probs.dim() == 2:
        return torch.multinomial(probs.to(torch.float32), 1, generator=gen).squeeze(-1)
    raise ValueError(f"sample() takes probs of shape [V] or [R, V], got {tuple(probs.shape)}")


def sample_token(logits_row: Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, Tensor]:
    """Process one row of logits [V] and pick a token: argmax when greedy (no randomness), else a draw."""
    if logits_row.dim() != 1:
        raise ValueError(f"sample_token() takes one row of logits [V], got shape {tuple(logits_row.shape)}")
    probs = process_logits(logits_row, params)
    if params.greedy:
        return int(torch.argmax(probs).item()), probs
    return sample(probs, gen), probs


# --------------------------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------------------------

class Proposal(enum.Enum):
    SAMPLED = "sample"          # d ~ q
    DETERMINISTIC = "argmax"    # q is one-hot at d


@dataclass
class ChainResult:
    n_accepted: int                                   # number of leading drafts accepted
    correction: int | None                            # token drawn on rejection (None if all accepted)
    p_draft: list[float] = field(default_factory=list)  # p(d_i) for each verified draft (accepted + rejected)
    q_draft: list[float] = field(default_factory=list)  # q(d_i) likewise (1.0 for deterministic drafts)
    resampled_from: str | None = None                 # "residual" | "p" | "p_minus_draft" | "argmax"


def residual_distribution(p: Tensor, q: Tensor) -> Tensor | None:
    """normalize(max(0, p - q)) for one row, or None when its mass is <= RESIDUAL_EPS (p == q numerically)."""
    r = torch.clamp(p.to(torch.float32) - q.to(torch.float32), min=0.0)
    mass = float(r.sum().item())
    if mass <= RESIDUAL_EPS:
        return None
    return r / mass


def p_minus_draft_distribution(p: Tensor, d: int) -> Tensor | None:
    """p with token d removed, renormalised, or None when nothing is left (p(d) == 1 numerically)."""
    r = p.to(torch.float32).clone()
    r[d] = 0.0
    mass = float(r.sum().item())
    if mass <= RESIDUAL_EPS:
        return None
    return r / mass


def _uniform(gen: torch.Generator) -> float:
    return float(torch.rand(1, generator=gen, device=gen.device).item())


def gumbel_noise(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """Standard Gumbel noise -log(-log(u)), float32, on the generator's device. Always finite: u = 0 is raised to
    the smallest normal float, so a zero-probability token can never win a `gumbel_max` draw by a -inf tie."""
    u = torch.rand(shape, generator=gen, device=gen.device).clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


def gumbel_max(dist: Tensor, noise: Tensor) -> int:
    """One draw from the (not necessarily normalised) row `dist`: argmax of log(dist) + noise, lowest index on
    ties. With standard Gumbel noise this is distributed as dist / dist.sum()."""
    return int(torch.argmax(torch.log(dist.to(torch.float32)) + noise).item())


def scores_with_q(proposal: Proposal, params: SamplingParams, reference: bool) -> bool:
    """Whether verification reads the draft distribution q: sampled drafts, and the reference scoring."""
    return not params.greedy and (proposal is Proposal.SAMPLED or reference)


def check_chain_args(drafts, p: Tensor, q: Tensor | None, uses_q: bool, tau: float, gamma: float) -> list[int]:
    """Validate a chain's arguments (p and q: [>= k, V] probabilities or logits); returns the drafts as ints."""
    drafts = [int(d) for d in drafts]
    k = len(drafts)
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or math.isnan(tau) or tau < 0:
        raise BadInput(f"tau must be a number >= 0, got {tau!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0 or math.isinf(gamma):
        raise BadInput(f"gamma must be a finite number > 0, got {gamma!r}")
    if p.dim() != 2 or p.shape[0] < k:
        raise ValueError(f"p must be [>= {k}, V], got shape {tuple(p.shape)}")
    vocab = p.shape[1]
    if any(d < 0 or d >= vocab for d in drafts):
        raise ValueError(f"draft token out of range [0, {vocab}): {drafts}")
    if uses_q:
        if q is None:
            raise ValueError("q is required for sampled drafts and for reference scoring")
        if q.dim() != 2 or q.shape[0] < k or q.shape[1] != vocab:
            raise ValueError(f"q must be [>= {k}, {vocab}], got shape {tuple(q.shape)}")
    return drafts


def check_noise(params: SamplingParams, uniforms: Tensor | None, gumbel: Tensor | None, k: int, vocab: int) -> None:
    """Sampled verification of k drafts needs uniforms [>= k] and gumbel [>= k, vocab]; greedy needs neither."""
    if params.greedy:
        return
    if uniforms is None or gumbel is None:
        raise ValueError("sampled verification needs uniforms and gumbel noise")
    if uniforms.numel() < k or gumbel.dim() != 2 or gumbel.shape[0] < k or gumbel.shape[1] != vocab:
        raise ValueError(f"uniforms must be [>= {k}] and gumbel [>= {k}, {vocab}], "
                         f"got {tuple(uniforms.shape)} and {tuple(gumbel.shape)}")


def _accepts(u: float, p_d: float, q_d: float, tau: float, gamma: float) -> bool:
    if gamma == 1.0:
        # u < min(1, (1+tau) p/q) written without a division; u < 1 makes the min implicit. Python floats are
        # float64, so u * q_d (two float32 values) is exact. For deterministic drafts q_d = 1.
        return u * q_d < (1.0 + tau) * p_d
    return q_d > 0 and u < min(1.0, ((1.0 + tau) * p_d / q_d) ** gamma)


def _verify(drafts, p: Tensor, q: Tensor | None, proposal: Proposal, params: SamplingParams,
            uniform: Callable[[int], float], draw: Callable[[Tensor, int], int],
            tau: float, reference: bool, gamma: float) -> ChainResult:
    """The rules of `verify_chain`, with the randomness injected: uniform(i) is the uniform of draft i, and
    draw(dist, i) draws the correction at draft i from the row `dist`. Both are called only when needed."""
    uses_q = scores_with_q(proposal, params, reference)
    drafts = check_chain_args(drafts, p, q, uses_q, tau, gamma)
    result = ChainResult(n_accepted=0, correction=None)

    for i, d in enumerate(drafts):
        p_d = float(p[i, d].item())
        if proposal is Proposal.SAMPLED and q is not None:
            q_d = float(q[i, d].item())
        elif reference and q is not None:
            q_d = float(q[i, d].item())
        else:
            q_d = 1.0
        result.p_draft.append(p_d)
        result.q_draft.append(q_d)

        if params.greedy:
            target = int(torch.argmax(p[i]).item())     # first maximum: ties go to the lowest index
            if d == target:
                result.n_accepted += 1
                continue
            result.correction, result.resampled_from = target, "argmax"
            return result

        if _accepts(uniform(i), p_d, q_d, tau, gamma):
            result.n_accepted += 1
            continue

        if uses_q:
            dist, source = residual_distribution(p[i], q[i]), "residual"
        else:
            dist, source = p_minus_draft_distribution(p[i], d), "p_minus_draft"
        if dist is None:
            dist, source = p[i], "p"
        result.correction, result.resampled_from = draw(dist, i), source
        return result

    return result


def verify_chain(drafts: list[int], p: Tensor, q: Tensor | None, proposal: Proposal, params: SamplingParams,
                 gen: torch.Generator, tau: float = 0.0, reference: bool = False, gamma: float = 1.0) -> ChainResult:
    """Verify drafts d_0..d_{k-1} left to right; stop at the first rejection.

    p[i] is the processed target distribution at draft i and q[i] the processed distribution draft i was drawn
    from (ignored for deterministic drafts unless reference=True). p and q may have more rows than there are
    drafts (e.g. a bonus position); the extra rows are ignored. See the module docstring for the rules.
    gamma != 1 is S2D2's lossy tempering: accept iff u < min(1, ((1+tau) p(d)/q(d))^gamma).
    """
    return _verify(drafts, p, q, proposal, params, uniform=lambda i: _uniform(gen),
                   draw=lambda dist, i: sample(dist, gen), tau=tau, reference=reference, gamma=gamma)


def verify_chain_with_noise(drafts: list[int], p: Tensor, q: Tensor | None, proposal: Proposal,
                            params: SamplingParams, uniforms: Tensor | None, gumbel: Tensor | None, tau: float = 0.0,
                            reference: bool = False, gamma: float = 1.0) -> ChainResult:
    """`verify_chain` with explicit randomness: uniforms[i] is draft i's uniform and a correction at draft i is
    `gumbel_max(dist, gumbel[i])`. uniforms [>= k] and gumbel [>= k, V] (finite: see `gumbel_noise`) may be None
    when greedy, which uses no randomness."""
    check_noise(params, uniforms, gumbel, len(drafts), p.shape[-1])
    return _verify(drafts, p, q, proposal, params, uniform=lambda i: float(uniforms[i].item()),
                   draw=lambda dist, i: gumbel_max(dist, gumbel[i]), tau=tau, reference=reference, gamma=gamma)

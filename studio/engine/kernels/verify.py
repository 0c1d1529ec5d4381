"""The fused verify kernel: the exact verification of one draft chain (docs/verification.md), one Triton program per draft row.

Program i reads row i of the target logits (and, when the rule needs q, of the draft logits) in blocks of the
vocabulary and, without sorting or materialising a distribution:
  1. builds the distribution `sampling.process_logits` gives (temperature, then top-k, then top-p) as a max, a
     normaliser and a cut (below);
  2. applies the acceptance test of `sampling.verify_chain` to draft i with uniform i;
  3. on rejection draws the correction by Gumbel-max, with noise row i, from the residual max(0, p − q) — q is
     one-hot at the draft for deterministic drafts, which makes the residual "p without the draft" — or from p
     when the residual has no mass;
  4. lowers the chain's accepted count to i with an atomic min: after the launch the count is the first
     rejection, and tokens[:count + 1] are the accepted drafts followed by the correction.
The oracle is `sampling.verify_chain_with_noise` given the same logits, uniforms and noise.

The cut. process_logits keeps a prefix of the tokens taken in the order (x descending, index ascending), x being
the scaled logit: top-k the first k, top-p the shortest prefix whose mass reaches top_p. Any such prefix is a
pair (cut_key, cut_idx): a token is kept iff key(x) > cut_key, or key(x) == cut_key and its index <= cut_idx,
where key is an int32 ordered like x. top-k finds its cut_key by a search (`_search`) on the count of keys >= t,
top-p by one on the kept mass above t; cut_idx then takes the leading tokens of the tie group at cut_key.

Where kernel and oracle can decide differently (the tests' inputs avoid these cases):
* Ties in x are resolved like torch (lower index first) for greedy and top-k. top-p ranks by x, torch by the
  float32 probability: two different x whose probabilities round to the same float32 (or underflow to 0) are
  ordered by value here and by index in torch, which matters only if they straddle the nucleus cut. When a
  group of equal x straddles the cut, the number of its tokens kept is a float32 quotient here and a float64
  running sum in torch: they differ only if the cut falls within rounding of a tie member.
* Rounding: p(d), q(d) and all masses are float32 sums in another order than torch's, and the acceptance test
  is float32 (float64 in torch). An acceptance, a nucleus boundary, the residual mass against RESIDUAL_EPS, or a
  Gumbel-max winner can flip only when the two sides of its comparison agree to about 1e-6 relative.

Cost in passes over one row's vocabulary: temperature only, 1 for p (+1 for q) and 1 more if the row rejects.
top-k adds about 9 per distribution (7-8 search passes, each comparing every element with 16 points; a tie pass;
a normaliser pass), top-p about 9 more. Unmeasured on a GPU so far.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from studio.engine.sampling import (
    RESIDUAL_EPS,
    ChainResult,
    Proposal,
    SamplingParams,
    check_chain_args,
    check_noise,
    process_logits,
    scores_with_q,
)
from studio.errors import BadInput

# A row's `source` output: accepted, or where its correction came from. The names are ChainResult.resampled_from's.
ACCEPTED = tl.constexpr(0)
RESIDUAL = tl.constexpr(1)
FROM_P = tl.constexpr(2)
P_MINUS_DRAFT = tl.constexpr(3)
ARGMAX = tl.constexpr(4)
SOURCE_NAMES = (None, "residual", "p", "p_minus_draft", "argmax")

INT32_MAX = tl.constexpr(2**31 - 1)
MAX_BLOCK = 4096          # vocabulary elements a program reads at a time
SEARCH_PROBES = 16        # points measured per search pass (see `_search`)
SEARCH_TILE = 4096        # elements of a search pass's [SEARCH_BLOCK, PROBES] tile


# ----------------------------------------------------------------------------------------------------------------
# Reading a row
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _load(row_ptr, offs, V, temperature):
    """Logits at `offs` as x = float32 / temperature (correctly rounded, as torch divides), their int32 keys
    ordered like x, and which offsets lie in the row (x = -inf past its end)."""
    live = offs < V
    x = tl.load(row_ptr + offs, mask=live, other=float("-inf")).to(tl.float32)
    x = tl.math.div_rn(x, temperature)
    # The key flips the magnitude bits of negative floats, so int32 order is float order; -0.0 is given +0.0's
    # key, as they compare equal.
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return x, bits ^ ((bits >> 31) & 0x7FFFFFFF), live


@triton.jit
def _key_value(key):
    """The float32 x whose key (see `_load`) is `key`: the bit flip is its own inverse."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _kept(key, idx, cut_key, cut_idx):
    return (key > cut_key) | ((key == cut_key) & (idx <= cut_idx))


@triton.jit
def _row_stats(row_ptr, V, temperature, BLOCK: tl.constexpr):
    """One pass: the max m and its first index, the online-softmax sum s = Σ exp(x − m), the smallest and largest
    keys, and whether process_logits would reject the row (NaN or +inf anywhere, or all −inf)."""
    m = float("-inf")
    s = 0.0
    best = 0
    min_key = INT32_MAX
    max_key = -INT32_MAX
    bad = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, key, live = _load(row_ptr, offs, V, temperature)
        block_max = tl.max(x, axis=0)
        best = tl.where(block_max > m, tl.min(tl.where(x == block_max, offs, INT32_MAX), axis=0), best)
        new_m = tl.maximum(m, block_max)
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)   # while all is −inf, exp(−inf − −inf) is NaN
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = new_m
        min_key = tl.minimum(min_key, tl.min(tl.where(live, key, INT32_MAX), axis=0))
        max_key = tl.maximum(max_key, tl.max(tl.where(live, key, -INT32_MAX), axis=0))
        bad |= tl.max(((x != x) | (x == float("inf"))).to(tl.int32), axis=0)
    return m, s, best, min_key, max_key, bad | (m == float("-inf")).to(tl.int32)


# ----------------------------------------------------------------------------------------------------------------
# The processed distribution: (row_ptr, m, s, cut_key, cut_idx), p(token) = exp(x − m) / s where kept, else 0
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _counts_at_least(row_ptr, V, temperature, points, SEARCH_BLOCK: tl.constexpr):
    """For each point t: how many keys are >= t."""
    n = tl.zeros(points.shape, tl.int32)
    for start in range(0, V, SEARCH_BLOCK):
        offs = start + tl.arange(0, SEARCH_BLOCK)
        _, key, live = _load(row_ptr, offs, V, temperature)
        n += tl.sum((live[:, None] & (key[:, None] >= points[None, :])).to(tl.int32), axis=0)
    return n


@triton.jit
def _kept_masses_above(row_ptr, V, temperature, m, cut_key, cut_idx, points, SEARCH_BLOCK: tl.constexpr):
    """For each point t: Σ exp(x − m) over the kept tokens whose key is above t."""
    mass = tl.zeros(points.shape, tl.float32)
    for start in range(0, V, SEARCH_BLOCK):
        offs = start + tl.arange(0, SEARCH_BLOCK)
        x, key, live = _load(row_ptr, offs, V, temperature)
        e = tl.where(live & _kept(key, offs, cut_key, cut_idx), tl.exp(x - m), 0.0)
        mass += tl.sum(tl.where(key[:, None] > points[None, :], e[:, None], 0.0), axis=0)
    return mass


@triton.jit
def _kept_mass(row_ptr, V, temperature, m, cut_key, cut_idx, SEARCH_BLOCK: tl.constexpr):
    """Σ exp(x − m) over the kept tokens: the normaliser s."""
    below_all = tl.full((1,), cut_key.to(tl.int64) - 1, tl.int64)
    return tl.sum(_kept_masses_above(row_ptr, V, temperature, m, cut_key, cut_idx, below_all, SEARCH_BLOCK), axis=0)


@triton.jit
def _nth_tie_index(row_ptr, V, temperature, key, n, last_idx, BLOCK: tl.constexpr):
    """The index of the n-th token (n >= 1, in index order) whose key is `key` and index <= last_idx; the last
    such token when there are fewer than n."""
    seen = 0
    found = -1
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        _, row_key, live = _load(row_ptr, offs, V, temperature)
        tie = live & (row_key == key) & (offs <= last_idx)
        rank = seen + tl.cumsum(tie.to(tl.int32), axis=0)
        found = tl.maximum(found, tl.max(tl.where(tie & (rank <= n), offs, -1), axis=0))
        seen += tl.sum(tie.to(tl.int32), axis=0)
    return found


@triton.jit
def _search(row_ptr, V, temperature, lo, hi, target, m, cut_key, cut_idx, BY_MASS: tl.constexpr,
            SEARCH_BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """The smallest key t in (lo, hi] with measure(t) < target, and measure(t): the count of keys >= t, or with
    BY_MASS the kept mass above t. The measure is non-increasing in t; the caller makes it fail at lo and hold at
    hi. Each round measures PROBES points of (lo, hi) in one pass, as [SEARCH_BLOCK, PROBES] tiles, and keeps the
    span between the last failing and the first holding point: about 32 / log2(PROBES + 1) passes for the 32 bits
    of a key (PROBES = 1 is bisection)."""
    if BY_MASS:
        hi_value = 0.0
    else:
        hi_value = 0
    while hi - lo > 1:
        step = tl.maximum((hi - lo) // (PROBES + 1), 1)
        points = lo + step * (1 + tl.arange(0, PROBES).to(tl.int64))   # any past hi hold, and change nothing
        if BY_MASS:
            values = _kept_masses_above(row_ptr, V, temperature, m, cut_key, cut_idx, points, SEARCH_BLOCK)
        else:
            values = _counts_at_least(row_ptr, V, temperature, points, SEARCH_BLOCK)
        holds = values < target
        lo = tl.max(tl.where(holds, lo, points), axis=0)
        new_hi = tl.min(tl.where(holds, points, hi), axis=0)
        hi_value = tl.where(new_hi == hi, hi_value, tl.sum(tl.where(points == new_hi, values, 0), axis=0))
        hi = new_hi
    return hi, hi_value


@triton.jit
def _top_k_cut(row_ptr, V, temperature, top_k, min_key, max_key,
               BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """The cut keeping the top_k largest x, ties by lower index. The search finds hi, the smallest t with
    count(key >= t) < top_k: hi - 1 is the top_k-th largest key, with n_above = count(key >= hi) keys above it.
    At min_key the count is V > top_k; at max_key + 1 it is 0."""
    hi, n_above = _search(row_ptr, V, temperature, min_key.to(tl.int64), max_key.to(tl.int64) + 1, top_k,
                          0.0, 0, 0, False, SEARCH_BLOCK, PROBES)      # (m and the cut: read by masses only)
    cut_key = (hi - 1).to(tl.int32)
    return cut_key, _nth_tie_index(row_ptr, V, temperature, cut_key, top_k - n_above, V, BLOCK)


@triton.jit
def _top_p_cut(row_ptr, V, temperature, top_p, m, s, cut_key, cut_idx, max_key,
               BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """Narrow the kept set to its nucleus: a token stays iff the kept mass ranked above it is < top_p (masses
    unnormalised here, against budget = top_p · s). The search finds hi, the smallest t with
    mass_above(t) < budget: the key of the last tie group entering the nucleus, with mass_hi ranked above it.
    At cut_key - 1 the mass above is s >= budget (up to rounding); at max_key it is 0."""
    budget = top_p * s
    hi, mass_hi = _search(row_ptr, V, temperature, cut_key.to(tl.int64) - 1, max_key.to(tl.int64), budget,
                          m, cut_key, cut_idx, True, SEARCH_BLOCK, PROBES)
    # The group's r-th token (from 0, index order) adds e = exp(x − m) and stays iff mass_hi + r·e < budget,
    # so ceil((budget − mass_hi) / e) of them stay: all of them when e underflows to 0.
    nucleus_key = hi.to(tl.int32)
    e = tl.exp(_key_value(nucleus_key) - m)
    n_stay = tl.ceil(tl.minimum((budget - mass_hi) / e, V)).to(tl.int32)
    last_idx = tl.where(nucleus_key == cut_key, cut_idx, V)
    return nucleus_key, _nth_tie_index(row_ptr, V, temperature, nucleus_key, n_stay, last_idx, BLOCK)


@triton.jit
def _distribution(row_ptr, V, temperature, top_k, top_p, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
                  BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """process_logits of one row as (row_ptr, m, s, cut_key, cut_idx), and whether the row is unusable."""
    m, s, _, cut_key, max_key, bad = _row_stats(row_ptr, V, temperature, BLOCK)
    cut_idx = V                                           # the smallest key with every index: all kept
    if TOP_K:
        cut_key, cut_idx = _top_k_cut(row_ptr, V, temperature, top_k, cut_key, max_key, BLOCK, SEARCH_BLOCK,
                                      PROBES)
        s = _kept_mass(row_ptr, V, temperature, m, cut_key, cut_idx, SEARCH_BLOCK)
    if TOP_P:
        cut_key, cut_idx = _top_p_cut(row_ptr, V, temperature, top_p, m, s, cut_key, cut_idx, max_key, BLOCK,
                                      SEARCH_BLOCK, PROBES)
        s = _kept_mass(row_ptr, V, temperature, m, cut_key, cut_idx, SEARCH_BLOCK)
    return (row_ptr, m, s, cut_key, cut_idx), bad


@triton.jit
def _probs(dist, offs, V, temperature):
    """p at `offs` (a block, or one token) under the distribution `dist`."""
    row_ptr, m, s, cut_key, cut_idx = dist
    x, key, live = _load(row_ptr, offs, V, temperature)
    return tl.where(live & _kept(key, offs, cut_key, cut_idx), tl.exp(x - m) / s, 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Accepting and correcting one draft
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _accepts(u, p_d, q_d, tau, gamma, TEMPERED: tl.constexpr):
    """sampling._accepts: u < min(1, ((1+tau) p/q)^gamma); u < 1 makes the min implicit."""
    if TEMPERED:
        return (q_d > 0) & (u < tl.exp(gamma * tl.log((1.0 + tau) * p_d / q_d)))
    else:
        return u * q_d < (1.0 + tau) * p_d


@triton.jit
def _gumbel_max_step(best_score, best_tok, probs, noise, offs):
    """Fold one block into a running Gumbel-max draw: argmax of log(probs) + noise, lowest index on ties."""
    score = tl.log(probs) + noise                        # -inf where probs == 0: the noise is finite
    block_best = tl.max(score, axis=0)
    block_tok = tl.min(tl.where(score == block_best, offs, INT32_MAX), axis=0)
    better = block_best > best_score
    return tl.where(better, block_best, best_score), tl.where(better, block_tok, best_tok)


@triton.jit
def _correction(p_dist, q_dist, draft, noise_row, V, temperature, residual_eps,
                DRAFT_Q: tl.constexpr, BLOCK: tl.constexpr):
    """The token replacing a rejected draft, and its source code. One pass draws by Gumbel-max both from the
    residual max(0, p − q) and from p, the fallback when the residual has no mass. Without DRAFT_Q, q is one-hot
    at the draft (q_dist is then unused), so the residual is p without the draft."""
    r_score = float("-inf")
    r_tok = 0
    p_score = float("-inf")
    p_tok = 0
    mass = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = _probs(p_dist, offs, V, temperature)
        if DRAFT_Q:
            q = _probs(q_dist, offs, V, temperature)
        else:
            q = (offs == draft).to(tl.float32)
        r = tl.maximum(p - q, 0.0)
        mass += tl.sum(r, axis=0)
        noise = tl.load(noise_row + offs, mask=offs < V, other=0.0)
        r_score, r_tok = _gumbel_max_step(r_score, r_tok, r, noise, offs)
        p_score, p_tok = _gumbel_max_step(p_score, p_tok, p, noise, offs)
    if DRAFT_Q:
        residual_source = RESIDUAL
    else:
        residual_source = P_MINUS_DRAFT
    has_mass = mass > residual_eps
    return tl.where(has_mass, r_tok, p_tok), tl.where(has_mass, residual_source, FROM_P)


@triton.jit
def _verify_row_kernel(target_ptr, target_stride, draft_ptr, draft_stride, drafts_ptr, uniforms_ptr,
                       noise_ptr, noise_stride,
                       tokens_ptr, p_draft_ptr, q_draft_ptr, source_ptr, bad_ptr, n_accepted_ptr,
                       V, temperature, top_k, top_p, tau, gamma, residual_eps,
                       GREEDY: tl.constexpr, DRAFT_Q: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
                       TEMPERED: tl.constexpr, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                       PROBES: tl.constexpr):
    """Program i verifies draft i of the chain (see the module docstring)."""
    row = tl.program_id(0)
    draft = tl.load(drafts_ptr + row)
    target_row = target_ptr + row * target_stride
    q_d = 1.0
    if GREEDY:
        _, _, best, _, _, bad = _row_stats(target_row, V, 1.0, BLOCK)
        if DRAFT_Q:                                        # q is one-hot at the drafter's argmax: reported only
            _, _, q_best, _, _, q_bad = _row_stats(draft_ptr + row * draft_stride, V, 1.0, BLOCK)
            q_d = (draft == q_best).to(tl.float32)
            bad |= q_bad
        rejected = draft != best
        p_d = (draft == best).to(tl.float32)
        token = best                                       # the draft itself when accepted
        source = tl.where(rejected, ARGMAX, ACCEPTED)
    else:
        p_dist, bad = _distribution(target_row, V, temperature, top_k, top_p, TOP_K, TOP_P, BLOCK, SEARCH_BLOCK,
                                    PROBES)
        p_d = _probs(p_dist, draft, V, temperature)
        q_dist = p_dist
        if DRAFT_Q:
            q_dist, q_bad = _distribution(draft_ptr + row * draft_stride, V, temperature, top_k, top_p,
                                          TOP_K, TOP_P, BLOCK, SEARCH_BLOCK, PROBES)
            q_d = _probs(q_dist, draft, V, temperature)
            bad |= q_bad
        rejected = ~_accepts(tl.load(uniforms_ptr + row), p_d, q_d, tau, gamma, TEMPERED)
        token = draft
        source = tl.full((), ACCEPTED, tl.int32)           # a tensor, as the branch below assigns one
        if rejected:
            token, source = _correction(p_dist, q_dist, draft, noise_ptr + row * noise_stride, V, temperature,
                                        residual_eps, DRAFT_Q, BLOCK)
    tl.store(tokens_ptr + row, token)
    tl.store(p_draft_ptr + row, p_d)
    tl.store(q_draft_ptr + row, q_d)
    tl.store(source_ptr + row, source)
    tl.store(bad_ptr + row, bad)
    tl.atomic_min(n_accepted_ptr, row, mask=rejected)


# ----------------------------------------------------------------------------------------------------------------
# Python side
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class ChainVerdict:
    """The kernel's outputs for a chain of k drafts, on the logits' device and not synchronised."""
    n_accepted: Tensor   # [1] int32: the first rejected draft, or k
    tokens: Tensor       # [k] int32: draft i if accepted, else its correction; tokens[:n_accepted + 1] is the output
    p_draft: Tensor      # [k] float32: p(d_i)
    q_draft: Tensor      # [k] float32: q(d_i), 1 for deterministic drafts
    source: Tensor       # [k] int32: index into SOURCE_NAMES
    bad: Tensor          # [k] int32: nonzero where the row's logits are unusable (NaN, +inf, all -inf)


def verify_rows(drafts: Tensor, target_logits: Tensor, draft_logits: Tensor | None, reads_q: bool,
                params: SamplingParams, uniforms: Tensor | None, gumbel: Tensor | None, tau: float = 0.0,
                gamma: float = 1.0) -> ChainVerdict:
    """Launch one program per draft, with no checks and no synchronisation: the engine's device-side call.

    drafts: [k] integer tensor of valid token ids on the logits' device. target_logits / draft_logits: [>= k, V]
    raw logits (any float dtype), processed with `params`; draft_logits is read only when reads_q. uniforms [>= k]
    and gumbel [>= k, V] float32 are read unless params is greedy.
    """
    k, vocab = drafts.numel(), target_logits.shape[-1]
    device = target_logits.device
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    search_block = min(block, SEARCH_TILE // SEARCH_PROBES)
    target = target_logits.contiguous()
    draft = draft_logits.contiguous() if reads_q else None
    noise = gumbel.to(torch.float32).contiguous() if gumbel is not None else None
    verdict = ChainVerdict(
        n_accepted=torch.full((1,), k, dtype=torch.int32, device=device),
        tokens=torch.empty(k, dtype=torch.int32, device=device),
        p_draft=torch.empty(k, dtype=torch.float32, device=device),
        q_draft=torch.empty(k, dtype=torch.float32, device=device),
        source=torch.empty(k, dtype=torch.int32, device=device),
        bad=torch.empty(k, dtype=torch.int32, device=device),
    )
    _verify_row_kernel[(k,)](
        target, target.stride(0), draft, 0 if draft is None else draft.stride(0),
        drafts.to(device=device, dtype=torch.int32).contiguous(),
        None if uniforms is None else uniforms.to(torch.float32).contiguous(),
        noise, 0 if noise is None else noise.stride(0),
        verdict.tokens, verdict.p_draft, verdict.q_draft, verdict.source, verdict.bad, verdict.n_accepted,
        vocab, params.temperature if not params.greedy else 1.0, params.top_k, params.top_p, tau, gamma,
        RESIDUAL_EPS,
        GREEDY=params.greedy, DRAFT_Q=reads_q, TOP_K=0 < params.top_k < vocab, TOP_P=params.top_p < 1.0,
        TEMPERED=gamma != 1.0, BLOCK=block, SEARCH_BLOCK=search_block, PROBES=SEARCH_PROBES,
        num_warps=4 if block <= 1024 else 8,
        enable_fp_fusion=False,         # round each multiply and add, as torch's separate operations do
    )
    return verdict


def verify_chain_fused(drafts: list[int], target_logits: Tensor, draft_logits: Tensor | None, proposal: Proposal,
                       params: SamplingParams, uniforms: Tensor | None, gumbel: Tensor | None, tau: float = 0.0,
                       reference: bool = False, gamma: float = 1.0) -> ChainResult:
    """`sampling.verify_chain_with_noise` on p = process_logits(target_logits, params) and
    q = process_logits(draft_logits, params), computed by the kernel from the logits.

    Same arguments and result as the oracle, except that it takes logits: rows [>= k, V] on the device the kernel
    runs on, with uniforms [>= k] and gumbel [>= k, V] there too (None when greedy). A caller whose p or q is not
    process_logits (the ISD reference mode scores with the untruncated softmax) passes params without top-k/top-p.
    """
    # q decides for sampled drafts and reference scoring; when greedy, a given q is read only to report q(d), as
    # verify_chain reports it.
    reads_q = scores_with_q(proposal, params, reference) or (
        draft_logits is not None and (proposal is Proposal.SAMPLED or reference))
    drafts = check_chain_args(drafts, target_logits, draft_logits, reads_q, tau, gamma)
    if not drafts:
        return ChainResult(n_accepted=0, correction=None)
    k = len(drafts)
    check_noise(params, uniforms, gumbel, k, target_logits.shape[-1])
    draft_logits = draft_logits[:k] if reads_q else None
    verdict = verify_rows(torch.tensor(drafts), target_logits[:k], draft_logits, reads_q, params, uniforms, gumbel,
                          tau, gamma)
    if verdict.bad.any():
        _raise_for_bad_logits(target_logits[:k], draft_logits)
    n = int(verdict.n_accepted.item())
    shown = slice(0, n + 1)                              # the accepted drafts and the rejected one
    tokens, sources = verdict.tokens[shown].tolist(), verdict.source[shown].tolist()
    rejected = n < k
    return ChainResult(n_accepted=n, correction=tokens[n] if rejected else None,
                       p_draft=verdict.p_draft[shown].tolist(), q_draft=verdict.q_draft[shown].tolist(),
                       resampled_from=SOURCE_NAMES[sources[n]] if rejected else None)


def _raise_for_bad_logits(*rows: Tensor | None) -> None:
    """The kernel flagged unusable logits: process_logits, which owns the error messages, names the problem."""
    for logits in rows:
        if logits is not None:
            process_logits(logits, SamplingParams())
    raise BadInput("unusable logits")

"""Logits processing, sampling and the verification rules (studio.engine.sampling)."""
import math

import pytest
import torch
from scipy.stats import chisquare

from studio.engine.sampling import (
    ChainResult,
    Proposal,
    SamplingParams,
    p_minus_draft_distribution,
    process_logits,
    residual_distribution,
    sample,
    sample_token,
    verify_chain,
)
from studio.errors import BadInput

SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float64)).float()


# ----------------------------------------------------------------------------------------------------------------
# SamplingParams
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(top_k=-1), dict(top_k=2.5),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.5), dict(top_p=float("nan")),
])
def test_invalid_params_raise_badinput(kwargs):
    with pytest.raises(BadInput):
        SamplingParams(**kwargs)


def test_valid_params_and_greedy_flag():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9).greedy
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0)  # the "off" values are valid


# ----------------------------------------------------------------------------------------------------------------
# process_logits
# ----------------------------------------------------------------------------------------------------------------

def test_temperature_matches_softmax_and_is_float32():
    logits = torch.randn(3, 10, generator=gen(0))
    for t in (0.3, 1.0, 2.5):
        out = process_logits(logits, SamplingParams(temperature=t))
        assert out.dtype == torch.float32 and out.shape == logits.shape
        torch.testing.assert_close(out, torch.softmax(logits / t, dim=-1))
    # low-precision inputs are upcast, not processed in half precision
    out = process_logits(logits.to(torch.bfloat16), SamplingParams(temperature=0.5))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.softmax(logits.to(torch.bfloat16).float() / 0.5, -1))


def test_top_k_keeps_exactly_k_renormalised():
    logits = torch.randn(50, generator=gen(1))
    out = process_logits(logits, SamplingParams(temperature=1.0, top_k=5))
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert support(out) == top5
    assert math.isclose(out.sum().item(), 1.0, rel_tol=1e-6)
    idx = sorted(top5)
    torch.testing.assert_close(out[idx], torch.softmax(logits[idx], -1))
    # top_k >= V is a no-op
    torch.testing.assert_close(process_logits(logits, SamplingParams(temperature=1.0, top_k=50)),
                               torch.softmax(logits, -1))


def test_top_k_ties_go_to_lowest_index():
    logits = torch.tensor([0.0, 2.0, 2.0, 2.0, 1.0, 2.0])
    assert support(process_logits(logits, SamplingParams(temperature=1.0, top_k=2))) == {1, 2}
    assert support(process_logits(logits, SamplingParams(temperature=1.0, top_k=1))) == {1}
    out = process_logits(logits, SamplingParams(temperature=1.0, top_k=3))
    assert support(out) == {1, 2, 3}
    torch.testing.assert_close(out[[1, 2, 3]], torch.full((3,), 1 / 3))


def test_top_p_minimal_prefix_hand_example():
    # sorted: 0.5 (idx 1), 0.3 (idx 3), 0.15 (idx 2), 0.05 (idx 0); mass before each: 0, 0.5, 0.8, 0.95
    logits = logits_of([0.05, 0.5, 0.15, 0.3])

    def nucleus(top_p):
        return process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))

    out = nucleus(0.7)                      # 0.5 < 0.7 <= 0.8 -> {1, 3}
    assert support(out) == {1, 3}
    torch.testing.assert_close(out, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    out = nucleus(0.85)                     # 0.8 < 0.85 <= 0.95 -> {1, 3, 2}
    assert support(out) == {1, 2, 3}
    torch.testing.assert_close(out, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    assert support(nucleus(0.4)) == {1}     # the top token alone already has mass >= 0.4
    assert support(nucleus(1e-6)) == {1}    # the top token is always kept
    assert support(nucleus(0.8 - 1e-4)) == {1, 3}
    assert support(nucleus(0.8 + 1e-4)) == {1, 2, 3}
    assert support(nucleus(1.0)) == {0, 1, 2, 3}


def test_top_p_prefix_reaching_top_p_exactly_stops():
    # uniform over 4 -> each exactly 0.25: mass >= top_p is reached exactly, so the next token is not added
    logits = torch.zeros(4)
    assert support(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))) == {0, 1}
    assert support(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))) == {0, 1, 2}
    assert support(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.25))) == {0}


def test_top_p_ties_deterministic():
    logits = logits_of([0.2, 0.4, 0.2, 0.2])
    out = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert support(out) == {0, 1}           # 0.4 then the lowest-index 0.2


def test_top_k_then_top_p_order():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # top-k=2 first -> [4/7, 3/7]; nucleus 0.5 of that keeps only token 0.
    # (top-p first would keep {0, 1}: 0.4 < 0.5 on the unfiltered distribution.)
    out = process_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    out = process_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    torch.testing.assert_close(out, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    # temperature is applied before the filters
    # T=0.5 squares p: top 3 -> [.16, .09, .04] / .29, mass before token 2 = .862 >= .85 -> cut.
    # (At T=1 the top 3 are [.4, .3, .2] / .9, mass before token 2 = .778 < .85 -> kept.)
    out = process_logits(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.85))
    sharp = torch.tensor([0.16, 0.09, 0.04]) / 0.29
    assert support(out) == {0, 1}
    assert support(process_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.85))) == {0, 1, 2}
    torch.testing.assert_close(out[:2], sharp[:2] / sharp[:2].sum())


def test_batched_rows_processed_independently():
    logits = torch.randn(2, 3, 20, generator=gen(2))
    params = SamplingParams(temperature=0.8, top_k=7, top_p=0.8)
    out = process_logits(logits, params)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(out[i, j], process_logits(logits[i, j], params))
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3))


def by_sorting(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """process_logits's definition, written as whole-row stable sorts (what the top-k/top-p shortcuts must equal)."""
    order = lambda x: torch.sort(x, dim=-1, descending=True, stable=True).indices
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, order(x)[..., :params.top_k], True)
        x = x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        o = order(probs)
        sorted_probs = torch.gather(probs, -1, o).double()
        keep_sorted = torch.cumsum(sorted_probs, -1) - sorted_probs < params.top_p
        keep_sorted[..., 0] = True
        probs = torch.where(torch.zeros_like(keep_sorted).scatter_(-1, o, keep_sorted), probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@pytest.mark.parametrize("rows", ["peaked", "flat", "ties", "masked"])
def test_top_k_and_top_p_shortcuts_equal_sorting_the_row(rows):
    # a vocabulary past NUCLEUS_CANDIDATES: the nucleus found among the likeliest tokens (peaked), over the whole
    # row when they hold too little (flat), and a tie across either cut (ties: values on a grid of halves)
    g = gen(11)
    x = torch.randn(3, 2000, generator=g) * {"peaked": 6.0, "flat": 0.5, "ties": 3.0, "masked": 4.0}[rows]
    if rows == "ties":
        x = torch.round(x * 2) / 2
    if rows == "masked":
        x[torch.rand(x.shape, generator=g) < 0.5] = float("-inf")
        x[:, 0] = 0.0
    for k in (0, 1, 5, 300, 1999):
        for p in (1.0, 0.9, 0.5, 0.999999, 1e-6):
            params = SamplingParams(temperature=0.7, top_k=k, top_p=p)
            assert torch.equal(process_logits(x, params), by_sorting(x, params)), (k, p)
            assert torch.equal(process_logits(x[1], params), by_sorting(x[1], params)), (k, p)


def test_greedy_is_one_hot_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -3.0]])
    out = process_logits(logits, GREEDY)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]))
    # top-k / top-p do not change greedy
    torch.testing.assert_close(process_logits(logits, SamplingParams(top_k=2, top_p=0.3)), out)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, SamplingParams(temperature=0.7, top_k=3, top_p=0.5)])
def test_nan_logits_raise_badinput(params):
    logits = torch.randn(2, 6, generator=gen(3))
    logits[1, 4] = float("nan")
    with pytest.raises(BadInput, match="NaN"):
        process_logits(logits, params)


def test_masked_logits_allowed_but_all_masked_row_rejected():
    logits = torch.tensor([float("-inf"), 1.0, float("-inf"), 0.0])
    out = process_logits(logits, SAMPLED)
    assert support(out) == {1, 3}
    with pytest.raises(BadInput):
        process_logits(torch.full((4,), float("-inf")), SAMPLED)


# ----------------------------------------------------------------------------------------------------------------
# sample / sample_token
# ----------------------------------------------------------------------------------------------------------------

def test_sample_is_reproducible_and_shaped():
    probs = torch.softmax(torch.randn(5, 30, generator=gen(4)), -1)
    a, b = sample(probs, gen(7)), sample(probs, gen(7))
    assert a.dtype == torch.long and a.shape == (5,) and torch.equal(a, b)
    t = sample(probs[0], gen(7))
    assert isinstance(t, int) and t == sample(probs[0], gen(7))
    assert sample(torch.tensor([0.0, 0.0, 1.0]), gen(0)) == 2


def test_sample_token():
    logits = torch.tensor([0.0, 2.0, 2.0, -1.0])
    g = gen(0)
    state = g.get_state()
    tok, probs = sample_token(logits, GREEDY, g)
    assert tok == 1 and torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.equal(g.get_state(), state)         # greedy consumes no randomness
    params = SamplingParams(temperature=0.9, top_k=2)
    tok, probs = sample_token(logits, params, gen(5))
    assert tok in (1, 2) and support(probs) == {1, 2}
    assert sample_token(logits, params, gen(5))[0] == tok


# ----------------------------------------------------------------------------------------------------------------
# verify_chain: exact uniforms replayed by hand
# ----------------------------------------------------------------------------------------------------------------

def _random_rows(seed: int, k: int, v: int, temp: float) -> torch.Tensor:
    return process_logits(torch.randn(k, v, generator=gen(seed)) * 2, SamplingParams(temperature=temp))


def test_sampled_chain_replays_uniforms_by_hand():
    k, v = 6, 12
    patterns = set()
    for seed in range(60):
        logits = torch.randn(k, v, generator=gen(1000 + seed)) * 2
        noise = torch.randn(k, v, generator=gen(2000 + seed)) * 0.6        # q close to p: long accepted runs
        p, q = process_logits(logits, SAMPLED), process_logits(logits + noise, SamplingParams(temperature=1.2))
        drafts = [sample(q[i], gen(3000 + seed * 10 + i)) for i in range(k)]
        res = verify_chain(drafts, p, q, Proposal.SAMPLED, SAMPLED, gen(seed))

        replay = gen(seed)
        n = 0
        for i, d in enumerate(drafts):
            u = torch.rand(1, generator=replay).item()
            assert res.p_draft[i] == p[i, d].item() and res.q_draft[i] == q[i, d].item()
            if u * q[i, d].item() < p[i, d].item():
                n += 1
                continue
            residual = torch.clamp(p[i] - q[i], min=0)
            expected = torch.multinomial(residual / residual.sum(), 1, generator=replay).item()
            assert res.correction == expected and res.resampled_from == "residual"
            break
        assert res.n_accepted == n
        assert len(res.p_draft) == len(res.q_draft) == min(n + 1, k)
        if n == k:
            assert res.correction is None and res.resampled_from is None
        patterns.add(n)
    assert 0 in patterns and k in patterns and len(patterns) >= 4   # the seeds exercise varied outcomes


def test_deterministic_chain_replays_uniforms_by_hand():
    k, v = 5, 10
    patterns = set()
    for seed in range(40):
        p = _random_rows(4000 + seed, k, v, 0.5)
        drafts = torch.randint(0, v, (k,), generator=gen(5000 + seed)).tolist()
        drafts[0] = int(torch.argmax(p[0]))                  # make early acceptances likely
        res = verify_chain(drafts, p, None, Proposal.DETERMINISTIC, SAMPLED, gen(seed))
        replay = gen(seed)
        n = 0
        for i, d in enumerate(drafts):
            u = torch.rand(1, generator=replay).item()
            assert res.q_draft[i] == 1.0
            if u < p[i, d].item():
                n += 1
                continue
            rest = p[i].clone()
            rest[d] = 0
            assert res.correction == torch.multinomial(rest / rest.sum(), 1, generator=replay).item()
            assert res.correction != d and res.resampled_from == "p_minus_draft"
            break
        assert res.n_accepted == n
        patterns.add(n)
    assert len(patterns) >= 2


def test_tau_zero_is_exact_rule_and_large_tau_accepts():
    p, q = _random_rows(1, 6, 12, 1.0), _random_rows(2, 6, 12, 1.0)
    drafts = [sample(q[i], gen(10 + i)) for i in range(6)]
    a = verify_chain(drafts, p, q, Proposal.SAMPLED, SAMPLED, gen(3))
    b = verify_chain(drafts, p, q, Proposal.SAMPLED, SAMPLED, gen(3), tau=0.0)
    assert a == b
    # (1 + tau) * p(d) >= q(d) for every draft -> always accepted
    tau = max(q[i, d].item() / p[i, d].item() for i, d in enumerate(drafts))
    for seed in range(20):
        assert verify_chain(drafts, p, q, Proposal.SAMPLED, SAMPLED, gen(seed), tau=tau).n_accepted == 6
    with pytest.raises(BadInput):
        verify_chain(drafts, p, q, Proposal.SAMPLED, SAMPLED, gen(3), tau=-0.1)


def test_deterministic_draft_with_p_one_always_accepted():
    p = torch.tensor([[0.0, 1.0, 0.0]])
    for seed in range(50):
        assert verify_chain([1], p, None, Proposal.DETERMINISTIC, SAMPLED, gen(seed)).n_accepted == 1
    assert p_minus_draft_distribution(p[0], 1) is None


# ----------------------------------------------------------------------------------------------------------------
# verify_chain: greedy
# ----------------------------------------------------------------------------------------------------------------

def test_greedy_accept_pattern_and_ties():
    logits = torch.tensor([
        [0.0, 4.0, 1.0, 2.0],   # argmax 1
        [3.0, 0.0, 3.0, 1.0],   # tie 0/2 -> 0
        [0.0, 1.0, 2.0, 2.0],   # tie 2/3 -> 2
        [9.0, 0.0, 0.0, 0.0],
    ])
    p = process_logits(logits, GREEDY)
    g = gen(0)
    state = g.get_state()

    res = verify_chain([1, 0, 2, 0], p, None, Proposal.DETERMINISTIC, GREEDY, g)
    assert (res.n_accepted, res.correction, res.resampled_from) == (4, None, None)
    assert res.p_draft == [1.0] * 4 and res.q_draft == [1.0] * 4

    res = verify_chain([1, 2, 2, 0], p, None, Proposal.DETERMINISTIC, GREEDY, g)   # 2 loses the tie to 0
    assert (res.n_accepted, res.correction, res.resampled_from) == (1, 0, "argmax")
    assert res.p_draft == [1.0, 0.0]

    res = verify_chain([1, 0, 3, 0], p, None, Proposal.DETERMINISTIC, GREEDY, g)
    assert (res.n_accepted, res.correction) == (2, 2)

    res = verify_chain([3], p, p, Proposal.SAMPLED, GREEDY, g)                      # proposal kind irrelevant
    assert (res.n_accepted, res.correction, res.resampled_from) == (0, 1, "argmax")
    assert torch.equal(g.get_state(), state)                                         # no randomness consumed
    assert verify_chain([], p, None, Proposal.DETERMINISTIC, GREEDY, g) == ChainResult(0, None, [], [], None)


# ----------------------------------------------------------------------------------------------------------------
# verify_chain: the committed token is distributed as p (chi-square, V = 8)
# ----------------------------------------------------------------------------------------------------------------

N = 50_000
P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.15, 0.05, 0.10, 0.10])   # argmax Q = 2, where P is only 0.15
P, Q = P / P.sum(), Q / Q.sum()
P1, Q1 = P[None], Q[None]
V = P.numel()


def first_committed(drafts, q, proposal, seed, **kw) -> tuple[torch.Tensor, set[str]]:
    """Counts of the first committed token (accepted draft or correction) over the given drafts."""
    g = gen(seed)
    out = []
    sources = set()
    for d in drafts:
        res = verify_chain([d], P1, q, proposal, SAMPLED, g, **kw)
        out.append(d if res.n_accepted else res.correction)
        sources.add(res.resampled_from)
    return torch.bincount(torch.tensor(out), minlength=V), sources


def chi2_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square p-value of counts against a distribution; counts outside its support fail outright."""
    supp = expected > 0
    if counts[~supp].sum() > 0:
        return 0.0
    counts, expected = counts[supp].double(), expected[supp].double()
    f_exp = expected / expected.sum() * counts.sum().item()
    return chisquare(counts.numpy(), f_exp.numpy()).pvalue


def sampled_drafts(seed: int) -> list[int]:
    return torch.multinomial(Q, N, replacement=True, generator=gen(seed)).tolist()


def test_exact_sampled_drafts_commit_p():
    counts, sources = first_committed(sampled_drafts(11), Q1, Proposal.SAMPLED, 12)
    assert sources == {None, "residual"}
    assert chi2_p(counts, P) > 0.01
    assert chi2_p(counts, Q) < 1e-6                       # sanity: the test can tell p from q


def test_exact_deterministic_argmax_q_commits_p():
    d = int(torch.argmax(Q))
    counts, sources = first_committed([d] * N, Q1, Proposal.DETERMINISTIC, 13)
    assert sources == {None, "p_minus_draft"}
    assert chi2_p(counts, P) > 0.01


def test_exact_deterministic_fixed_draft_commits_p():
    counts, _ = first_committed([6] * N, None, Proposal.DETERMINISTIC, 14)
    assert chi2_p(counts, P) > 0.01


def _accept_prob(p, q, tau):
    return torch.clamp((1 + tau) * p.double() / q.double(), max=1.0)


def test_relaxed_tau_is_lossy_and_matches_its_formula():
    tau = 0.5
    counts, _ = first_committed(sampled_drafts(15), Q1, Proposal.SAMPLED, 16, tau=tau)
    assert chi2_p(counts, P) < 1e-6
    # the distribution it does produce: q(x) a(x) + (1 - sum q a) residual(x), a = min(1, (1+tau) p/q)
    accepted = Q.double() * _accept_prob(P, Q, tau)
    residual = torch.clamp(P.double() - Q.double(), min=0)
    assert chi2_p(counts, accepted + (1 - accepted.sum()) * residual / residual.sum()) > 0.01


def test_reference_scoring_of_argmax_drafts_is_biased_and_matches_its_formula():
    d = int(torch.argmax(Q))
    counts, sources = first_committed([d] * N, Q1, Proposal.DETERMINISTIC, 17, reference=True)
    assert sources == {None, "residual"}
    assert chi2_p(counts, P) < 1e-6
    # accept with min(1, p(d)/q(d)), else the residual max(0, p - q)
    a = _accept_prob(P, Q, 0.0)[d]
    residual = torch.clamp(P.double() - Q.double(), min=0)
    expected = (1 - a) * residual / residual.sum()
    expected[d] += a
    assert chi2_p(counts, expected) > 0.01


# ----------------------------------------------------------------------------------------------------------------
# Zero residual: fall back to p, never to token 0
# ----------------------------------------------------------------------------------------------------------------

def test_zero_residual_falls_back_to_p():
    p = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.2, 0.15, 0.0, 0.0])   # token 0 is outside p's support
    assert residual_distribution(p, p) is None
    assert torch.equal(residual_distribution(p, torch.tensor([0.0, 0.1, 0, 0.25, 0.2, 0.15, 0.3, 0])),
                       torch.tensor([0.0, 1.0, 0, 0, 0, 0, 0, 0]))
    # q == p and a draft outside both supports: always rejected, and the residual p - q is empty.
    g = gen(21)
    out = []
    for _ in range(20_000):
        res = verify_chain([6], p[None], p[None], Proposal.SAMPLED, SAMPLED, g)
        assert res.n_accepted == 0 and res.resampled_from == "p"
        out.append(res.correction)
    counts = torch.bincount(torch.tensor(out), minlength=8)
    assert set(torch.nonzero(counts).flatten().tolist()) <= support(p)
    assert chi2_p(counts, p) > 0.01
    # reference scoring with p == q can never reject (ratio 1)
    for seed in range(50):
        assert verify_chain([1], p[None], p[None], Proposal.DETERMINISTIC, SAMPLED, gen(seed),
                            reference=True).n_accepted == 1


def test_bad_calls_raise():
    with pytest.raises(ValueError):
        verify_chain([1], P1, None, Proposal.SAMPLED, SAMPLED, gen(0))       # sampled drafts need q
    with pytest.raises(ValueError):
        verify_chain([1], P1, None, Proposal.DETERMINISTIC, SAMPLED, gen(0), reference=True)
    with pytest.raises(ValueError):
        verify_chain([1, 2], P1, None, Proposal.DETERMINISTIC, SAMPLED, gen(0))   # fewer rows than drafts
    with pytest.raises(ValueError):
        verify_chain([V], P1, None, Proposal.DETERMINISTIC, SAMPLED, gen(0))

"""S2D2 routing policies: each decision flips where its rule says, estimators match hand values,
hysteresis holds its state, UCB learns per context bucket, bad parameters are BadInput."""
import math
import random

import pytest
import torch

from studio.engine.strategies.routing import (
    ALIASES, POLICIES, RouteInput, acceptance_probs, expected_accepted, make_policy)
from studio.errors import BadInput

V = 4
ONE_HOT = [1.0, 0.0, 0.0, 0.0]
HALF = [0.5, 0.5, 0.0, 0.0]            # H̃ = log 2 / log 4 = 1/2
UNIFORM = [0.25, 0.25, 0.25, 0.25]     # H̃ = 1


def inp(rows=None, span_len=None, n_masked=8, block_size=8, n_hi=None):
    probs = None if rows is None else torch.tensor(rows, dtype=torch.float64)
    span_len = len(rows) if span_len is None else span_len
    return RouteInput(span_len=span_len, n_masked=n_masked, block_size=block_size, probs=probs,
                      vocab_size=V, step=0, n_hi=n_hi)


def test_registry_names_and_aliases():
    assert POLICIES == ("always", "never", "min-span", "score", "hysteresis", "ucb")
    for ref, canon in ALIASES.items():
        assert make_policy(ref).name == canon
    assert make_policy("always").decide(inp(span_len=1))[0] is True
    assert make_policy("never").decide(inp(span_len=5))[0] is False
    for name in POLICIES:   # an empty span is never verified
        assert make_policy(name).decide(inp(span_len=0)) == (False, -math.inf)


def test_min_span_flips_at_threshold():
    pol = make_policy("min-span", min_span=3)
    assert pol.decide(inp(span_len=2)) == (False, 2.0)
    assert pol.decide(inp(span_len=3)) == (True, 3.0)
    assert make_policy("min-span").params.min_span == 1   # reference default: always verify


def test_estimators_by_hand():
    rows = torch.tensor([ONE_HOT, HALF, UNIFORM, [0.6, 0.3, 0.1, 0.0], [0.4, 0.38, 0.22, 0.0]],
                        dtype=torch.float64)
    h4 = -(0.6 * math.log(0.6) + 0.3 * math.log(0.3) + 0.1 * math.log(0.1)) / math.log(4)
    h5 = -(0.4 * math.log(0.4) + 0.38 * math.log(0.38) + 0.22 * math.log(0.22)) / math.log(4)
    ent = acceptance_probs(rows, "entropy", beta=1.0)
    want = [1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-h4), math.exp(-h5)]
    assert ent.tolist() == pytest.approx(want)
    assert acceptance_probs(rows, "entropy", beta=2.0)[1].item() == pytest.approx(math.exp(-1.0))
    # margins: 1, 0, 0, 0.3, 0.02
    assert acceptance_probs(rows, "margin", margin=0.05).tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert acceptance_probs(rows, "margin", margin=0.01).tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert acceptance_probs(rows, "soft-margin").tolist() == pytest.approx([1.0, 0.0, 0.0, 0.3, 0.02])
    assert acceptance_probs(rows, "renyi2").tolist() == pytest.approx(
        [1.0, 0.5, 0.25, 0.46, 0.16 + 0.1444 + 0.0484])
    assert acceptance_probs(rows, "hard-entropy", entropy_threshold=0.6).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    # normalization uses vocab_size when given (e.g. a padded logits row)
    assert acceptance_probs(rows[1:2], "entropy", vocab_size=16).item() == pytest.approx(math.exp(-0.25))
    # K̂ = Σ_k Π_{i≤k} α_i
    assert expected_accepted(torch.tensor([1.0, 1.0, 0.0, 1.0])) == 2.0
    assert expected_accepted(torch.tensor([0.5, 0.5, 1.0])) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted(torch.tensor([])) == 0.0


def test_score_static_entropy_flips_at_threshold():
    rows = [ONE_HOT, HALF]                          # K̂ = 1 + e^{-1/2} ≈ 1.6065, s = K̂ − 1 ≈ 0.6065
    s = math.exp(-0.5)
    verify, score = make_policy("score", threshold=0.60).decide(inp(rows))
    assert verify and score == pytest.approx(s)
    assert make_policy("score", threshold=0.61).decide(inp(rows)) == (False, pytest.approx(s))
    # the paper's SDAR-8B config A (defaults: static, c = 1, τ = 0) = verify iff K̂ ≥ 1
    pol = make_policy("score")
    assert pol.decide(inp([ONE_HOT])) == (True, 0.0)
    nearly = [1 - 1e-3, 1e-3, 0.0, 0.0]            # α just below 1
    verify, score = pol.decide(inp([nearly]))
    assert not verify and -0.01 < score < 0


def test_score_static_margin_flips_at_threshold():
    rows = [ONE_HOT, [0.6, 0.3, 0.1, 0.0], [0.4, 0.38, 0.22, 0.0], ONE_HOT]   # α = 1, 1, 0, 1 → K̂ = 2
    p = dict(estimator="margin", margin=0.05, c=1.0)
    assert make_policy("score", threshold=1.0, **p).decide(inp(rows)) == (True, 1.0)
    assert make_policy("score", threshold=1.01, **p).decide(inp(rows)) == (False, 1.0)
    # the same span under the entropy estimator scores differently (computed above by hand)
    _, s_ent = make_policy("score", threshold=1.0, c=1.0).decide(inp(rows))
    h = -(0.6 * math.log(0.6) + 0.3 * math.log(0.3) + 0.1 * math.log(0.1)) / math.log(4)
    h3 = -(0.4 * math.log(0.4) + 0.38 * math.log(0.38) + 0.22 * math.log(0.22)) / math.log(4)
    a2, a3 = math.exp(-h), math.exp(-h3)
    assert s_ent == pytest.approx(1 + a2 + a2 * a3 + a2 * a3 - 1.0)
    # margin crossing on one position: 0.12 ≥ 0.1 → α = 1, 0.08 → α = 0
    pol = make_policy("score", estimator="margin", margin=0.1, c=1.0, threshold=0.0)
    assert pol.decide(inp([[0.5, 0.38, 0.12, 0.0]]))[0] is True
    assert pol.decide(inp([[0.5, 0.42, 0.08, 0.0]]))[0] is False


def test_score_dynamic_threshold_moves_with_n_hi():
    rows = [ONE_HOT, ONE_HOT]                       # K̂ = 2; s = 2 − c·N_hi ≥ 0 ⇔ N_hi ≤ 2/c
    pol = make_policy("score", mode="dynamic", c=1.0, threshold=0.0)
    assert pol.decide(inp(rows, n_hi=0)) == (True, 2.0)
    assert pol.decide(inp(rows, n_hi=2)) == (True, 0.0)
    assert pol.decide(inp(rows, n_hi=3)) == (False, -1.0)
    pol2 = make_policy("score", mode="difference_dynamic", c=2.0, threshold=0.0)
    assert pol2.decide(inp(rows, n_hi=1))[0] is True and pol2.decide(inp(rows, n_hi=2))[0] is False
    with pytest.raises(ValueError):
        pol.decide(inp(rows))                       # dynamic without n_hi
    with pytest.raises(ValueError):
        make_policy("score").decide(inp(span_len=2))   # score policy without probs


def test_hysteresis_sequence():
    # K̂ = 2, dynamic c = 1 → s = 2 − N_hi; τ_on = 1, τ_off = −3
    pol = make_policy("hysteresis", on=1.0, off=-3.0)
    n_hi = [4, 1, 3, 4, 6, 3, 0]
    scores = [-2, 1, -1, -2, -4, -1, 2]    # below on (off), ≥ on, between, between, < off, between, above
    want = [False, True, True, True, False, False, True]
    got = [pol.decide(inp([ONE_HOT, ONE_HOT], n_hi=k)) for k in n_hi]
    assert [v for v, _ in got] == want
    assert [s for _, s in got] == scores
    # reset() starts over (a policy keeps its state across blocks, as the reference does for a whole generate call)
    assert pol.is_on
    pol.reset()
    assert not pol.is_on
    # the scripted state machine directly, and the reference's strict ">" for switching on
    paper, ref = make_policy("hysteresis", on=0.0, off=-1.0), make_policy("hysteresis", on=0.0, off=-1.0,
                                                                           strict_on=True)
    seq = [-0.5, 0.0, -0.5, -1.5, 0.5]
    assert [paper.update(s) for s in seq] == [False, True, True, False, True]
    assert [ref.update(s) for s in seq] == [False, False, False, False, True]
    # defaults: paper Fast-dLLM v2 configs (τ_on = 1, τ_off = −5, dynamic, c = 1)
    d = make_policy("hysteresis").params
    assert (d.on, d.off, d.mode, d.c, d.estimator) == (1.0, -5.0, "dynamic", 1.0, "entropy")


def test_ucb_explores_then_exploits_per_bucket():
    rng = random.Random(0)
    pol = make_policy("ucb", beta=1.0)
    long_span = inp(span_len=8, n_masked=8, block_size=8)   # span bin 1: verification pays
    short_span = inp(span_len=1, n_masked=8, block_size=8)  # span bin 0: verification wastes a forward
    b_long, b_short = pol.bucket(long_span), pol.bucket(short_span)
    assert b_long != b_short

    def reward(x, verify):
        if x is long_span:
            return rng.randint(5, 8) if verify else 1       # ≈ 3.25 vs 1 per unit cost
        return 1 if verify else rng.randint(1, 2)            # 0.5 vs ≈ 1.5

    first = []
    log = []
    for i in range(300):
        x = long_span if i % 2 == 0 else short_span
        verify, score = pol.decide(x)
        if i < 4:
            first.append(verify)
        pol.feedback(reward(x, verify), verify)
        log.append((x is long_span, verify))
    # each arm of each bucket is tried first (ties go to verify, then the unseen skip arm)
    assert first == [True, True, False, False]
    last = log[-100:]
    right = sum(verify == is_long for is_long, verify in last)
    assert right >= 90
    # per bucket too (UCB still re-explores now and then: log t regret)
    assert sum(v for is_long, v in last if is_long) >= 45
    assert sum(not v for is_long, v in last if not is_long) >= 45
    assert pol.count[1][b_long] > pol.count[0][b_long] and pol.count[0][b_short] > pol.count[1][b_short]


def test_ucb_context_buckets():
    pol = make_policy("ucb")
    assert pol.n_buckets == 8
    # span on [1, B]: 1..4 → bin 0, 5..8 → bin 1; progress (B − n_masked)/B; mean entropy of the span
    assert pol.bucket(inp(span_len=4, n_masked=8)) == 0
    assert pol.bucket(inp(span_len=5, n_masked=8)) == 4
    assert pol.bucket(inp(span_len=1, n_masked=4)) == 2
    assert pol.bucket(inp([UNIFORM], n_masked=8)) == 1
    assert pol.bucket(inp([HALF], n_masked=8)) == 1     # H̃ = 0.5 → upper bin
    assert pol.bucket(inp([ONE_HOT], n_masked=8)) == 0
    # feedback without a pending decision is ignored; the default cost is 2 for a verify
    pol.feedback(5, True)
    assert sum(pol.count[1]) == 0
    pol.decide(inp(span_len=8))
    pol.feedback(6, True)
    assert pol.reward_sum[1][pol.bucket(inp(span_len=8))] == 3.0


@pytest.mark.parametrize("name, params", [
    ("nope", {}),
    ("min-span", {"min_span": 0}),
    ("min-span", {"min_span": 2.5}),
    ("min-span", {"min_span": True}),
    ("min-span", {"span": 2}),
    ("score", {"mode": "weird"}),
    ("score", {"estimator": "bogus"}),
    ("score", {"c": -1.0}),
    ("score", {"beta": -0.1}),
    ("score", {"margin": 1.5}),
    ("score", {"threshold": "high"}),
    ("score", {"threshold": math.nan}),
    ("score", {"entropy_threshold": 0.0}),
    ("hysteresis", {"on": -1.0, "off": 0.0}),
    ("hysteresis", {"on": 0.0, "off": 0.0}),
    ("hysteresis", {"strict_on": 1}),
    ("ucb", {"beta": -1.0}),
    ("ucb", {"span_bins": 0}),
    ("always", {"x": 1}),
])
def test_bad_params(name, params):
    with pytest.raises(BadInput):
        make_policy(name, **params)


def test_param_coercion_and_aliases():
    p = make_policy("score", threshold=1, c=2, estimator="hard_margin_threshold", mode="difference_static").params
    assert p.threshold == 1.0 and isinstance(p.threshold, float)
    assert (p.estimator, p.mode) == ("margin", "static")

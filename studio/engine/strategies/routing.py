"""S2D2 verification routing: whether a step verifies the first contiguous masked span C_t of the open block
(policies from the S2D2 paper, §4.3 and appendix A: min-span, score, hysteresis, ucb; plus always and never).

Pure decision logic, no model calls: the S2D2 strategy builds a `RouteInput` per step, `decide(x)` returns
(verify?, score), and `feedback(accepted, verified)` after the step feeds the UCB bandit. Defaults are the
paper's operating points where it states one (cited per field), else the reference code's
(`SDAR/generate_ssd_policy.py`); where they disagree the paper's rule is the default and the code's an option.

Design: docs/strategies.md#s2d2-routing-policies
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from studio.errors import BadInput
from studio.engine.strategies.params import param, parse_params


# -- the protocol ---------------------------------------------------------------------------------
@dataclass
class RouteInput:
    """What the S2D2 step knows when it decides."""
    span_len: int                       # |C_t|: length of the first contiguous masked span
    n_masked: int                       # masked tokens left in the block (|M_t|)
    block_size: int                     # B (the sub-block size for Fast-dLLM v2 style drafting)
    probs: torch.Tensor | None = None   # [span_len, V] drafter distributions over the span (after the
                                        # same temperature/top-k/top-p as drafting), or None
    vocab_size: int = 0                 # V for the normalized entropy H/log V; 0 = probs.shape[-1]
    step: int = 0                       # denoising step index inside the block
    n_hi: int | None = None             # N_hi for the dynamic score: masked positions in the block
                                        # with draft confidence > τ (required by mode="dynamic")


class RoutingPolicy:
    """Base policy. Subclasses declare parameters as dataclass fields of `Params`."""
    name: ClassVar[str]

    @dataclass
    class Params:
        pass

    def __init__(self, params: dict | None = None):
        self.params = self.parse(params or {})
        self.reset()

    # -- parameters ---------------------------------------------------------------------------
    @classmethod
    def parse(cls, params: dict):
        p = parse_params(f"routing policy {cls.name!r}", cls.Params, params)
        cls.validate(p)
        return p

    @staticmethod
    def validate(p) -> None:
        """Raise BadInput for out-of-range parameter values."""

    # -- decisions ----------------------------------------------------------------------------
    def decide(self, x: RouteInput) -> tuple[bool, float]:
        """(verify?, score). An empty span is never verified (score −inf, as the reference)."""
        if x.span_len <= 0:
            self._on_empty_span()
            return False, -math.inf
        return self._decide(x)

    def _decide(self, x: RouteInput) -> tuple[bool, float]:
        raise NotImplementedError

    def _on_empty_span(self) -> None:
        pass

    def feedback(self, accepted: int, verified: int | bool, cost: float | None = None) -> None:
        """Reward signal after the step that followed the last `decide`: `accepted` = tokens the step
        committed (verifier-accepted + resampled + threshold fallback), `verified` = whether the
        verifier ran, `cost` = the step's forwards (default 2 if verified else 1, paper Eq. 18).
        No-op except for UCB."""

    def reset(self) -> None:
        """A new generation starts: forget all state."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"


# -- estimators -----------------------------------------------------------------------------------
ESTIMATORS = ("entropy", "margin", "soft-margin", "renyi2", "hard-entropy")
_ESTIMATOR_ALIASES = {   # reference `token_acceptance_estimator` names
    "soft_entropy_negexp": "entropy", "hard_margin_threshold": "margin",
    "soft_clipped_linear_margin": "soft-margin", "soft_renyi_2_entropy": "renyi2",
    "hard_entropy_threshold": "hard-entropy",
}
MODES = ("static", "dynamic")
_MODE_ALIASES = {"difference_static": "static", "difference_dynamic": "dynamic"}


def normalized_entropy(probs: torch.Tensor, vocab_size: int = 0) -> torch.Tensor:
    """H̃_i = H(P_i) / log V per row (0·log 0 = 0). V = vocab_size, or the row width if 0."""
    v = vocab_size or probs.shape[-1]
    p = probs.double()
    h = -torch.special.xlogy(p, p).sum(-1)
    return h / math.log(v) if v > 1 else torch.zeros_like(h)


def margins(probs: torch.Tensor) -> torch.Tensor:
    """m_i = top1(P_i) − top2(P_i) (the top-1 probability itself when V = 1)."""
    p = probs.double()
    if p.shape[-1] < 2:
        return p[:, 0]
    top = torch.topk(p, 2, dim=-1).values
    return top[:, 0] - top[:, 1]


def acceptance_probs(probs: torch.Tensor, estimator: str = "entropy", *, beta: float = 1.0,
                     margin: float = 0.05, margin_coef: float = 1.0, entropy_threshold: float = 0.1,
                     vocab_size: int = 0) -> torch.Tensor:
    """α_i ∈ [0, 1] per span row of `probs` [L, V] (paper §4.3 and App. A.5):
      entropy       exp(−β·H̃_i)              paper main experiments (β = 1)
      margin        1[m_i ≥ τ_margin]         paper §4.3 ("≥"; the reference code uses ">")
      soft-margin   clip(coef·m_i, 0, 1)      reference extra
      renyi2        clip(Σ_v P_i(v)², 0, 1)   paper A.5
      hard-entropy  1[H̃_i < τ_ent]            paper A.5
    """
    estimator = _ESTIMATOR_ALIASES.get(estimator, estimator)
    if estimator == "entropy":
        return torch.exp(-beta * normalized_entropy(probs, vocab_size))
    if estimator == "margin":
        return (margins(probs) >= margin).double()
    if estimator == "soft-margin":
        return (margin_coef * margins(probs)).clamp(0.0, 1.0)
    if estimator == "renyi2":
        return (probs.double() ** 2).sum(-1).clamp(0.0, 1.0)
    if estimator == "hard-entropy":
        return (normalized_entropy(probs, vocab_size) < entropy_threshold).double()
    raise ValueError(f"unknown acceptance estimator {estimator!r}")


def expected_accepted(alpha: torch.Tensor) -> float:
    """K̂ = Σ_k Π_{i≤k} α_i (paper Eq. 5), α clipped to [0, 1]."""
    if alpha.numel() == 0:
        return 0.0
    return float(torch.cumprod(alpha.double().clamp(0.0, 1.0), dim=0).sum())


# -- policies -------------------------------------------------------------------------------------
class AlwaysPolicy(RoutingPolicy):
    """Verify at every step (= min-span with τ_span = 1). Score = span length."""
    name = "always"

    def _decide(self, x: RouteInput) -> tuple[bool, float]:
        return True, float(x.span_len)


class NeverPolicy(RoutingPolicy):
    """Never verify: plain confidence-threshold block diffusion. Score = span length."""
    name = "never"

    def _decide(self, x: RouteInput) -> tuple[bool, float]:
        return False, float(x.span_len)


class MinSpanPolicy(RoutingPolicy):
    """Verify iff |C_t| ≥ τ_span (Alg. 4 "Minimum-Span"). Score = span length."""
    name = "min-span"

    @dataclass
    class Params:
        # Reference default `min_ssd_span_length` = 1 (always verify); the paper uses 2
        # (SDAR-1.7B config A) and 8 (Fast-dLLM v2 config C), B/2 and B as examples (§4.3).
        min_span: int = param(1, "τ_span: verify when the first masked span has at least this many slots")

    @staticmethod
    def validate(p) -> None:
        if p.min_span < 1:
            raise BadInput(f"min-span min_span must be >= 1, got {p.min_span}")

    def _decide(self, x: RouteInput) -> tuple[bool, float]:
        return x.span_len >= self.params.min_span, float(x.span_len)


@dataclass
class _ScoreParams:
    """The score s shared by `score` and `hysteresis` (paper Eq. 5–6)."""
    # Reference default "difference_dynamic"; the paper's SDAR-8B config A (its headline setting) is
    # static, hysteresis is dynamic (Table 9).
    mode: str = param("static", "static: s = K̂ − c; dynamic: s = K̂ − c·N_hi", choices=MODES)
    # Reference default `score_penalty_coef` = 2.0; the paper uses c = 1 for SDAR-8B config A and every
    # hysteresis run (Tables 7–9 sweep 1, 2, 4).
    c: float = param(1.0, "c, the verifier cost")
    # "entropy" in all of the paper's main experiments (App. A.5; reference default is hard_margin_threshold).
    estimator: str = param("entropy", "α estimator: how likely a draft is accepted", choices=ESTIMATORS)
    beta: float = param(1.0, "β of exp(−β·H̃): paper main experiments, reference default")
    margin: float = param(0.05, "τ_margin: reference default, paper Table 8")
    margin_coef: float = param(1.0, "soft-margin coefficient: reference default")
    entropy_threshold: float = param(0.1, "τ_ent of hard-entropy: reference CLI default (function: 0.5)")


def _validate_score(name: str, p) -> None:
    p.mode = _MODE_ALIASES.get(p.mode, p.mode)
    p.estimator = _ESTIMATOR_ALIASES.get(p.estimator, p.estimator)
    if p.mode not in MODES:
        raise BadInput(f"{name} mode must be one of {', '.join(MODES)}, got {p.mode!r}")
    if p.estimator not in ESTIMATORS:
        raise BadInput(f"{name} estimator must be one of {', '.join(ESTIMATORS)}, got {p.estimator!r}")
    if p.c < 0:
        raise BadInput(f"{name} c must be >= 0, got {p.c}")
    if p.beta < 0:
        raise BadInput(f"{name} beta must be >= 0, got {p.beta}")
    if not 0.0 <= p.margin <= 1.0:
        raise BadInput(f"{name} margin must be in [0, 1], got {p.margin}")
    if p.margin_coef <= 0:
        raise BadInput(f"{name} margin_coef must be > 0, got {p.margin_coef}")
    if not 0.0 < p.entropy_threshold <= 1.0:
        raise BadInput(f"{name} entropy_threshold must be in (0, 1], got {p.entropy_threshold}")


def verify_score(x: RouteInput, p) -> float:
    """s for a non-empty span (paper Eq. 6) with the parameters `p` of a score-based policy."""
    if x.probs is None:
        raise ValueError("score-based routing needs the drafter distributions (RouteInput.probs)")
    if x.probs.dim() != 2 or x.probs.shape[0] != x.span_len:
        raise ValueError(f"RouteInput.probs must be [span_len={x.span_len}, V], got {tuple(x.probs.shape)}")
    alpha = acceptance_probs(x.probs, p.estimator, beta=p.beta, margin=p.margin, margin_coef=p.margin_coef,
                             entropy_threshold=p.entropy_threshold, vocab_size=x.vocab_size)
    k_hat = expected_accepted(alpha)
    if p.mode == "static":
        return k_hat - p.c
    if x.n_hi is None:
        raise ValueError("the dynamic score needs RouteInput.n_hi (masked positions with confidence > τ)")
    return k_hat - p.c * x.n_hi


class ScorePolicy(RoutingPolicy):
    """Verify iff s ≥ τ_score (Alg. 4 "Score-Threshold"; the reference skips iff s < τ: the same)."""
    name = "score"

    @dataclass
    class Params(_ScoreParams):
        # 0 in the paper's SDAR-8B config A (with static, c = 1: verify iff K̂ ≥ 1) and the reference
        # CLI default (function default −1).
        threshold: float = param(0.0, "τ_score: verify when the score s reaches it")

    @staticmethod
    def validate(p) -> None:
        _validate_score("score", p)

    def _decide(self, x: RouteInput) -> tuple[bool, float]:
        s = verify_score(x, self.params)
        return s >= self.params.threshold, s


class HysteresisPolicy(RoutingPolicy):
    """Two thresholds (Alg. 4 "Hysteresis"): ON and s < τ_off → OFF; OFF and s ≥ τ_on → ON; in
    between the state holds. Verify iff ON. Starts OFF; the state lives for the whole generation
    (across blocks), as in the reference."""
    name = "hysteresis"

    @dataclass
    class Params(_ScoreParams):
        # dynamic score, c = 1: paper Table 9 ("dynamic score only, fixed c = 1") and Fast-dLLM v2
        # configs A/B.
        mode: str = param("dynamic", "static: s = K̂ − c; dynamic: s = K̂ − c·N_hi", choices=MODES)
        # τ_on = 1, τ_off = −5: paper Fast-dLLM v2 configs A/B (§5). Reference defaults are 0 / −1.
        on: float = param(1.0, "τ_on: turn verification on when s ≥ τ_on")
        off: float = param(-5.0, "τ_off: turn verification off when s < τ_off")
        # the reference code turns ON only when s > τ_on (its comment: "in paper it is >=, but we
        # used > in experiments"); the paper's "≥" is the default.
        strict_on: bool = param(False, "turn on only when s > τ_on (the reference code), not s ≥ τ_on")

    @staticmethod
    def validate(p) -> None:
        _validate_score("hysteresis", p)
        if not p.on > p.off:   # the reference requires τ_on > τ_off
            raise BadInput(f"hysteresis needs on > off, got on={p.on}, off={p.off}")

    def reset(self) -> None:
        self.is_on = False

    def update(self, s: float) -> bool:
        """Advance the ON/OFF state with score s; returns the new state (= verify?)."""
        p = self.params
        if self.is_on:
            self.is_on = not s < p.off
        else:
            self.is_on = s > p.on if p.strict_on else s >= p.on
        return self.is_on

    def _on_empty_span(self) -> None:
        self.update(-math.inf)

    def _decide(self, x: RouteInput) -> tuple[bool, float]:
        s = verify_score(x, self.params)
        return self.update(s), s


class UCBPolicy(RoutingPolicy):
    """Contextual UCB bandit over {0 = skip, 1 = verify} (paper App. A.6, Eq. 16–18):
      bucket b = (span-length bin, block-progress bin, entropy bin), linear bins: span on [1, B],
        progress = decoded/B on [0, 1], mean normalized entropy of the span's distributions on [0, 1]
        (0 when probs is None); bin = min(n−1, int(ratio·n)).
      index_a = +inf if n_{a,b} = 0 else μ̂_{a,b} + β·sqrt(ln t / n_{a,b}),  t = decisions so far (from 1).
      verify iff index_1 ≥ index_0 (ties to verify: an unseen bucket explores verify, then skip).
      reward r = accepted / cost, cost = 2 if verified else 1 (Eq. 18), given through `feedback`.
    Deterministic. Statistics live for the whole generation (reset()), not per block.
    Score = index_1 − index_0 (±inf while an arm of the bucket is unexplored)."""
    name = "ucb"

    @dataclass
    class Params:
        beta: float = param(1.0, "β of Eq. 16: reference default `ucb_beta` (Table 10 sweeps 0.2–5)")
        # "By default, we use two bins for each dimension" (A.6); reference `ucb_span_length_bins`,
        # `ucb_block_progress_bins`, `ucb_entropy_bins` = 2
        span_bins: int = param(2, "bins of the span length")
        progress_bins: int = param(2, "bins of the block progress")
        entropy_bins: int = param(2, "bins of the span's mean normalized entropy")

    @staticmethod
    def validate(p) -> None:
        if p.beta < 0:
            raise BadInput(f"ucb beta must be >= 0, got {p.beta}")
        for f in ("span_bins", "progress_bins", "entropy_bins"):
            if getattr(p, f) < 1:
                raise BadInput(f"ucb {f} must be >= 1, got {getattr(p, f)}")

    def reset(self) -> None:
        n = self.n_buckets
        self.count = [[0] * n, [0] * n]          # [action][bucket]
        self.reward_sum = [[0.0] * n, [0.0] * n]
        self.t = 0
        self.pending: int | None = None          # bucket of the last decision awaiting feedback

    @property
    def n_buckets(self) -> int:
        p = self.params
        return p.span_bins * p.progress_bins * p.entropy_bins

    @staticmethod
    def _bin(value: float, lo: float, hi: float, n: int) -> int:
        if n <= 1 or hi <= lo:
            return 0
        ratio = (min(max(value, lo), hi) - lo) / (hi - lo)
        return min(n - 1, max(0, int(ratio * n)))

    def bucket(self, x: RouteInput) -> int:
        p = self.params
        span_bin = self._bin(float(max(1, x.span_len)), 1.0, float(max(1, x.block_size)), p.span_bins)
        progress = (x.block_size - x.n_masked) / max(1, x.block_size)
        prog_bin = self._bin(progress, 0.0, 1.0, p.progress_bins)
        ent = 0.0
        if x.probs is not None and x.probs.numel() > 0:
            ent = float(normalized_entropy(x.probs, x.vocab_size).mean())
        ent_bin = self._bin(ent, 0.0, 1.0, p.entropy_bins)
        return (span_bin * p.progress_bins + prog_bin) * p.entropy_bins + ent_bin

    def index(self, action: int, b: int) -> float:
        n = self.count[action][b]
        if n == 0:
            return math.inf
        log_t = math.log(max(1, self.t))
        return self.reward_sum[action][b] / n + self.params.beta * math.sqrt(log_t / n)

    def _decide(self, x: RouteInput) -> tuple[bool, float]:
        self.t += 1
        b = self.bucket(x)
        skip, verify = self.index(0, b), self.index(1, b)
        self.pending = b
        if math.isinf(verify):
            score = math.inf
        elif math.isinf(skip):
            score = -math.inf
        else:
            score = verify - skip
        return verify >= skip, score

    def feedback(self, accepted: int, verified: int | bool, cost: float | None = None) -> None:
        if self.pending is None:
            return
        action = 1 if verified else 0
        if cost is None:
            cost = 2.0 if verified else 1.0
        if cost <= 0:
            raise ValueError(f"feedback cost must be > 0, got {cost}")
        self.count[action][self.pending] += 1
        self.reward_sum[action][self.pending] += float(accepted) / cost
        self.pending = None


# -- registry -------------------------------------------------------------------------------------
_CLASSES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (AlwaysPolicy, NeverPolicy, MinSpanPolicy, ScorePolicy, HysteresisPolicy, UCBPolicy)}
POLICIES: tuple[str, ...] = tuple(_CLASSES)
ALIASES: dict[str, str] = {   # the reference code's `do_verify_policy` names
    "mask_span_length": "min-span", "score_threshold": "score",
    "score_hysteresis": "hysteresis", "contextual_bandit_ucb": "ucb",
}


def make_policy(name: str, **params) -> RoutingPolicy:
    """A fresh policy (fresh state) by name (canonical or reference alias); BadInput on unknown
    names, unknown parameters, wrong types or out-of-range values."""
    cls = _CLASSES.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if cls is None:
        raise BadInput(f"unknown routing policy {name!r} (available: {', '.join(POLICIES)})")
    return cls(params)


__all__ = ["RouteInput", "RoutingPolicy", "POLICIES", "ALIASES", "ESTIMATORS", "MODES", "make_policy",
           "acceptance_probs", "expected_accepted", "normalized_entropy", "margins", "verify_score",
           "AlwaysPolicy", "NeverPolicy", "MinSpanPolicy", "ScorePolicy", "HysteresisPolicy", "UCBPolicy"]

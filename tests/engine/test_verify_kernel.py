"""The fused Triton verify kernel (studio.engine.kernels) against its torch oracle, `verify_chain_with_noise`:
the same logits, uniforms and Gumbel noise must give the same accepted count, correction and correction source.

Without CUDA the kernel runs in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when a kernel is defined,
so it is set before the kernel module is imported. The interpreter is slow: vocabularies stay small, chains short.
"""
import os
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from studio.engine import kernels  # noqa: E402
from studio.engine.kernels import verify  # noqa: E402
from studio.engine.kernels.verify import verify_chain_fused, verify_rows  # noqa: E402
from studio.engine.sampling import (  # noqa: E402
    ChainResult,
    Proposal,
    SamplingParams,
    gumbel_noise,
    process_logits,
    sample,
    verify_chain,
    verify_chain_with_noise,
)
from studio.errors import BadInput  # noqa: E402

DEVICE = "cpu" if kernels.interpreting() else "cuda"
# The interpreter computes with numpy, which warns about IEEE results the kernel relies on (log(0) = -inf for
# tokens outside a support) or discards (inf - inf in rows it flags as unusable).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

SAMPLED, DETERMINISTIC = Proposal.SAMPLED, Proposal.DETERMINISTIC
VOCABS = (17, 64, 300)


@dataclass
class Case:
    drafts: list[int]
    target: torch.Tensor              # [k, V] raw logits
    draft: torch.Tensor               # [k, V] raw logits of the drafter
    proposal: Proposal
    params: SamplingParams
    uniforms: torch.Tensor
    gumbel: torch.Tensor
    rule: dict                        # tau / reference / gamma


def make_case(seed: int, vocab: int, k: int, params: SamplingParams, proposal: Proposal, closeness: float = 0.7,
              random_drafts: bool = False, masked: bool = False, dtype: torch.dtype = torch.float32, **rule) -> Case:
    """Random logits with a drafter `closeness` away from the target (small: long accepted runs). Drafts are drawn
    from q when sampled, else the drafter's argmax, or uniformly random tokens (often outside top-k/top-p)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(k, vocab, generator=g) * 2
    draft = target + closeness * torch.randn(k, vocab, generator=g)
    target, draft = target.to(dtype), draft.to(dtype)
    if masked:          # a third of the vocabulary masked out, as a model's logits processor may do
        hidden = torch.rand(k, vocab, generator=g) < 0.33
        target, draft = target.masked_fill(hidden, float("-inf")), draft.masked_fill(hidden, float("-inf"))
    if proposal is SAMPLED and not params.greedy:
        drafts = sample(process_logits(draft, params), g).tolist()
    elif random_drafts:
        drafts = torch.randint(0, vocab, (k,), generator=g).tolist()
    else:
        drafts = draft.argmax(-1).tolist()
    uniforms = torch.rand(k, generator=g)
    return Case(drafts, target, draft, proposal, params, uniforms, gumbel_noise((k, vocab), g), rule)


def oracle(c: Case) -> ChainResult:
    p, q = process_logits(c.target, c.params), process_logits(c.draft, c.params)
    return verify_chain_with_noise(c.drafts, p, q, c.proposal, c.params, c.uniforms, c.gumbel, **c.rule)


def fused(c: Case, device: str = DEVICE) -> ChainResult:
    return verify_chain_fused(c.drafts, c.target.to(device), c.draft.to(device), c.proposal, c.params,
                              c.uniforms.to(device), c.gumbel.to(device), **c.rule)


def assert_same(got: ChainResult, want: ChainResult, what: str) -> None:
    decision = (got.n_accepted, got.correction, got.resampled_from)
    assert decision == (want.n_accepted, want.correction, want.resampled_from), what
    assert got.p_draft == pytest.approx(want.p_draft, rel=1e-5, abs=1e-12), what
    assert got.q_draft == pytest.approx(want.q_draft, rel=1e-5, abs=1e-12), what


def check_cases(cases: list[tuple[str, Case]]) -> set[int]:
    """Every case agrees with the oracle; returns the outcomes seen: the rejected position, or -1 (all accepted)."""
    outcomes = set()
    for what, c in cases:
        want = oracle(c)
        assert_same(fused(c), want, what)
        outcomes.add(want.n_accepted if want.n_accepted < len(c.drafts) else -1)
    return outcomes


# ----------------------------------------------------------------------------------------------------------------
# The oracle's own randomness: uniforms and Gumbel-max corrections commit tokens distributed as p
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("proposal", [SAMPLED, DETERMINISTIC])
def test_noise_oracle_commits_p(proposal):
    p = torch.tensor([[0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02]])
    q = torch.tensor([[0.05, 0.10, 0.40, 0.05, 0.15, 0.05, 0.10, 0.10]])
    n, g = 20_000, torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g) if proposal is SAMPLED else [2] * n
    uniforms, noise = torch.rand(n, generator=g), gumbel_noise((n, 8), g)
    committed = []
    for i in range(n):
        res = verify_chain_with_noise([int(drafts[i])], p, q, proposal, SamplingParams(temperature=1.0),
                                      uniforms[i:], noise[i:])
        committed.append(int(drafts[i]) if res.n_accepted else res.correction)
    counts = torch.bincount(torch.tensor(committed), minlength=8).double().numpy()
    expected = [(dist[0].double() / dist[0].double().sum() * n).numpy() for dist in (p, q)]
    assert chisquare(counts, expected[0]).pvalue > 0.01
    assert chisquare(counts, expected[1]).pvalue < 1e-6                  # the test tells p from q


# ----------------------------------------------------------------------------------------------------------------
# Kernel == oracle on random cases
# ----------------------------------------------------------------------------------------------------------------

def test_greedy_matches_oracle():
    cases = []
    for seed in range(45):
        vocab, k = VOCABS[seed % 3], 1 + seed % 7
        proposal = SAMPLED if seed % 2 else DETERMINISTIC      # sampled: q(d) is reported, from q's argmax
        c = make_case(seed, vocab, k, SamplingParams(), proposal, closeness=0.5, random_drafts=seed % 4 == 1,
                      masked=seed % 5 == 0)
        cases.append((f"seed={seed} V={vocab} k={k} {proposal.name}", c))
    outcomes = check_cases(cases)
    assert {0, -1} <= outcomes and len(outcomes) >= 4          # rejections at varied depths, and full accepts


RULES = {
    "sampled T=1": (SamplingParams(temperature=1.0), SAMPLED, {}),
    "sampled T=0.6": (SamplingParams(temperature=0.6), SAMPLED, {}),
    "sampled tau=0.3": (SamplingParams(temperature=1.0), SAMPLED, dict(tau=0.3)),
    "sampled gamma=0.5": (SamplingParams(temperature=0.9), SAMPLED, dict(gamma=0.5)),
    "deterministic T=1": (SamplingParams(temperature=1.0), DETERMINISTIC, {}),
    "deterministic T=1.5 tau=0.2": (SamplingParams(temperature=1.5), DETERMINISTIC, dict(tau=0.2)),
    "reference T=0.8": (SamplingParams(temperature=0.8), DETERMINISTIC, dict(reference=True)),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_temperature_rules_match_oracle(rule):
    params, proposal, extra = RULES[rule]
    cases = []
    for seed in range(12):
        vocab, k = VOCABS[seed % 3], 2 + seed % 6
        c = make_case(100 + seed, vocab, k, params, proposal, random_drafts=seed % 4 == 3, masked=seed % 6 == 5,
                      **extra)
        cases.append((f"{rule} seed={seed} V={vocab} k={k}", c))
    outcomes = check_cases(cases)
    assert 0 in outcomes and len(outcomes) >= 2


TRUNCATIONS = {
    "top-k 5": SamplingParams(temperature=0.8, top_k=5),
    "top-p 0.8": SamplingParams(temperature=1.2, top_p=0.8),
    "top-k 12 top-p 0.9": SamplingParams(temperature=1.0, top_k=12, top_p=0.9),
}


@pytest.mark.parametrize("proposal", [SAMPLED, DETERMINISTIC])
@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_top_k_top_p_match_oracle(name, proposal):
    cases = []
    for seed in range(4):
        vocab, k = VOCABS[seed % 3], 1 + seed % 3
        c = make_case(200 + seed, vocab, k, TRUNCATIONS[name], proposal, random_drafts=seed % 2 == 1,
                      masked=seed == 2)
        cases.append((f"{name} {proposal.name} seed={seed} V={vocab} k={k}", c))
    check_cases(cases)


# ----------------------------------------------------------------------------------------------------------------
# Ties, empty residuals, bad logits: the exact edges of process_logits / verify_chain
# ----------------------------------------------------------------------------------------------------------------

def kept_prefix(row: list[float], params: SamplingParams, drafts: list[int]) -> Case:
    """A chain verifying `drafts` against one repeated logits row with every uniform 0: a deterministic draft is
    then accepted iff it is kept by top-k/top-p, so the accepted count is the number of leading drafts kept."""
    k, target = len(drafts), torch.tensor([row] * len(drafts))
    g = torch.Generator().manual_seed(0)
    return Case(drafts, target, target, DETERMINISTIC, params, torch.zeros(k), gumbel_noise((k, len(row)), g), {})


TIED = [3.0, 1.0, 3.0, 2.0, 3.0, 3.0, 0.0, 2.0, -1.0]             # x = 3 at tokens 0, 2, 4, 5; x = 2 at 3, 7
TIED_AT_TOP = [1.0, -2.0, 1.0, -2.0, 1.0, -3.0, -4.0, -3.0, -9.0]  # at T = 0.5 tokens 0, 2, 4 hold 1/3 each


@pytest.mark.parametrize("row, params, drafts, n_kept", [
    (TIED, SamplingParams(temperature=1.0, top_k=3), [0, 2, 4, 5], 3),
    (TIED, SamplingParams(temperature=1.0, top_k=5), [0, 2, 4, 5, 3, 7, 1], 5),
    (TIED_AT_TOP, SamplingParams(temperature=0.5, top_p=0.5), [0, 2, 4, 5], 2),      # 0 + 1/3 < 0.5 <= 2/3
    (TIED, SamplingParams(temperature=1.0, top_k=3, top_p=0.7), [0, 2, 4, 5], 3),
])
def test_ties_keep_lower_indices_first(row, params, drafts, n_kept):
    c = kept_prefix(row, params, drafts)
    got, want = fused(c), oracle(c)
    assert want.n_accepted == n_kept
    assert_same(got, want, str(params))


@pytest.mark.parametrize("params, drafts, n_kept", [
    (SamplingParams(), [250], 0),                                      # greedy: 70 beats the later ties
    (SamplingParams(temperature=1.0, top_k=2), [130, 250], 1),
    (SamplingParams(temperature=1.0, top_k=4), [250, 10, 200], 2),
    (SamplingParams(temperature=0.5, top_p=0.5), [130, 250], 1),
])
def test_rows_read_in_several_blocks(monkeypatch, params, drafts, n_kept):
    """What is carried from block to block: the running max and argmax, tie ranks, masses, Gumbel-max winners."""
    monkeypatch.setattr(verify, "MAX_BLOCK", 64)
    row = torch.full((300,), -1.0)
    row[[70, 130, 250]], row[[10, 200]] = 3.0, 2.0                     # ties in different blocks
    c = kept_prefix(row.tolist(), params, drafts)
    want = oracle(c)
    assert want.n_accepted == n_kept and (not params.greedy or want.correction == 70)
    assert_same(fused(c), want, str(params))
    c = make_case(500, 300, 2, params, SAMPLED, closeness=0.5)
    assert_same(fused(c), oracle(c), f"{params}, random logits")


def test_greedy_ties_go_to_the_lowest_index():
    target = torch.tensor([[0.0, 4.0, 1.0, 4.0], [2.0, 2.0, 2.0, -1.0]])
    target = target.to(DEVICE)
    res = verify_chain_fused([3, 0], target, None, DETERMINISTIC, SamplingParams(), None, None)
    assert (res.n_accepted, res.correction, res.resampled_from) == (0, 1, "argmax")
    res = verify_chain_fused([1, 0], target, None, DETERMINISTIC, SamplingParams(), None, None)
    assert (res.n_accepted, res.correction, res.p_draft) == (2, None, [1.0, 1.0])


def test_empty_residual_falls_back_to_p():
    # q == p and the draft is outside both supports (top-k): rejected, and max(0, p - q) has no mass
    c = make_case(7, 64, 3, SamplingParams(temperature=1.0, top_k=4), SAMPLED, closeness=0.0)
    c.drafts = [int(torch.argmin(c.target[i])) for i in range(3)]
    want = oracle(c)
    assert (want.n_accepted, want.resampled_from) == (0, "p")
    assert_same(fused(c), want, "q == p")


@pytest.mark.parametrize("where", ["target", "draft"])
@pytest.mark.parametrize("bad, message", [(float("nan"), "NaN"), (float("inf"), r"\+inf"), (None, "all -inf")])
def test_unusable_logits_raise_badinput(where, bad, message):
    c = make_case(3, 17, 2, SamplingParams(temperature=1.0), SAMPLED)
    logits = c.target if where == "target" else c.draft
    if bad is None:
        logits[1] = float("-inf")
    else:
        logits[1, 5] = bad
    with pytest.raises(BadInput, match=message):
        fused(c)


def test_chain_arguments_checked_like_the_oracle():
    c = make_case(4, 17, 2, SamplingParams(temperature=1.0), SAMPLED)
    with pytest.raises(ValueError, match="out of range"):
        verify_chain_fused([1, 17], c.target, c.draft, SAMPLED, c.params, c.uniforms, c.gumbel)
    with pytest.raises(ValueError, match="q is required"):
        verify_chain_fused([1, 2], c.target, None, SAMPLED, c.params, c.uniforms, c.gumbel)
    with pytest.raises(ValueError, match="uniforms and gumbel"):
        verify_chain_fused([1, 2], c.target, c.draft, SAMPLED, c.params, None, None)
    with pytest.raises(ValueError, match="uniforms must be"):
        verify_chain_fused([1, 2], c.target, c.draft, SAMPLED, c.params, c.uniforms, c.gumbel[:1])
    with pytest.raises(BadInput):
        verify_chain_fused([1, 2], c.target, c.draft, SAMPLED, c.params, c.uniforms, c.gumbel, tau=-1.0)
    assert verify_chain_fused([], c.target, c.draft, SAMPLED, c.params, c.uniforms, c.gumbel) == ChainResult(0, None)


def test_device_verdict_holds_the_chain_output():
    """tokens[:n + 1] of the device-side verdict are the accepted drafts and the correction."""
    for seed in range(6):
        c = make_case(300 + seed, 64, 6, SamplingParams(temperature=1.0), SAMPLED, closeness=0.4)
        want = oracle(c)
        verdict = verify_rows(torch.tensor(c.drafts, device=DEVICE), c.target.to(DEVICE), c.draft.to(DEVICE), True,
                              c.params, c.uniforms.to(DEVICE), c.gumbel.to(DEVICE))
        n = int(verdict.n_accepted.item())
        output = c.drafts[:n] + ([want.correction] if want.correction is not None else [])
        assert n == want.n_accepted and verdict.tokens[:n + 1].tolist() == output


# ----------------------------------------------------------------------------------------------------------------
# The dispatcher
# ----------------------------------------------------------------------------------------------------------------

def test_verify_logits_fused_draws_its_noise_from_the_generator():
    assert kernels.available()
    c = make_case(11, 64, 5, SamplingParams(temperature=1.0, top_k=20), SAMPLED, closeness=0.4)
    target = c.target.to(DEVICE)
    assert kernels.runs_fused(target)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    got = kernels.verify_logits(c.drafts, target, c.draft.to(DEVICE), SAMPLED, c.params, gen)
    replay = torch.Generator(device=DEVICE).manual_seed(5)
    c.uniforms, c.gumbel = torch.rand(5, generator=replay, device=DEVICE).cpu(), gumbel_noise((5, 64), replay).cpu()
    assert_same(got, oracle(c), "dispatched")


def test_verify_logits_without_the_kernel_is_verify_chain(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")              # CPU tensors, no interpreter: the torch rules
    c = make_case(12, 64, 5, SamplingParams(temperature=1.0, top_p=0.9), SAMPLED, closeness=0.4)
    assert not kernels.runs_fused(c.target)
    got = kernels.verify_logits(c.drafts, c.target, c.draft, SAMPLED, c.params, torch.Generator().manual_seed(5))
    p, q = process_logits(c.target, c.params), process_logits(c.draft, c.params)
    assert got == verify_chain(c.drafts, p, q, SAMPLED, c.params, torch.Generator().manual_seed(5))


# ----------------------------------------------------------------------------------------------------------------
# Runs: strategies hand their logits to DecodeContext.verify, which takes the kernel where it runs
# ----------------------------------------------------------------------------------------------------------------

RUN_PROMPT = [1, 2, 3, 4]
# jacobi-mr on a model whose output cycles, so recycled n-gram chains win and their verify rows are checked
FUSED_STRATEGIES = [("isd", {"stride": 4}), ("isd", {"stride": 3, "proposal": "sample"}), ("jacobi", {}),
                    ("jacobi-mr", {"block_size": 3, "blocks": 3, "spawn_ratio": 0.34, "pool_size": 8})]


def _engine_for(name):
    from tests.strategies.test_jacobi import cycling_engine
    from tests.support.tiny import tiny_engine
    return cycling_engine() if name == "jacobi-mr" else tiny_engine("llama", vocab=24, seed=5)


def _run(engine, name, params, n, sampling=SamplingParams(), seed=0):
    from studio.engine.strategies import make_strategy
    from studio.run.session import Settings, run_to_end
    return run_to_end(engine, make_strategy(name, params), Settings(n, sampling=sampling, seed=seed), "", RUN_PROMPT)


@pytest.fixture
def fused_runs(monkeypatch):
    """Runs verify through the kernel (here: the interpreter on CPU logits); returns the list of kernel calls."""
    from studio.engine.kernels import verify as verify_module
    calls = []
    real = verify_module.verify_chain_fused

    def counted(*args, **kw):
        calls.append(len(args[0]))
        return real(*args, **kw)

    monkeypatch.setattr(kernels, "engine_verifies_fused", lambda logits: True)
    monkeypatch.setattr(verify_module, "verify_chain_fused", counted)
    return calls


@pytest.mark.parametrize("name, params", FUSED_STRATEGIES, ids=lambda x: x if isinstance(x, str) else "")
def test_strategies_hand_the_logits_their_p_and_q_come_from(monkeypatch, name, params):
    """The contract of `DecodeContext.verify(logits=...)`: process_logits of the rows handed over is p (and q),
    so the kernel decides on the distributions the torch rules would. Checked on every verify of sampled runs
    (top-k and top-p on: a row mix-up changes the support) without the kernel."""
    from studio.engine.strategies.base import DecodeContext
    checked = []
    real = DecodeContext.verify

    def checking(self, pos, drafts, p, q, proposal, sampling=None, logits=None, **rule):
        assert logits is not None, f"{name} verifies without handing its logits"
        k, used = len(drafts), sampling or self.sampling
        torch.testing.assert_close(process_logits(logits[0][:k], used), p[:k], rtol=0, atol=0)
        if logits[1] is None:
            assert q is None
        else:
            torch.testing.assert_close(process_logits(logits[1][:k], used), q[:k], rtol=0, atol=0)
        checked.append(k)
        return real(self, pos, drafts, p, q, proposal, sampling, logits, **rule)

    monkeypatch.setattr(DecodeContext, "verify", checking)
    engine = _engine_for(name)
    for seed in range(3):
        _run(engine, name, params, 24, SamplingParams(temperature=1.0, top_k=12, top_p=0.9), seed=seed)
    assert sum(checked) > 0


@pytest.mark.parametrize("name, params", FUSED_STRATEGIES, ids=lambda x: x if isinstance(x, str) else "")
def test_greedy_runs_through_the_kernel_equal_the_torch_path(fused_runs, name, params):
    from tests.strategies.test_jacobi import ngram_accepted
    engine = _engine_for(name)
    fused = _run(engine, name, params, 24)
    assert fused_runs, "the kernel was never called"
    kernels_called = list(fused_runs)
    kernels.engine_verifies_fused = lambda logits: False       # undone by monkeypatch with the fixture
    torch_path = _run(engine, name, params, 24)
    assert fused.token_ids == torch_path.token_ids
    assert fused_runs == kernels_called
    assert fused.footer["forwards"] == torch_path.footer["forwards"]
    if name == "jacobi-mr":
        assert ngram_accepted(fused) > 0


def test_sampled_isd_through_the_kernel_keeps_the_ar_law(fused_runs):
    """Sampled ISD verified by the kernel: the law of the first two tokens is the AR law (the second one is
    committed by the kernel's accept or residual draw). Fixed drafting: a cost-aware plan drafts nothing in a
    2-token run (the draft could only replace the round's own token)."""
    from tests.support.exact import assert_law, chi_square_pvalue, exact_sequence_law
    from tests.support.tiny import tiny_engine
    engine = tiny_engine("llama", vocab=6, seed=11, dim=16, layers=1)
    law = exact_sequence_law(engine.model, RUN_PROMPT, 2, SamplingParams(temperature=1.0))
    params = {"stride": 3, "proposal": "sample", "drafting": "fixed"}

    def pvalue(seeds: range) -> float:
        samples = [tuple(_run(engine, "isd", params, 2, SamplingParams(temperature=1.0), seed=seed).token_ids)
                   for seed in seeds]
        return chi_square_pvalue(samples, law)

    assert_law(pvalue, 600)
    assert len(fused_runs) >= 600


# ----------------------------------------------------------------------------------------------------------------
# GPU: the compiled kernel at a real vocabulary size
# ----------------------------------------------------------------------------------------------------------------

# bf16 logits, as the GPU engine gives them, except for a nucleus cut deep in the vocabulary: there bf16 makes
# groups of tens of equal logits, and where the cut splits one the kernel may keep one token more or fewer than
# torch (a tie case of the kernel's docstring).
@pytest.mark.parametrize("params, proposal, dtype", [
    (SamplingParams(), DETERMINISTIC, torch.bfloat16),
    (SamplingParams(temperature=1.0), SAMPLED, torch.bfloat16),
    (SamplingParams(temperature=1.0, top_k=50, top_p=0.95), SAMPLED, torch.bfloat16),
    (SamplingParams(temperature=0.7, top_p=0.9), DETERMINISTIC, torch.float32),
], ids=["greedy", "sampled", "top-k-top-p", "top-p-deterministic"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_qwen_vocab_matches_oracle(params, proposal, dtype):
    """7 rows × 151,936 (the Qwen2 vocabulary) compiled on the GPU; the oracle reads the same values on the CPU."""
    for seed in range(3):
        c = make_case(400 + seed, 151_936, 7, params, proposal, closeness=0.3, dtype=dtype)
        assert_same(fused(c, "cuda"), oracle(c), f"seed={seed}")

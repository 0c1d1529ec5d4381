"""ISD: exactness (greedy == AR, sampled law == AR law), events, KV hygiene, bad parameters."""
import pytest
import torch

from studio.engine.sampling import SamplingParams
from studio.engine.strategies import DecodeContext, Output, make_strategy
from studio.engine.strategies.isd import expected_tpf
from studio.errors import BadInput
from studio.run.session import Settings, run_to_end
from tests.support.exact import assert_law, chi_square_pvalue, exact_sequence_law, law_samples
from tests.support.plans import ISD_MIXED, plan_with, planned
from tests.support.tiny import FAMILIES, tiny_engine

PROMPT = [1, 2, 3, 4]


def generate(engine, name, params=None, n=40, temperature=0.0, seed=0, top_k=0, top_p=1.0):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(temperature, top_k, top_p), seed=seed)
    return run_to_end(engine, make_strategy(name, params), s, "", PROMPT)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stride", [2, 4])
@pytest.mark.parametrize("drafting", ["fixed", "auto"])
def test_greedy_isd_equals_greedy_ar(monkeypatch, family, stride, drafting):
    """auto: with costs under which the plan changes along the run (AR steps after rejections, drafts again)."""
    engine = tiny_engine(family, vocab=24, seed=5)
    ar = generate(engine, "ar", n=60)
    plan_with(monkeypatch, ISD_MIXED)
    isd = generate(engine, "isd", {"stride": stride, "drafting": drafting}, n=60)
    assert isd.token_ids == ar.token_ids
    assert isd.footer["forwards"] >= 1
    plans = set(planned(isd))
    assert (0 in plans and len(plans) > 1) if drafting == "auto" else not plans


@pytest.mark.parametrize("drafting", ["fixed", "auto"])
def test_drafts_looked_up_in_the_context_fill_rounds_without_mask_drafts_exactly(drafting):
    """Prompt lookup: a round without MASK-row drafts (after a rejection, or none paid) verifies the tokens that
    followed the context's last tokens where they occurred before (src ngram). On a model that cycles they are
    right, so where its MASK rows (random here) get nowhere the run still commits several tokens a forward, and
    writes exactly ar's tokens; lookup=0 copies none."""
    from tests.strategies.test_jacobi import cycling_engine, ngram_accepted
    engine = cycling_engine()
    ar = generate(engine, "ar", n=60)
    for name in ("isd", "r-isd"):
        on = generate(engine, name, {"drafting": drafting}, n=60)
        off = generate(engine, name, {"drafting": drafting, "lookup": 0}, n=60)
        assert on.token_ids == off.token_ids == ar.token_ids, (name, drafting)
        assert ngram_accepted(on) > 0 and ngram_accepted(off) == 0, (name, drafting)
        assert on.footer["tpf"] > off.footer["tpf"] + 0.5, (name, drafting, on.footer["tpf"], off.footer["tpf"])


def _isd_samples(engine, params, n_samples, length=3, first=0):
    samples = []
    for seed in range(first, first + n_samples):
        r = generate(engine, "isd", params, n=length, temperature=1.0, seed=seed)
        samples.append(tuple(r.token_ids))
    return samples


@pytest.fixture(scope="module")
def law_engine():
    engine = tiny_engine("llama", vocab=6, seed=11, dim=16, layers=1)
    law = exact_sequence_law(engine.model, PROMPT, 3, SamplingParams(temperature=1.0))
    return engine, law


@pytest.mark.parametrize("proposal, drafting", [pytest.param("sample", "fixed", marks=pytest.mark.law),
                                               pytest.param("argmax", "fixed", marks=pytest.mark.law),
                                               ("sample", "auto")])
def test_sampled_isd_matches_the_ar_distribution(monkeypatch, law_engine, proposal, drafting):
    """auto: the draft count of each round depends on the verdicts before it, and the law is still the AR law."""
    engine, law = law_engine
    plan_with(monkeypatch, ISD_MIXED)
    # auto at half the samples: the rule under test is fixed drafting's, the plan only decides how many drafts
    params = {"stride": 3, "proposal": proposal, "drafting": drafting}
    assert_law(lambda seeds: chi_square_pvalue(_isd_samples(engine, params, len(seeds), first=seeds.start), law),
               law_samples(20_000) if drafting == "fixed" else 10_000)
    if drafting == "auto":
        plans = {tuple(planned(generate(engine, "isd", {"stride": 3}, n=3, temperature=1.0, seed=s)))
                 for s in range(50)}
        assert {0, 1} <= {d for p in plans for d in p}


def test_reference_mode_is_biased(law_engine):
    engine, law = law_engine
    samples = _isd_samples(engine, {"stride": 3, "mode": "reference", "drafting": "fixed"}, 4_000)   # p = 0.0 from 2,000 on
    assert chi_square_pvalue(samples, law) < 1e-4


def test_events_tell_the_whole_story():
    engine = tiny_engine("qwen2", vocab=10, seed=2)
    r = generate(engine, "isd", {"stride": 3}, n=30, temperature=1.0, seed=4)
    emitted = [t for e in r.events if e["t"] == "emit" for t in e["tok"]]
    assert emitted == r.token_ids
    assert [p for e in r.events if e["t"] == "emit" for p in e["pos"]] == list(range(len(emitted)))
    kinds = {e["t"] for e in r.events}
    assert {"forward", "propose", "kv", "emit"} <= kinds
    assert kinds & {"accept", "reject"}
    # every verified draft was proposed earlier at the same position with the same token and q
    proposed = {}
    for e in r.events:
        if e["t"] == "propose":
            proposed.update({(p, t): q for p, t, q in zip(e["pos"], e["tok"], e["q"])})
        if e["t"] == "accept":
            for p, t, q in zip(e["pos"], e["tok"], e["q"]):
                assert proposed[(p, t)] == pytest.approx(q)
        if e["t"] == "reject":
            assert proposed[(e["pos"], e["tok"])] == pytest.approx(e["q"])
    fwd = [e for e in r.events if e["t"] == "forward"]
    assert fwd[0]["role"] == "prefill" and fwd[0]["step"] == 0
    assert all(f["n_tokens"] <= 2 * 3 - 1 for f in fwd[1:])
    assert r.footer["forwards"] == len(fwd) - 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_committed_kv_is_exactly_the_clean_tokens(temperature):
    """After ISD, the cache holds prompt + output[:-1] (the last token is pending) and equals a fresh prefill:
    MASK rows and rejected drafts never leak into committed KV."""
    engine = tiny_engine("llama", vocab=12, seed=3)
    strat = make_strategy("isd", {"stride": 3})
    sampling = SamplingParams(temperature)
    out = Output(engine.tokenizer, 25, frozenset())
    ctx = DecodeContext(engine.model, engine.tokenizer, sampling, 7, out, engine.config.mask_token_id, 64)
    strat.start(ctx, PROMPT)
    while not out.finished:
        strat.step(ctx)
    ids = PROMPT + out.token_ids
    # the strategy may have stopped mid-round; roll back to a length every path has committed
    n = min(ctx.kv.length, len(ids) - 1)
    fresh = engine.model.new_cache(64)
    with torch.inference_mode():
        engine.model(torch.tensor(ids[:n]), torch.arange(n), fresh)
    assert ctx.kv.length >= len(ids) - 2 * 3
    assert torch.allclose(ctx.kv.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(ctx.kv.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-5)


def test_stop_on_eos_and_stop_string():
    engine = tiny_engine("llama", vocab=10, seed=1)
    ref = generate(engine, "isd", {"stride": 3}, n=30)
    eos = ref.token_ids[5]
    first = ref.token_ids.index(eos)
    eng_eos = tiny_engine("llama", vocab=10, seed=1, eos_ids=[eos])
    r = generate(eng_eos, "isd", {"stride": 3}, n=30)
    assert r.token_ids == ref.token_ids[:first + 1] and r.footer["stop_reason"] == "eos"
    stop = ref.footer["text"][3:5]
    s = Settings(max_new_tokens=30, stop=(stop,))
    r2 = run_to_end(engine, make_strategy("isd", {"stride": 3}), s, "", PROMPT)
    assert r2.footer["stop_reason"] == "stop_string"
    assert r2.footer["text"] == ref.footer["text"][:ref.footer["text"].index(stop)]


@pytest.mark.parametrize("params, message", [
    ({"stride": 1}, "stride"), ({"proposal": "beam"}, "proposal"), ({"tau": -1.0}, "tau"),
    ({"mode": "fast"}, "mode"), ({"strides": 3}, "no parameter"), ({"stride": "4"}, "must be int"),
    ({"drafting": "greedy"}, "drafting"),
])
def test_bad_parameters_are_clear_errors(params, message):
    with pytest.raises(BadInput, match=message):
        make_strategy("isd", params)


def test_unknown_strategy():
    with pytest.raises(BadInput, match="unknown strategy 'beam'"):
        make_strategy("beam")


def test_tpf_formula_limits():
    assert expected_tpf(0.0, 4) == pytest.approx(1.0)
    assert expected_tpf(1.0, 4) == pytest.approx(4.0)
    assert expected_tpf(0.5, 2) == pytest.approx(2 / 1.5)

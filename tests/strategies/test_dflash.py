"""dflash: a DFlash drafter's block verified by the target. Greedy it is `ar` token for token (a chain and a tree,
three families); sampled it keeps the model's law position by position, with a plan that changes along the run, on
the real path (the drafter's context cache, the target's KV rollback, the tree's pruned rows)."""
import dataclasses

import pytest
import torch

from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.engine.strategies.dflash import DFlash
from studio.errors import BadInput
from studio.run.session import Settings, run_to_end
from tests.strategies.test_default_laws import LENGTH, SAMPLING, conditionals
from tests.support.dflash import tiny_drafter
from tests.support.exact import PositionLaws, assert_law, law_samples
from tests.support.plans import CHAIN_MIXED, plan_with, planned
from tests.support.tiny import FAMILIES, tiny_engine

PROMPT = [1, 2, 3, 4, 1, 2]


def dflash(path, **params):
    s = make_strategy("dflash", params)
    s.use_drafter(str(path))
    return s


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_ar_as_a_chain_and_as_a_tree(tmp_path, family):
    engine = tiny_engine(family, vocab=16, seed=3)
    tiny_drafter(engine, tmp_path / "d", block=5, seed=1)
    settings = Settings(max_new_tokens=40, sampling=SamplingParams(0.0))
    ar = run_to_end(engine, make_strategy("ar"), settings, "", PROMPT)
    assert len(set(ar.token_ids)) > 2
    for params in ({"drafting": "fixed", "lookup": 0}, {"lookup": 0}, {"branches": 3, "drafting": "fixed", "lookup": 0},
                   {"drafting": "fixed"}, {}, {"drafting": "fixed", "lookup": 0, "quant": "none"}):
        r = run_to_end(engine, dflash(tmp_path / "d", **params), settings, "", PROMPT)
        assert r.token_ids == ar.token_ids, params
        proposes = [e for e in r.events if e["t"] == "propose"]
        sources = {e["src"] for e in proposes}
        assert sources == ({"draft_model"} if "lookup" in params else {"draft_model", "ngram"}), params
        drafter_steps = {e["step"] for e in proposes if e["src"] == "draft_model"}
        assert not drafter_steps & {e["step"] for e in proposes if e["src"] == "ngram"}   # a lookup spares the drafter
        verifies = {e["step"] for e in r.events if e["t"] == "forward" and e["role"] == "verify"}
        assert {e["step"] for e in proposes} == verifies   # each proposal in the step of the forward verifying it
        if params.get("branches"):
            assert any(len(set(e["pos"])) < len(e["pos"]) for e in proposes)   # siblings share a position
        if params.get("drafting") == "fixed":
            verifies = [e for e in r.events if e["t"] == "forward" and e["role"] == "verify"]
            assert verifies and max(e["n_tokens"] for e in verifies) >= 5   # (a trained drafter's accepts:
            # tests/train/test_dflash_train.py)


@pytest.mark.parametrize("vocab", [None, [0, 1, 2, 4, 6, 9, 12]], ids=["whole head", "a draft vocabulary"])
def test_the_int8_drafter_drafts_close_to_its_float_twin(tmp_path, vocab):
    """On the CPU in fp32 the drafter runs in int8 unless `quant=none`: its layers and head rows in one byte with a
    scale per row. Its draft logits are the float drafter's within int8 rounding, over the same draft vocabulary; the
    runs above and the sampled law test run it, so exactness holds on that path."""
    engine = tiny_engine("llama", vocab=16, seed=3)
    tiny_drafter(engine, tmp_path / "d", block=5, seed=1, vocab=vocab)
    strategies = {quant: dflash(tmp_path / "d", quant=quant) for quant in ("auto", "none")}
    for s in strategies.values():
        s.ready(engine)
    int8, float32 = strategies["auto"], strategies["none"]
    assert int8.drafter.fc.weight.dtype == torch.int8 and float32.drafter.fc.weight.dtype == torch.float32
    assert int8.header_params()["quant"] == "int8" and float32.header_params()["quant"] == "none"   # what ran
    width = len(float32.drafter.config.taps) * engine.config.dim
    taps = torch.randn(1, 12, width, generator=torch.Generator().manual_seed(0))   # 12 context rows
    f, q = (s._draft_logits(engine.model, taps, 3, 4, s.drafter.new_cache(32)) for s in (float32, int8))
    assert torch.equal(f.isinf(), q.isinf()) and f.isinf().any() == (vocab is not None)
    seen = f.isfinite()
    err = (f[seen] - q[seen]).abs().max()
    assert 0 < err < 0.03 * f[seen].abs().max(), (err, f[seen].abs().max())


def test_a_lookup_that_does_not_pay_leaves_the_step_to_the_drafter(monkeypatch, tmp_path):
    """The context repeats (the prompt does), so lookup finds candidates; a plan that prices them out leaves the step to
    the drafter, whose plan drafts: every step verifies the drafter's block, none is a plain AR step."""
    engine = tiny_engine("llama", vocab=16, seed=3)
    tiny_drafter(engine, tmp_path / "d", block=5, seed=1)
    settings = Settings(max_new_tokens=24, sampling=SamplingParams(0.0))
    found = []
    look_up = DFlash._look_up
    monkeypatch.setattr(DFlash, "_look_up", lambda self, ctx: found.append(look_up(self, ctx)) or found[-1])
    monkeypatch.setattr(DFlash, "_plan", lambda self, ctx, src, branches, limit=None: 0 if src == "ngram" else 2)
    r = run_to_end(engine, dflash(tmp_path / "d"), settings, "", PROMPT)
    assert r.token_ids == run_to_end(engine, make_strategy("ar"), settings, "", PROMPT).token_ids
    assert any(found)
    roles = [e["role"] for e in r.events if e["t"] == "forward"][1:]
    assert roles and set(roles) == {"verify"}
    assert {e["src"] for e in r.events if e["t"] == "propose"} == {"draft_model"}


@pytest.mark.law
@pytest.mark.parametrize("params,costs,vocab", [({}, CHAIN_MIXED, None), ({"branches": 3}, (1.0,) * 32, None),
                                               ({}, CHAIN_MIXED, [0, 1, 2, 4, 6])],
                         ids=["chain", "tree", "chain, a draft vocabulary"])
def test_sampled_runs_keep_the_model_s_law(monkeypatch, tmp_path, params, costs, vocab):
    """3,000 seeded runs (750 in `make test`) of 8 tokens (top-k and top-p on) against the exact conditionals. The
    chain's drafts are drawn from the drafter's q, under costs that make its plan change along a run; the tree's are
    its top tokens, verified by the multi-draft rule; where the context repeats, looked-up candidates are verified
    instead, as a tree. A drafter whose head reads 5 of the 8 tokens never drafts the other 3, which the target still
    writes as corrections."""
    plan_with(monkeypatch, costs)
    ready = DFlash.ready

    def drafter_free(self, engine):   # a tiny drafter costs what its tiny target does: priced at nothing here, so
        ready(self, engine)           # the chain's plan switches under CHAIN_MIXED as Jacobi's does
        self.price = lambda k: 0.0

    monkeypatch.setattr(DFlash, "ready", drafter_free)
    engine = tiny_engine("llama", seed=11, vocab=8, dim=16, layers=1)
    tiny_drafter(engine, tmp_path / "d", taps=(0,), block=4, seed=2, vocab=vocab)
    n, seen = law_samples(3000), []

    def pvalue(seeds: range) -> float:
        laws, switched, accepted, trees, looked = PositionLaws(LENGTH, 4), 0, 0, 0, 0
        for seed in seeds:
            r = run_to_end(engine, dflash(tmp_path / "d", **params),
                           Settings(max_new_tokens=LENGTH, sampling=SAMPLING, seed=seed), "", PROMPT)
            laws.add(r.token_ids, conditionals(engine.model, PROMPT, r.token_ids))
            switched += len(set(planned(r))) > 1
            accepted += any(e["t"] == "accept" for e in r.events)
            proposes = [e for e in r.events if e["t"] == "propose"]
            trees += any(e["src"] == "draft_model" and len(set(e["pos"])) < len(e["pos"]) for e in proposes)
            looked += any(e["src"] == "ngram" for e in proposes)
        assert laws.impossible == 0
        seen.append((switched, accepted, trees, looked))
        return laws.pvalue()

    assert_law(pvalue, n)
    switched, accepted, trees, looked = seen[0]
    assert switched > n // 10 and accepted > n // 5 and looked > n // 5, (switched, accepted, looked)
    assert trees == (n if params else 0)


def test_a_run_without_a_drafter_or_with_one_for_another_model_is_refused_in_one_line(tmp_path):
    engine = dataclasses.replace(tiny_engine("llama", vocab=16), name="tiny-undrafted")   # nothing shipped for it
    with pytest.raises(BadInput, match="dflash needs a drafter trained for 'tiny-undrafted'"):
        run_to_end(engine, make_strategy("dflash"), Settings(max_new_tokens=4), "", PROMPT)
    tiny_drafter(tiny_engine("llama", vocab=16, dim=64), tmp_path / "wide")
    with pytest.raises(BadInput, match="64 wide"):
        run_to_end(engine, dflash(tmp_path / "wide"), Settings(max_new_tokens=4), "", PROMPT)
    for params, needle in (({"branches": 0}, "branches must be >= 1"), ({"rows": 1}, "rows must be >= 2"),
                           ({"drafting": "x"}, "drafting must be"), ({"quant": "fp8"}, "quant must be one of")):
        with pytest.raises(BadInput, match=needle):
            make_strategy("dflash", params)

"""Every cost-aware lossless strategy in its default drafting mode, on tiny models with cost tables under which its
plan switches along a run: 8 tokens per run, top-k and top-p applied, and the law checked position by position against
the exact conditionals (`PositionLaws`), so a plan that changes mid-run is inside what is tested. The embedded model
in the mode users get (shipped adapters, the machine's table) is `make test-exact` (tests/exact)."""
import math

import pytest
import torch

from studio.engine.lora import attach_adapter
from studio.engine.sampling import SamplingParams, process_logits
from studio.engine.strategies import make_strategy
from studio.run.session import Settings, run_to_end

from tests.support.exact import PositionLaws, assert_law
from tests.support.lora import merged_model, random_adapter
from tests.support.plans import CHAIN_MIXED, ISD_MIXED, plan_with, planned
from tests.support.tiny import tiny_dlm, tiny_engine

LENGTH = 8
SAMPLING = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
PROMPT = [1, 2, 3, 4, 1, 2]
# rows cost what one does: a block cycle pays on a fresh block and, after a refused draft, AR steps do (with the bound
# that holds a cycle back until the answer can absorb its loss lifted: 8 tokens never could)
BLOCK_FLAT = (1.0,) * 16


def risd_engine(tmp_path):
    engine = tiny_engine("llama", seed=11, vocab=8, dim=16, layers=1)
    attach_adapter(engine, random_adapter(tmp_path / "ad", engine.model, seed=11))
    return engine, tiny_engine("llama", seed=11, vocab=8, dim=16, layers=1).model


def ar_engine(tmp_path):
    engine = tiny_engine("llama", seed=11, vocab=8, dim=16, layers=1)
    return engine, engine.model


def block_engine(tmp_path):
    engine = tiny_dlm("llama", True, vocab=8, seed=11, dim=16, layers=1)
    return engine, engine.model


# strategy -> (engine builder, params, costs); the reference is the model the strategy is exact to
CASES = {
    "r-isd": (risd_engine, {"stride": 4}, ISD_MIXED),
    "jacobi": (ar_engine, {"block_size": 3}, CHAIN_MIXED),
    "jacobi-mr": (ar_engine, {"block_size": 3, "blocks": 2}, CHAIN_MIXED),
    "s2d2": (block_engine, {"policy": "always", "cache": "causal", "block_size": 4}, BLOCK_FLAT),
    "simsd": (block_engine, {"cache": "causal", "block_size": 4, "draft_steps": 1}, BLOCK_FLAT),
}
RUNS = 1500


def run(engine, name, params, seed):
    settings = Settings(max_new_tokens=LENGTH, sampling=SAMPLING, seed=seed)
    return run_to_end(engine, make_strategy(name, params), settings, "", PROMPT)


def conditionals(model, prompt, tokens, mask_id=None) -> torch.Tensor:
    """The exact distribution of each token given the prompt and the tokens before it (one causal forward); without
    the MASK token where the strategy never emits it (a block model's block-size-1 law)."""
    ids = prompt + tokens
    with torch.inference_mode():
        logits = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))[0]
    rows = logits[len(prompt) - 1:len(ids) - 1].double().clone()
    if mask_id is not None:
        rows[:, mask_id] = float("-inf")
    return process_logits(rows, SAMPLING)


@pytest.mark.parametrize("name", list(CASES))
def test_a_plan_that_switches_along_the_run_keeps_the_law(monkeypatch, tmp_path, name):
    build, params, costs = CASES[name]
    plan_with(monkeypatch, costs)
    if build is block_engine:
        monkeypatch.setattr("studio.engine.strategies.drafting.RISK_SHARE", math.inf)
    engine, reference = build(tmp_path)
    mask_id = engine.config.mask_token_id if build is block_engine else None
    switched = []

    def pvalue(seeds: range) -> float:
        laws = PositionLaws(LENGTH, 4)
        switched.append(0)
        for seed in seeds:
            r = run(engine, name, params, seed)
            laws.add(r.token_ids, conditionals(reference, PROMPT, r.token_ids, mask_id))
            switched[-1] += len(set(planned(r))) > 1
        return laws.pvalue()

    assert_law(pvalue, RUNS)
    assert switched[0] > RUNS // 10, f"the plan changed along the run in only {switched[0]} of {RUNS} runs"


def test_the_position_laws_see_the_adapters_law(tmp_path):
    """Power: r-isd's adapted twin (isd, the LoRA on its clean rows too) fails the base model's law at the sample
    count above."""
    engine, base = risd_engine(tmp_path)
    laws, adapted = PositionLaws(LENGTH, 4), PositionLaws(LENGTH, 4)
    merged = merged_model(engine.model)
    for seed in range(RUNS):
        r = run(engine, "isd", {"stride": 4, "drafting": "fixed"}, seed)
        laws.add(r.token_ids, conditionals(base, PROMPT, r.token_ids))
        adapted.add(r.token_ids, conditionals(merged, PROMPT, r.token_ids))
    assert adapted.pvalue() > 0.01
    assert laws.pvalue() < 1e-4, laws.statistic()


def test_the_position_laws_see_a_plan_that_reads_its_drafts(monkeypatch, tmp_path):
    """Power against the rule docs/verification.md states: an R-ISD whose plan drops the MASK-row drafts it is about
    to verify unless their first one is its row's likeliest (a plan that reads the draft) is caught, with the same
    engine, on twice the runs."""
    from studio.engine.strategies.isd import ISD
    step = ISD.step

    def peeking(self, ctx):
        if self.drafts and self.q is not None and int(self.q[0].argmax()) != self.drafts[0]:
            self.drafts = []   # not verified: the next round is cold
        step(self, ctx)

    monkeypatch.setattr(ISD, "step", peeking)
    engine, reference = risd_engine(tmp_path)   # on the flat table: a draft every round it can
    params = CASES["r-isd"][1]
    laws = PositionLaws(LENGTH, 4)
    for seed in range(2 * RUNS):   # a subtler leak than an adapter's: twice the runs
        r = run(engine, "r-isd", params, seed)
        laws.add(r.token_ids, conditionals(reference, PROMPT, r.token_ids))
    assert laws.pvalue() < 1e-3, laws.statistic()


def test_a_law_one_batch_of_seeds_rejects_is_judged_on_the_next_and_fails_where_both_reject():
    def batches(*pvalues):
        seen = []

        def pvalue(seeds: range) -> float:
            seen.append(seeds)
            return pvalues[len(seen) - 1]
        return pvalue, seen

    pvalue, seen = batches(0.3)
    assert_law(pvalue, 50)
    assert seen == [range(50)]
    pvalue, seen = batches(0.004, 0.6)
    assert_law(pvalue, 50)
    assert seen == [range(50), range(50, 100)]
    with pytest.raises(AssertionError, match=r"seeds 0-49 \(p=0.004\) and on 50-99 \(p=0.002\)"):
        assert_law(batches(0.004, 0.002)[0], 50)

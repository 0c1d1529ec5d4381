"""lookup-tree: prompt lookup's candidates as a trie verified in one forward. Greedy it is `ar` token for token with
fewer forwards; sampled it keeps the model's law position by position (the real path: the tree forward, the walk,
the accepted path's K/V kept and the rest rolled back); its events carry the tree."""
import pytest

from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.run.session import Settings, run_to_end
from studio.errors import BadInput
from tests.strategies.test_default_laws import LENGTH, SAMPLING, conditionals
from tests.support.exact import PositionLaws, assert_law
from tests.support.tiny import FAMILIES, tiny_engine

PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]   # "1 2" followed by three different tokens: three branches


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_ar_with_fewer_forwards_and_trees_with_siblings(family):
    engine = tiny_engine(family, vocab=16, seed=3)
    settings = Settings(max_new_tokens=48, sampling=SamplingParams(0.0))
    ar = run_to_end(engine, make_strategy("ar"), settings, "", PROMPT)
    tree = run_to_end(engine, make_strategy("lookup-tree"), settings, "", PROMPT)
    assert tree.token_ids == ar.token_ids and len(set(ar.token_ids)) > 2
    forwards = [e for e in tree.events if e["t"] == "forward"]
    assert len(forwards) < len(ar.token_ids)
    proposes = [e for e in tree.events if e["t"] == "propose"]
    assert any(len(set(e["pos"])) < len(e["pos"]) for e in proposes)   # siblings: drafts sharing a position
    verifies = {e["step"] for e in tree.events if e["t"] == "forward" and e["role"] == "verify"}
    assert {e["step"] for e in proposes} == verifies   # each tree in the step of the forward verifying it
    for e in proposes:
        assert all(-1 <= p < i for i, p in enumerate(e["parent"]))
    for e in (e for e in tree.events if e["t"] == "accept"):
        assert e["pos"] == list(range(e["pos"][0], e["pos"][0] + len(e["node"])))


def test_one_branch_is_plain_prompt_lookup_and_a_step_without_a_match_is_an_ar_step():
    engine = tiny_engine("llama", vocab=16, seed=3)
    settings = Settings(max_new_tokens=24, sampling=SamplingParams(0.0))
    ar = run_to_end(engine, make_strategy("ar"), settings, "", [7, 8, 9])
    one = run_to_end(engine, make_strategy("lookup-tree", {"branches": 1, "shortest": 1}), settings, "", [7, 8, 9])
    assert one.token_ids == ar.token_ids
    proposes = [e for e in one.events if e["t"] == "propose"]
    assert proposes and all(e["parent"] == list(range(-1, len(e["pos"]) - 1)) for e in proposes)   # chains
    extends = [e for e in one.events if e["t"] == "forward" and e["role"] == "extend"]
    assert extends and all(e["n_tokens"] == 1 for e in extends)


def test_the_tree_stays_within_its_rows_and_bad_values_are_one_line():
    engine = tiny_engine("llama", vocab=16, seed=3)
    run = run_to_end(engine, make_strategy("lookup-tree", {"rows": 4, "depth": 8}),
                     Settings(max_new_tokens=32, sampling=SamplingParams(0.0)), "", PROMPT)
    assert max(e["n_tokens"] for e in run.events if e["t"] == "forward" and e["role"] != "prefill") <= 4
    for params, needle in (({"branches": 0}, "branches must be >= 1"), ({"rows": 1}, "rows must be >= 2"),
                           ({"shortest": 5}, "shortest must be 1..4")):
        with pytest.raises(BadInput, match=needle):
            make_strategy("lookup-tree", params)


def test_sampled_runs_keep_the_model_s_law_position_by_position():
    """1,500 seeded runs of 8 tokens (top-k and top-p on) against the exact conditionals of the model, the trees'
    pruned K/V rolled back on the real path."""
    engine = tiny_engine("llama", seed=11, vocab=8, dim=16, layers=1)
    trees = []

    def pvalue(seeds: range) -> float:
        laws = PositionLaws(LENGTH, 4)
        trees.append(0)
        for seed in seeds:
            r = run_to_end(engine, make_strategy("lookup-tree", {"shortest": 1}),
                           Settings(max_new_tokens=LENGTH, sampling=SAMPLING, seed=seed), "", PROMPT)
            laws.add(r.token_ids, conditionals(engine.model, PROMPT, r.token_ids))
            trees[-1] += any(e["t"] == "propose" and len(set(e["pos"])) < len(e["pos"]) for e in r.events)
        assert laws.impossible == 0
        return laws.pvalue()

    assert_law(pvalue, 1500)
    assert trees[0] > 750   # most runs verified a tree with siblings

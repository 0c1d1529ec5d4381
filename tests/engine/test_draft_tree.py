"""studio.engine.draft_tree: one forward over a tree gives each node the logits of a causal forward of its own path;
the accepted path's K/V kept in place is that path's causal K/V; the walk commits the target's tokens (greedy) and its
law (sampled, chi-square against the exact distributions)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from studio.engine.draft_tree import DraftTree, verify
from studio.engine.sampling import SamplingParams, process_logits
from tests.support.exact import assert_law, law_samples
from tests.support.tiny import FAMILIES, tiny_model

V = 24
CHAINS = [[3, 5, 7, 9], [3, 5, 8], [3, 6], [4, 4, 4], [11]]   # shared prefixes, a repeated token, a lone leaf


def committed(model, prompt: torch.Tensor):
    kv = model.new_cache(64)
    with torch.inference_mode():
        model(prompt, torch.arange(len(prompt)), kv)
    kv.commit(len(prompt))
    return kv


def test_the_trie_shares_prefixes_and_orders_parents_first():
    tree = DraftTree.from_chains(CHAINS)
    assert tree.tokens == [3, 5, 7, 9, 8, 6, 4, 4, 4, 11]
    assert tree.parents == [-1, 0, 1, 2, 1, 0, -1, 6, 7, -1]
    assert tree.depths() == [1, 2, 3, 4, 3, 2, 1, 2, 3, 1] and tree.path(4) == [0, 1, 4]
    assert all(p < i for i, p in enumerate(tree.parents))
    assert tree.children(-1) == [0, 6, 9]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_forward_over_the_tree_gives_each_node_its_own_path_s_logits(family):
    model = tiny_model(family, vocab=V, seed=2)
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1))
    root = 13
    tree = DraftTree.from_chains(CHAINS)
    kv = committed(model, prompt)
    L = kv.length
    with torch.inference_mode():
        logits = model(torch.tensor([root] + tree.tokens), torch.tensor(tree.positions(L)), kv,
                       mask=tree.attention_mask(L))[0]
    for node in [-1, *range(len(tree))]:
        path = [] if node < 0 else tree.path(node)
        alone = committed(model, prompt)
        tokens = [root] + [tree.tokens[i] for i in path]
        with torch.inference_mode():
            expected = model(torch.tensor(tokens), torch.arange(L, L + len(tokens)), alone)[0, -1]
        torch.testing.assert_close(logits[0 if node < 0 else 1 + node], expected, atol=1e-5, rtol=1e-5)


def test_keeping_the_accepted_path_leaves_its_causal_kv_and_the_next_step_s_logits():
    model = tiny_model("qwen3", vocab=V, seed=4)
    prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(2))
    tree, root = DraftTree.from_chains(CHAINS), 13
    kv = committed(model, prompt)
    L = kv.length
    with torch.inference_mode():
        model(torch.tensor([root] + tree.tokens), torch.tensor(tree.positions(L)), kv, mask=tree.attention_mask(L))
    path = tree.path(4)                                   # 3, 5, 8: not the first branch, so rows move
    kv.keep([0] + [1 + i for i in path])
    plain = committed(model, torch.cat([prompt, torch.tensor([root] + [tree.tokens[i] for i in path])]))
    assert kv.length == plain.length == L + 4
    torch.testing.assert_close(kv.k[:, :, :, :kv.length], plain.k[:, :, :, :kv.length], atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        a = model(torch.tensor([2]), torch.tensor([kv.length]), kv)
        b = model(torch.tensor([2]), torch.tensor([plain.length]), plain)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_greedy_walks_down_the_argmax_and_stops_with_it():
    logits = torch.full((1 + 10, V), -5.0)
    tree = DraftTree.from_chains(CHAINS)
    logits[0, 3] = 5.0                 # root: 3 (node 0)
    logits[1, 5] = 5.0                 # node 0 -> 5 (node 1)
    logits[2, 8] = 5.0                 # node 1 -> 8 (node 4), not 7
    logits[5, 2] = 5.0                 # node 4 is a leaf: its argmax, 2, is the bonus
    v = verify(tree, logits, SamplingParams(0.0), torch.Generator())
    assert v.accepted == [0, 1, 4] and v.next_token == 2 and v.bonus
    siblings = {c for n in (-1, 0, 1) for c in tree.children(n)} - {0, 1, 4}
    assert siblings and {node for node, _ in v.refused} == siblings   # the path's siblings, refused
    logits[2, 8], logits[2, 12] = -5.0, 5.0   # node 1's argmax is no child: a correction
    v = verify(tree, logits, SamplingParams(0.0), torch.Generator())
    assert v.accepted == [0, 1] and v.next_token == 12 and not v.bonus
    assert {node for node, _ in v.refused} >= set(tree.children(1))   # every child of the last node, refused


@pytest.mark.law
def test_sampled_walks_commit_the_target_s_law():
    """The first committed token follows the root row's p whatever the root's children hold, and the token after a
    first 3 (a drafted node) follows that node's row. Chi-square over 8000 seeded walks (a quarter in make test); taking
    a refused sibling out of p before the next one is tried is what makes it hold (without it this fails)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1 + 10, 6, generator=g) * 1.5
    tree = DraftTree.from_chains([[3, 5, 1], [3, 2], [4, 4], [0]])
    params = SamplingParams(1.0)
    p0 = process_logits(logits[0], params)
    p3 = process_logits(logits[1 + tree.child(-1, 3)], params)

    def pvalue(seeds: range) -> float:   # the walks of one generator per batch; both laws must hold
        gen = torch.Generator().manual_seed(7 + seeds.start)
        first, after_3 = torch.zeros(6), torch.zeros(6)
        for _ in seeds:
            v = verify(tree, logits, params, gen)
            tokens = [tree.tokens[i] for i in v.accepted] + [v.next_token]
            first[tokens[0]] += 1
            if tokens[0] == 3:
                after_3[tokens[1]] += 1
        return min(chisquare(first.numpy(), (p0 * len(seeds)).numpy()).pvalue,
                   chisquare(after_3.numpy(), (p3 * after_3.sum()).numpy()).pvalue)

    assert_law(pvalue, law_samples(8000))

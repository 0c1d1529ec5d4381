"""Draft trees verified in one forward (SpecInfer, EAGLE-2/3): several candidate continuations share their common
prefixes in a trie, and one forward of the target scores every node.

The forward's rows are the root -- the last token, not yet in the KV cache, whose row predicts the first draft --
then the nodes, each after its parent. Node i sits at position L + depth(i) and attends to the committed K/V, its
ancestors and itself (`attention_mask`), so its logits are those of a causal forward of its own path, whatever its
siblings and cousins hold (a test holds it to separate forwards of each path).

Verification (`verify`) walks from the root: at each node, its children's tokens are candidates for the next token,
verified with the deterministic-draft rule one after another (accept child c with probability p(c) under the target
distribution with the earlier siblings taken out and renormalised; greedy: the child equal to the argmax). The walk
goes down an accepted child and stops where every child is refused -- the next token is then drawn from what is
left of p -- or at a leaf, whose row gives a bonus token. Taking the siblings out one by one is sampling from p in
steps, so the committed tokens follow the target's law exactly, for any set of distinct candidates chosen from the
context (the multi-draft rejection rule of SpecInfer, for deterministic drafts). The caller keeps the K/V of the
root and the accepted path (`KVCache.keep`: the rest is rolled back).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from studio.engine.sampling import SamplingParams, p_minus_draft_distribution, process_logits, sample


@dataclass
class DraftTree:
    """A trie of drafts: node i holds `tokens[i]`, its parent is `parents[i]` (-1: the root), and parents come before
    their children. A token is at most once among one node's children."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    _nodes: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._nodes.update(((p, t), i) for i, (t, p) in enumerate(zip(self.tokens, self.parents)))

    @classmethod
    def from_chains(cls, chains: list[list[int]], max_nodes: int | None = None) -> "DraftTree":
        """The trie of candidate continuations (their shared prefixes once), in the chains' order, cut where it would
        pass `max_nodes`."""
        tree = cls()
        for chain in chains:
            node = -1
            for token in chain:
                if max_nodes is not None and tree.child(node, token) is None and len(tree) == max_nodes:
                    return tree
                node = tree.child(node, token, add=True)
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int, add: bool = False) -> int | None:
        """The node under `parent` holding `token` (made when `add`), or None."""
        node = self._nodes.get((parent, token))
        if node is not None or not add:
            return node
        self.tokens.append(token)
        self.parents.append(parent)
        node = self._nodes[parent, token] = len(self.tokens) - 1
        return node

    def children(self, parent: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == parent]

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def path_of(self, chain: list[int]) -> list[int]:
        """The nodes holding `chain`'s tokens from the root down (as far as the tree holds them)."""
        out, node = [], -1
        for token in chain:
            node = self.child(node, token)
            if node is None:
                break
            out.append(node)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def positions(self, root_position: int) -> list[int]:
        """The forward's positions: the root's, then each node's at its depth below it."""
        return [root_position] + [root_position + d for d in self.depths()]

    def attention_mask(self, n_past: int, device="cpu") -> torch.Tensor:
        """bool [1 + n, n_past + 1 + n]: every row sees the committed slots, the root, its ancestors and itself."""
        n = len(self)
        new = torch.eye(1 + n, dtype=torch.bool, device=device)
        new[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                new[1 + i] |= new[1 + p]
        past = torch.ones(1 + n, n_past, dtype=torch.bool, device=device)
        return torch.cat([past, new], dim=1)


@dataclass
class TreeVerdict:
    accepted: list[int]        # the accepted path's nodes, root's child first (every other node is pruned)
    next_token: int            # the token after it: a correction where children were refused, else a bonus
    p: list[float]             # p of each accepted node's token when it was verified
    bonus: bool                # whether next_token came from a leaf's row (every draft on the way accepted)
    refused: list[tuple[int, float]] = field(default_factory=list)   # (node, p when verified) of each refused node


def verify(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> TreeVerdict:
    """Walk the tree against the target's logits [1 + n, V] (row 0: the root's): the accepted path and the next
    token, committed tokens distributed exactly as the target's (see the module's docstring)."""
    accepted, ps, refused = [], [], []
    node, row = -1, 0
    while True:
        p = process_logits(logits[row], params)
        kids = tree.children(node)
        taken, p_taken = None, 0.0
        if params.greedy:
            best = int(torch.argmax(p).item())
            taken = next((c for c in kids if tree.tokens[c] == best), None)
            p_taken, next_token = float(p[best].item()), best
            refused += [(c, float(p[tree.tokens[c]].item())) for c in kids if c != taken]
        else:
            for c in kids:   # each sibling in turn, the earlier ones taken out of p
                p_taken = float(p[tree.tokens[c]].item())
                rest = p_minus_draft_distribution(p, tree.tokens[c])
                if rest is None or float(torch.rand(1, generator=gen, device=gen.device).item()) < p_taken:
                    taken = c   # (rest None: the token held all of p)
                    break
                refused.append((c, p_taken))   # (the siblings after a taken one are never tried)
                p = rest
            next_token = None if taken is not None else int(sample(p, gen))
        if taken is None:
            return TreeVerdict(accepted, next_token, ps, bonus=not kids, refused=refused)
        accepted.append(taken)
        ps.append(p_taken)
        node, row = taken, 1 + taken

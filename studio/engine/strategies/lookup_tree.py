"""Prompt lookup as a draft tree: where the context's last tokens occurred before, what followed each of their
latest occurrences is a candidate continuation; the candidates' trie (`draft_tree.DraftTree`, shared prefixes once)
is verified in one forward, and the longest path the target accepts is committed with the token after it. With no
candidate a step is a plain AR step. Every candidate is a deterministic function of the tokens so far, so the walk
commits the target's tokens (greedy) and its law (sampled): lossless, with no adapter and no training.

Design: docs/strategies.md#lookup-tree
"""
from __future__ import annotations

from dataclasses import dataclass

from studio.engine.draft_tree import DraftTree
from studio.engine.sampling import sample_token
from studio.engine.strategies import lookup as prompt_lookup
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.engine.strategies.params import N, param
from studio.errors import BadInput


class LookupTree(Strategy):
    name = "lookup-tree"

    @dataclass
    class Params:
        branches: int = param(4, "candidate continuations: what followed the context's last tokens at their latest "
                                 "occurrences (1: plain prompt lookup, one chain)", tune=(1, 8))
        depth: int = param(6, "tokens per candidate at most", role=N, tune=(1, 12))
        rows: int = param(16, "the tree's nodes at most, the root's row included: the verifying forward's width")
        shortest: int = param(2, f"the shortest suffix of the context looked up (1..{prompt_lookup.LONGEST}; "
                                 "longer ones first)")

    @staticmethod
    def validate(p) -> None:
        for name, low in (("branches", 1), ("depth", 1), ("rows", 2)):
            if getattr(p, name) < low:
                raise BadInput(f"lookup-tree {name} must be >= {low}, got {getattr(p, name)}")
        if not 1 <= p.shortest <= prompt_lookup.LONGEST:
            raise BadInput(f"lookup-tree shortest must be 1..{prompt_lookup.LONGEST}, got {p.shortest}")

    def kv_headroom(self, config=None) -> int:
        return self.params.rows

    def causal_kv(self, config) -> bool:
        return True   # only the root's and the accepted path's K/V are kept, each its token's causal K/V

    def lossless(self) -> bool:
        return True

    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        self.lookup = prompt_lookup.ContextLookup(prompt, self.params.shortest)
        logits = ctx.forward("prefill", prompt, logits_rows=[len(prompt) - 1])
        ctx.commit(len(prompt))
        self.pending, _ = sample_token(logits[0], ctx.sampling, ctx.gen)
        ctx.emit([self.pending])

    def step(self, ctx: DecodeContext) -> None:
        self.lookup.follow(ctx.out)
        tree = self._tree()
        if not len(tree):   # nothing to look up: an AR step
            logits = ctx.forward("extend", [self.pending])
            ctx.commit(1)
            self.pending, _ = sample_token(logits[0], ctx.sampling, ctx.gen)
            ctx.emit([self.pending])
            return
        v = ctx.verify_tree(tree, self.pending, "ngram")
        self.pending = v.next_token
        ctx.emit([tree.tokens[i] for i in v.accepted] + [v.next_token])

    def _tree(self) -> DraftTree:
        """The candidates' trie, cut to `rows` - 1 nodes (the root's row is the forward's first)."""
        p = self.params
        return DraftTree.from_chains(self.lookup.branches(p.depth, p.branches), max_nodes=p.rows - 1)

"""DFlash: a small block-diffusion drafter (studio.engine.dflash) drafts a whole block from the target's tapped hidden
states in one forward, and the target verifies it with the exact rules -- a chain (greedy: the drafter's argmax;
sampled: drafts drawn from its q rows, verified against them) or, with `branches` > 1, a draft tree of each slot's
top tokens verified in one forward (studio.engine.draft_tree). Lossless either way.

The last committed token (`pending`) is not in the target's KV cache yet: it anchors the drafter's block and leads
every target forward, whose tapped hidden states of the committed rows become the drafter's next context rows.

Design: docs/strategies.md#dflash
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from studio.engine.dflash import WEIGHTS, Drafter, load_drafter
from studio.engine.draft_tree import DraftTree
from studio.engine.sampling import Proposal, process_logits, sample, sample_token
from studio.engine.strategies import drafting
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.engine.strategies.params import N, param
from studio.engine.taps import LayerTaps
from studio.errors import BadInput


def _drafter(path: str, device: str, dtype: torch.dtype) -> Drafter:
    """A drafter loaded once per directory, device and dtype (every run of a comparison shares it), again when its
    weights were rewritten since (a drafter trained on in the same directory)."""
    weights = Path(path).expanduser() / WEIGHTS
    return _load(path, weights.stat().st_mtime_ns if weights.is_file() else 0, device, dtype)


@functools.lru_cache(maxsize=4)
def _load(path: str, version: int, device: str, dtype: torch.dtype) -> Drafter:
    return load_drafter(path, device, dtype)


class DFlash(Strategy):
    name = "dflash"

    @dataclass
    class Params:
        block: int = param(0, "drafts per forward at most (the drafter's block - 1); 0 = the drafter's whole block",
                           role=N)
        branches: int = param(1, "1: the drafts as one chain | k > 1: a draft tree, each slot's k most likely tokens "
                                 "under the chain's path (deterministic drafts, verified in one forward)",
                              tune=(1, 4))
        rows: int = param(32, "a tree's nodes at most, the anchor's row included: the verifying forward's width")
        drafting: str = param("auto", drafting.HELP, choices=drafting.DRAFTING, tune=True)
        drafter: str = param("", "a DFlash drafter directory in the published layout (--draft-model); empty: the one "
                                 "shipped for the model")

    def __init__(self, params: dict | None = None):
        super().__init__(params)
        self.drafter: Drafter | None = None
        self.share = 0.0   # the drafter's forward against the target's (`ready`)

    @staticmethod
    def validate(p) -> None:
        drafting.validate("dflash", p.drafting)
        for name, low in (("block", 0), ("branches", 1), ("rows", 2)):
            if getattr(p, name) < low:
                raise BadInput(f"dflash {name} must be >= {low}, got {getattr(p, name)}")

    def use_drafter(self, path: str) -> None:
        """Draft with the published DFlash drafter at `path` (`--draft-model`) instead of the shipped one."""
        self.params.drafter = str(path)

    @classmethod
    def ready_for(cls, model: str) -> bool:
        from studio.presets.shipped import shipped_drafter
        return shipped_drafter(model) is not None

    def ready(self, engine) -> None:
        from studio.engine.compiled import is_compiled
        from studio.presets.shipped import shipped_drafter

        if getattr(engine.model, "parallel", None) is not None:
            raise BadInput("dflash with --tp: the drafter is not split across ranks yet")
        if is_compiled(engine.model):
            raise BadInput("dflash with --compile: the drafter reads the target's layers through hooks, which a "
                           "compiled step does not call")
        path = self.params.drafter or shipped_drafter(engine.name)
        if path is None:
            raise BadInput(f"dflash needs a drafter trained for {engine.name!r}: give --draft-model DIR (a DFlash "
                           "drafter in the published layout) or train one with `dlm-studio train dflash`")
        weight = engine.model.lm_head.weight
        self.drafter = _drafter(str(path), str(weight.device), weight.dtype)
        self.drafter.config.check_target(engine.config, engine.name)
        # the planner prices the drafter's forward of d drafts as this share of a target forward of 1 + d rows: its
        # weights and the head's against the target's (the cost table prices the target's forwards only). An
        # estimate, never a clock: a seeded run plans the same from one run to the next
        count = lambda m: sum(p.numel() for p in m.parameters())   # noqa: E731
        self.share = (count(self.drafter) + weight.numel()) / count(engine.model)

    # -- what it needs
    def _drafts(self) -> int:
        whole = self.drafter.config.block_size - 1 if self.drafter is not None else 15
        return min(self.params.block, whole) if self.params.block else whole

    def kv_headroom(self, config=None) -> int:
        return max(self.params.rows, self._drafts() + 1) if self.params.branches > 1 else self._drafts() + 1

    def graph_tokens(self) -> int | None:
        return 0   # eager: the taps are forward hooks, which a graph replay does not call

    def causal_kv(self, config) -> bool:
        # every committed row is its token's causal K/V, but the drafter needs the tapped hidden states of every
        # prompt token too, which a reused prefix or a chunked prefill does not give it
        return False

    def lossless(self) -> bool:
        return True

    def header_params(self) -> dict:
        return dict(super().header_params(), drafter=self.params.drafter or "shipped")

    # -- decoding
    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        if self.drafter is None:
            raise BadInput("dflash: no drafter loaded (prepare the run first)")
        self.dkv = self.drafter.new_cache(ctx.kv.max_len + self.drafter.config.block_size)
        self.planner = drafting.DraftPlanner(ctx, self._drafts()) if self.plans_drafts else None
        logits, hidden = self._forward(ctx, "prefill", prompt, logits_rows=[len(prompt) - 1])
        ctx.commit(len(prompt))
        self.unread = [hidden]   # context rows the drafter has not seen yet
        self.pending, _ = sample_token(logits[0], ctx.sampling, ctx.gen)
        ctx.emit([self.pending])

    def _forward(self, ctx: DecodeContext, role: str, tokens: list[int], *args, **kwargs):
        """A target forward and its rows' tapped hidden states [1, T, taps x D] (hooked for this forward only: the
        model is shared with other runs)."""
        with LayerTaps(ctx.model, self.drafter.config.taps) as taps:
            logits = ctx.forward(role, tokens, *args, **kwargs)
            return logits, taps.take()

    def step(self, ctx: DecodeContext) -> None:
        k = self._plan(ctx)
        if k == 0:
            logits, hidden = self._forward(ctx, "extend", [self.pending])
            ctx.commit(1)
            self.unread.append(hidden)
            self.pending, _ = sample_token(logits[0], ctx.sampling, ctx.gen)
            ctx.emit([self.pending])
            return
        draft_logits = self._draft(ctx, k)
        if self.params.branches > 1:
            self._tree_step(ctx, draft_logits)
        else:
            self._chain_step(ctx, draft_logits)

    def _plan(self, ctx: DecodeContext) -> int:
        """Drafts the next forward verifies: the block's, or as many as pay under drafting=auto; never more than
        the answer has room for."""
        room = ctx.out.draft_room()
        top = min(self._drafts(), room)
        if self.planner is None or top == 0:
            return top
        b, share = self.params.branches, self.share

        def rate(reach, cost):
            d = len(reach)
            rows = None if b == 1 else min(self.params.rows, 1 + b * d)
            with_draft = lambda n, gated: cost(n, gated) + (share * cost(1 + d, 0) if d else 0.0)   # noqa: E731
            return drafting.chain_rate(reach, with_draft, ctx.clean_gate, rows)

        return self.planner.plan(rate, limit=top)

    def _draft(self, ctx: DecodeContext, k: int) -> torch.Tensor:
        """The drafter's raw logits [k, V] for the k positions after `pending`: one forward of its block over the
        context rows it has not seen (committed into its cache) and the context it has; the head reads only the k
        rows the plan verifies."""
        context = torch.cat(self.unread, dim=1)
        self.unread = []
        L, C, B = self.dkv.length, context.shape[1], self.drafter.config.block_size
        if L + C != ctx.kv.length:
            raise RuntimeError(f"dflash: the drafter's context ({L + C}) is not the committed length ({ctx.kv.length})")
        block = torch.tensor([[self.pending] + [self.drafter.config.mask_token_id] * (B - 1)], device=ctx.device)
        positions = torch.arange(L, L + C + B, device=ctx.device)[None]
        with torch.inference_mode():
            hidden = self.drafter(context, ctx.model.model.embed_tokens(block), positions, kv=self.dkv)
            return ctx.model.logits(hidden[0, 1:1 + k])

    def _chain_step(self, ctx: DecodeContext, draft_logits: torch.Tensor) -> None:
        k, start = draft_logits.shape[0], ctx.n_out
        if ctx.sampling.greedy:
            q, drafts, proposal = None, draft_logits.argmax(-1).tolist(), Proposal.DETERMINISTIC
        else:
            q = process_logits(draft_logits, ctx.sampling)
            drafts, proposal = sample(q, ctx.gen).tolist(), Proposal.SAMPLED
        pos = list(range(start, start + k))
        logits, hidden = self._forward(ctx, "verify", [self.pending] + drafts)
        ctx.event("propose", pos=pos, tok=drafts, src="draft_model",   # (the verifying forward's step)
                  q=[1.0] * k if q is None else q[torch.arange(k), drafts].tolist())
        res = ctx.verify(pos, drafts, process_logits(logits[:k], ctx.sampling), q, proposal,
                         logits=(logits[:k], None if q is None else draft_logits))
        a = res.n_accepted
        if self.planner is not None:
            self.planner.observe(k, a)
        ctx.commit(1 + a)
        self.unread.append(hidden[:, :1 + a])
        if a < k:
            new = drafts[:a] + [res.correction]
        else:
            bonus, _ = sample_token(logits[k], ctx.sampling, ctx.gen)
            ctx.event("bonus", pos=start + k, tok=bonus)
            new = drafts + [bonus]
        self.pending = new[-1]
        ctx.emit(new)

    def _tree_step(self, ctx: DecodeContext, draft_logits: torch.Tensor) -> None:
        tree, taps = self._tree(draft_logits), []

        def forward(*args, **kwargs):   # the tree's forward, its tapped rows kept for the drafter
            logits, hidden = self._forward(ctx, *args, **kwargs)
            taps.append(hidden)
            return logits

        v = ctx.verify_tree(tree, self.pending, "draft_model", forward)
        if self.planner is not None:   # the chain's slots: how deep the walk went of how deep the tree is
            self.planner.observe(max(tree.depths()), len(v.accepted))
        self.unread.append(taps[0][:, [0] + [1 + i for i in v.accepted]])
        self.pending = v.next_token
        ctx.emit([tree.tokens[i] for i in v.accepted] + [v.next_token])

    def _tree(self, draft_logits: torch.Tensor) -> DraftTree:
        """The chain of the drafter's argmax tokens, and under each of its nodes' parents the slot's next
        `branches` - 1 most likely tokens as leaves, cut to `rows` - 1 nodes: every candidate a deterministic function
        of the context, so the tree's walk keeps the target's law."""
        top = draft_logits.topk(self.params.branches, dim=-1).indices.tolist()
        chain = [row[0] for row in top]
        chains = [chain] + [chain[:i] + [t] for i, row in enumerate(top) for t in row[1:]]
        return DraftTree.from_chains(chains, max_nodes=self.params.rows - 1)

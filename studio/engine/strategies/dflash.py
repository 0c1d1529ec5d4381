"""DFlash: a small block-diffusion drafter (studio.engine.dflash) drafts a whole block from the target's tapped hidden
states in one forward, and the target verifies it with the exact rules -- a chain (greedy: the drafter's argmax;
sampled: drafts drawn from its q rows, verified against them) or, with `branches` > 1, a draft tree of each slot's
top tokens verified in one forward (studio.engine.draft_tree). Lossless either way. Where the context's last tokens
occurred before (`lookup`), what followed them is verified instead, as a tree of up to `matches` candidates, with no
drafter forward: a small model repeats itself, and a looked-up guess costs nothing to make. A lookup its planner
finds not worth its rows leaves the step to the drafter.

The last committed token (`pending`) is not in the target's KV cache yet: it anchors the drafter's block and leads
every target forward, whose tapped hidden states of the committed rows become the drafter's next context rows.

Design: docs/strategies.md#dflash
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from studio.engine.dflash import WEIGHTS, Drafter, load_drafter, read_drafter_config
from studio.engine.drafter_cost import CONTEXT, DrafterPrice, drafter_share
from studio.engine.draft_tree import DraftTree
from studio.engine.kernels.projection import quant_linear, vocab_logits
from studio.engine.quantize import check_quant, is_quantized, quantize_layers, quantized_rows
from studio.engine.sampling import Proposal, process_logits, sample, sample_token
from studio.engine.strategies import drafting
from studio.engine.strategies import lookup as prompt_lookup
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.engine.strategies.params import N, param
from studio.engine.taps import LayerTaps
from studio.errors import BadInput


QUANTS = ("auto", "int8", "none")


def _drafter(path: str, device: str, dtype: torch.dtype, quant: str) -> Drafter:
    """A drafter loaded once per directory, device, dtype and quantisation (every run of a comparison shares it), again
    when its weights were rewritten since (a drafter trained on in the same directory)."""
    weights = Path(path).expanduser() / WEIGHTS
    return _load(path, weights.stat().st_mtime_ns if weights.is_file() else 0, device, dtype, quant)


@functools.lru_cache(maxsize=4)
def _load(path: str, version: int, device: str, dtype: torch.dtype, quant: str) -> Drafter:
    drafter = load_drafter(path, device, dtype)
    if quant == "int8":
        quantize_layers(drafter, "int8")
    return drafter


@functools.lru_cache(maxsize=4)
def _head_rows(weight: torch.Tensor, vocab: torch.Tensor | None, quant: str) -> tuple:
    """(ids on the head's device, rows, row scales) of the head the drafter reads, made once per head, drafter and
    quantisation: a draft vocabulary's rows (ids None: all of them), in one byte with a scale per row under int8 (scales
    None: the float rows); None where the drafter reads the target's own head as it is (`model.logits`)."""
    if vocab is None and quant == "none":
        return None
    ids = None if vocab is None else vocab.to(weight.device)
    rows = weight if ids is None else weight[ids].contiguous()
    return (ids, *quantized_rows(rows, "int8")) if quant == "int8" else (ids, rows, None)


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
        lookup: int = param(2, prompt_lookup.HELP + ", verified instead of the drafter's block")
        matches: int = param(4, "looked-up continuations at most, verified as one tree", tune=(1, 8))
        drafter: str = param("", "a DFlash drafter directory in the published layout (--draft-model); empty: the one "
                                 "shipped for the model")
        quant: str = param("auto", "the drafter's weights and head rows: int8 (one byte and a scale per row, a quarter "
                                   "of the bytes its forward streams) | none; auto: int8 on the CPU in fp32",
                           choices=QUANTS)

    def __init__(self, params: dict | None = None):
        super().__init__(params)
        self.drafter: Drafter | None = None
        self.price: DrafterPrice | None = None   # its forward against the target's 1-token step, by drafts (`ready`)
        self.head = None   # the draft vocabulary's ids, head rows and scales (`ready`, `_head_rows`)
        self.quant: str | None = None   # `quant` resolved on the target's device and dtype (`ready`)

    @staticmethod
    def validate(p) -> None:
        drafting.validate("dflash", p.drafting)
        for name, low in (("block", 0), ("branches", 1), ("rows", 2), ("matches", 1)):
            if getattr(p, name) < low:
                raise BadInput(f"dflash {name} must be >= {low}, got {getattr(p, name)}")
        prompt_lookup.validate("dflash", p.lookup)
        if p.quant not in QUANTS:
            raise BadInput(f"dflash quant must be one of {', '.join(QUANTS)}, got {p.quant!r}")

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
        quant = self.quant = self._quant(weight)
        self.drafter = _drafter(str(path), str(weight.device), weight.dtype, quant)
        vocab = self.drafter.vocab
        self.drafter.config.check_target(engine.config, engine.name, vocab)
        # a drafter reading the whole head of a target quantised already reads its 1-byte head (`model.logits`)
        self.head = None if vocab is None and is_quantized(engine.model) else _head_rows(weight, vocab, quant)
        # the planner prices the drafter's forward as a share of the target's 1-token step (the cost table prices
        # the target's forwards only), by the drafts it makes: measured once per machine, target and drafter, cached
        weights = Path(path).expanduser() / WEIGHTS
        stat = weights.stat()
        identity = {"path": str(weights.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns,
                    **({"quant": quant} if quant != "none" else {})}   # (a float drafter's key as it always was)
        self.price = drafter_share(engine, identity, self._drafts(), lambda k: self._timed_draft(engine.model, k))

    def _quant(self, weight: torch.Tensor) -> str:
        """The drafter's quantisation on the target's device and dtype: `auto` is int8 on the CPU in fp32, where a
        drafter forward streams its weights (on the embedded model an int8 drafter's drafts are as often right, and
        its forward costs 0.10 of a step instead of 0.16: docs/strategies.md#dflash)."""
        quant = self.params.quant
        if quant == "auto":
            return "int8" if weight.device.type == "cpu" and weight.dtype == torch.float32 else "none"
        if quant == "int8":
            check_quant("int8", weight.device)
        return quant

    def _timed_draft(self, model, k: int):
        """A drafter forward of k drafts as a run makes it, for `drafter_share` to time: a new context row, the
        anchor and k MASK rows, the head on the drafts, after CONTEXT rows of the drafter's own cache."""
        taps = torch.zeros(1, CONTEXT, len(self.drafter.config.taps) * model.config.dim,
                           dtype=self.drafter.norm.weight.dtype, device=model.lm_head.weight.device)
        kv = self.drafter.new_cache(CONTEXT + 1 + self.drafter.config.block_size)
        self._draft_logits(model, taps[:, :-1], 0, 1, kv)

        def draft():
            self._draft_logits(model, taps[:, -1:], 0, k, kv)
            kv.rollback(CONTEXT - 1)
        return draft

    def drafts_for(self, engine) -> int | None:
        """The drafts per forward a run on `engine` would make at most (`block` 0: the drafter's whole block), from the
        drafter's config alone; None where there is no drafter to read (the run says why)."""
        from studio.presets.shipped import shipped_drafter

        path = self.params.drafter or shipped_drafter(engine.name)
        try:
            return self._within(read_drafter_config(Path(path).expanduser()).block_size - 1)
        except (TypeError, OSError, BadInput):   # (TypeError: no drafter shipped for the model)
            return None

    # -- what it needs
    def _drafts(self) -> int:
        return self._within(self.drafter.config.block_size - 1 if self.drafter is not None else 15)

    def _within(self, whole: int) -> int:
        """The drafts per forward at most, for a drafter of `whole` drafts a block."""
        return min(self.params.block, whole) if self.params.block else whole

    def kv_headroom(self, config=None) -> int:
        trees = self.params.branches > 1 or (self.params.lookup and self.params.matches > 1)
        return max(self.params.rows, self._drafts() + 1) if trees else self._drafts() + 1

    def graph_tokens(self) -> int | None:
        return 0   # eager: the taps are forward hooks, which a graph replay does not call

    def causal_kv(self, config) -> bool:
        # every committed row is its token's causal K/V, but the drafter needs the tapped hidden states of every
        # prompt token too, which a reused prefix or a chunked prefill does not give it
        return False

    def lossless(self) -> bool:
        return True

    def header_params(self) -> dict:
        # the quantisation the drafter runs in, once `ready` resolved `auto`
        return dict(super().header_params(), drafter=self.params.drafter or "shipped",
                    quant=self.quant or self.params.quant)

    # -- decoding
    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        if self.drafter is None:
            raise BadInput("dflash: no drafter loaded (prepare the run first)")
        self.dkv = self.drafter.new_cache(ctx.kv.max_len + self.drafter.config.block_size)
        # looked-up drafts are right far more often than the drafter's on repeats: each source keeps its own
        # acceptance by slot (as Jacobi's do)
        self.planners = {src: drafting.DraftPlanner(ctx, self._drafts()) for src in ("draft_model", "ngram")} \
            if self.plans_drafts else {}
        self.lookup = prompt_lookup.ContextLookup(prompt, self.params.lookup) if self.params.lookup else None
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
        looked = self._look_up(ctx)
        tree = self._looked_up_tree(ctx, looked) if looked else None
        if tree:   # (a lookup that does not pay leaves the step to the drafter)
            self._tree_step(ctx, tree, "ngram")
            return
        k = self._plan(ctx, "draft_model", self.params.branches)
        if k == 0:
            self._ar_step(ctx)
            return
        draft_logits = self._draft(ctx, k)
        if self.params.branches > 1:
            self._tree_step(ctx, self._tree(draft_logits), "draft_model")
        else:
            self._chain_step(ctx, draft_logits)

    def _ar_step(self, ctx: DecodeContext) -> None:
        logits, hidden = self._forward(ctx, "extend", [self.pending])
        ctx.commit(1)
        self.unread.append(hidden)
        self.pending, _ = sample_token(logits[0], ctx.sampling, ctx.gen)
        ctx.emit([self.pending])

    def _look_up(self, ctx: DecodeContext) -> list[list[int]]:
        """What followed the latest occurrences of the context's last tokens (up to `matches` candidates of up to the
        block's drafts), [] where they never occurred or lookup is off."""
        if self.lookup is None:
            return []
        self.lookup.follow(ctx.out)
        return self.lookup.branches(self._drafts(), self.params.matches)

    def _looked_up_tree(self, ctx: DecodeContext, looked: list[list[int]]) -> DraftTree:
        """The candidates' trie cut to the depth that pays (all of it under drafting=fixed; empty: an AR step)."""
        depth = max(map(len, looked))
        if "ngram" in self.planners:
            depth = self._plan(ctx, "ngram", len(looked), depth)
        return DraftTree.from_chains([c[:depth] for c in looked] if depth else [], max_nodes=self.params.rows - 1)

    def _plan(self, ctx: DecodeContext, src: str, branches: int, limit: int | None = None) -> int:
        """Drafts the next forward verifies from `src` (the chain's depth: a tree's has `branches` nodes a level):
        the block's, or as many as pay under drafting=auto; never more than the answer has room for. The drafter's
        own forward is priced in for its drafts."""
        top = min(self._drafts() if limit is None else limit, ctx.out.draft_room())
        planner = self.planners.get(src)
        if planner is None or top == 0:
            return top
        def rate(reach, cost):
            d = len(reach)
            share = self.price(d) if src == "draft_model" and d else 0.0
            rows = None if branches == 1 else min(self.params.rows, 1 + branches * d)
            with_draft = lambda n, gated: cost(n, gated) + share * cost(1, 0)   # noqa: E731
            return drafting.chain_rate(reach, with_draft, ctx.clean_gate, rows)

        return planner.plan(rate, limit=top)

    def _draft(self, ctx: DecodeContext, k: int) -> torch.Tensor:
        """The drafter's raw logits [k, V] for the k positions after `pending`, from the context rows it has not seen
        (committed into its cache now) and the context it has."""
        context = torch.cat(self.unread, dim=1)
        self.unread = []
        if self.dkv.length + context.shape[1] != ctx.kv.length:
            raise RuntimeError(f"dflash: the drafter's context ({self.dkv.length + context.shape[1]}) is not the "
                               f"committed length ({ctx.kv.length})")
        ctx.price(self.price(k))
        return self._draft_logits(ctx.model, context, self.pending, k, self.dkv)

    def _draft_logits(self, model, context: torch.Tensor, pending: int, k: int, kv) -> torch.Tensor:
        """One forward of the block's first 1 + k rows [pending, MASK x k] over `context` (new rows, committed into
        `kv`) and what `kv` holds, the head on the k draft rows and only on the draft vocabulary's tokens. A plan of a
        few drafts does not pay for the block's other rows: on the embedded model the drafts it verifies are as
        often right without them (docs/strategies.md#dflash), and the forward costs less."""
        L, C = kv.length, context.shape[1]
        device = model.lm_head.weight.device
        block = torch.tensor([[pending] + [self.drafter.config.mask_token_id] * k], device=device)
        positions = torch.arange(L, L + C + 1 + k, device=device)[None]
        with torch.inference_mode():
            hidden = self.drafter(context, model.model.embed_tokens(block), positions, kv=kv)[0, 1:1 + k]
            if self.head is None:
                return model.logits(hidden)
            ids, rows, scale = self.head
            out = vocab_logits(rows, hidden) if scale is None else quant_linear(hidden, rows, scale).float()
            if ids is None:
                return out
            logits = torch.full((k, model.lm_head.weight.shape[0]), float("-inf"), device=device)
            logits[:, ids] = out   # tokens outside the draft vocabulary are never drafted
            return logits

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
        if "draft_model" in self.planners:
            self.planners["draft_model"].observe(k, a)
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

    def _tree_step(self, ctx: DecodeContext, tree: DraftTree, src: str) -> None:
        taps = []

        def forward(*args, **kwargs):   # the tree's forward, its tapped rows kept for the drafter
            logits, hidden = self._forward(ctx, *args, **kwargs)
            taps.append(hidden)
            return logits

        v = ctx.verify_tree(tree, self.pending, src, forward)
        if src in self.planners:   # the chain's slots: how deep the walk went of how deep the tree is
            self.planners[src].observe(max(tree.depths()), len(v.accepted))
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

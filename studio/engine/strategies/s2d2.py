"""S2D2: block-diffusion drafting + self-verification of the first masked span by the same model in block-size-1
mode (the "2L trick" mask for position-aligned models, a plain causal forward for right-shifted ones). A routing
policy (routing.py) decides at each step whether to verify; the verifier never writes the KV cache. Runs on SDAR /
Fast-dLLM v2, an AR model + block adapter, LLaDA2 on its own block grid (with LLaDA2.1's token editing before the
verification), and a bidirectional model (Dream, LLaDA) carrying a D2F block adapter.

Design: docs/strategies.md#s2d2
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from studio.engine.masks import s2d2_verifier
from studio.engine.sampling import process_logits
from studio.engine.strategies import drafting
from studio.engine.strategies import lookup as prompt_lookup
from studio.engine.strategies.base import DecodeContext
from studio.engine.strategies.blockdiff import BlockDiffusion, is_d2f
from studio.engine.strategies.unmasking import Draft
from studio.engine.strategies.params import param
from studio.engine.strategies.routing import POLICIES, RouteInput, make_policy
from studio.errors import BadInput


class S2D2(BlockDiffusion):
    name = "s2d2"

    @dataclass
    class Params(BlockDiffusion.Params):
        policy: str = param("min-span", "when to verify the draft (the routing policy)", choices=POLICIES)
        route: dict = param(help="the policy's parameters (CLI: -p route.c=1)", factory=dict)
        gamma: float = param(1.0, "acceptance tempering (lossy when != 1)")
        verify_replaces: bool = param(True, "verifying steps skip the threshold rule (reference behaviour)")
        drafting: str = param("auto", "auto: on an AR model with a block adapter, draft the open block only when that "
                                      "pays by the measured forward costs and the run's acceptance, else commit its "
                                      "filled prefix (an AR step) | fixed: always draft", choices=drafting.DRAFTING)
        lookup: int = param(2, prompt_lookup.HELP + " (on the AR steps drafting=auto falls back to)")

    def __init__(self, params: dict | None = None):
        params = dict(params or {})
        route = params.pop("route", None) or {}
        if not isinstance(route, dict):
            raise BadInput(f"strategy 's2d2' parameter 'route' must be a table like {{c = 1.0}}, got {route!r:.60}")
        route = dict(route)
        route.update({k.split(".", 1)[1]: params.pop(k) for k in list(params) if k.startswith("route.")})
        super().__init__(dict(params, route=route))
        self.policy = make_policy(self.params.policy, **route)   # validates the policy and its parameters

    @classmethod
    def validate(cls, p) -> None:
        super().validate(p)
        if not p.gamma > 0:
            raise BadInput(f"s2d2 gamma must be > 0, got {p.gamma}")
        drafting.validate("s2d2", p.drafting)
        prompt_lookup.validate("s2d2", p.lookup)

    def check_run(self, config, max_new_tokens: int) -> None:
        """A bidirectional model has no block-size-1 mode to verify with unless it carries a D2F block adapter, and
        that adapter is the D2F student on every row."""
        super().check_run(config, max_new_tokens)
        name = config.name or "this model"
        if config.attention == "bidirectional" and not is_d2f(config):
            raise BadInput(f"s2d2: {name} was trained with bidirectional attention (LLaDA, Dream) and has no "
                           "block-size-1 mode to verify with; attach a D2F-style block adapter (its "
                           "adapter_config.json giving block_size), or decode it with canvas")
        if is_d2f(config) and self.params.adapter_rows != "all":
            raise BadInput(f"s2d2: {name} carries a D2F block adapter, which is the student on every row: give "
                           "-p adapter_rows=all (the s2d2-d2f preset does)")

    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        self.policy.reset()
        super().start(ctx, prompt)

    def _planner(self, ctx: DecodeContext) -> drafting.BlockPlanner:
        return drafting.BlockPlanner(ctx, self.B, forced=self._forced_slots(), draft_forwards=1,
                                     all_gated=self.params.adapter_rows == "all")

    def _denoise(self, ctx: DecodeContext, role: str) -> None:
        b, p = self.block, self.params
        d = self._draft_step(ctx, role)
        if not d.slots:   # a full block's editing step (LLaDA2.1): nothing to route or verify
            b.step += 1
            return
        span = first_run(d.slots)
        n_hi = sum(c > p.threshold for c in d.conf)
        x = RouteInput(span_len=span, n_masked=len(d.slots), block_size=b.size, probs=d.dist[:span],
                       step=b.step, n_hi=n_hi)
        verify, score = self.policy.decide(x)
        ctx.event("route", verify=verify, score=score if math.isfinite(score) else None, policy=self.policy.name)
        decided = self._verify(ctx, d, span) if verify else []
        quota = self._quota()
        rest = [i for i in range(len(d.slots)) if b.masked[d.slots[i]]]
        chosen: list[int] = []
        if rest and (len(decided) < quota or not p.verify_replaces):
            sub = d.subset(rest)
            chosen = [rest[i] for i in self._select(sub, max(0, quota - len(decided)))]
        self._unmask(ctx, d, chosen)
        self.policy.feedback(len(decided) + len(chosen), verify)
        b.step += 1

    def _verify(self, ctx: DecodeContext, d: Draft, span: int) -> list[int]:
        """Verify the first `span` drafted slots; fill the accepted ones and the correction. Returns the
        indices into `d` that were filled."""
        b = self.block
        slots, drafts = d.slots[:span], d.tokens[:span]
        filled = list(b.tokens)
        for j, t in zip(d.slots, d.tokens):
            filled[j] = t
        logits = self._no_mask(ctx, self.verifier_logits(ctx, filled, slots))
        p = process_logits(logits, ctx.sampling)
        q = None if d.q is None else d.q[:span]
        forced = self._forced_slots()
        if span > forced:
            self._propose(ctx, slots[forced:], drafts[forced:], None if q is None else q[forced:], "diffusion")
        return list(range(self._verify_fill(ctx, slots, drafts, p, q, forced=forced, gamma=self.params.gamma)))

    def _forced_slots(self) -> int:
        """Drafts at the start of the span that are the target's own samples: on a right-shifted model with the
        partially causal draft mask, the first masked slot is predicted by the clean row before it, which sees
        exactly what the verifier's causal row sees, so its draft distribution is the target's (accepted by
        construction). Such a token is not a verified proposal (docs/strategies.md#s2d2)."""
        return 1 if self.shift and self.params.causal_prefix else 0

    def verifier_logits(self, ctx: DecodeContext, filled: list[int], slots: list[int]) -> torch.Tensor:
        """The model in block-size-1 mode at `slots` of the draft-filled block: logits [len(slots), V]."""
        b = self.block
        if self.shift:   # row j-1 predicts slot j; slot 0 is never masked, so j >= 1
            n = slots[-1]
            return ctx.forward("verify", filled[:n], lora_gate=self.gate(filled[:n], ctx.mask_id),
                               logits_rows=[j - 1 for j in slots])
        mask, positions = s2d2_verifier(b.size, b.start, device=ctx.device)
        tokens = filled + [ctx.mask_id] * b.size
        return ctx.forward("verify", tokens, positions=positions, mask=mask,
                           lora_gate=self.gate(tokens, ctx.mask_id), logits_rows=[b.size + j for j in slots])


def first_run(slots: list[int]) -> int:
    """Length of the first contiguous run of (sorted) masked slots: |C_t|."""
    n = 1 if slots else 0
    while n < len(slots) and slots[n] == slots[n - 1] + 1:
        n += 1
    return n

"""SimSD: a draft dLLM reveals γ slots of the open block, the target scores them in one forward (temporal mask and
RoPE copy for position-aligned targets, a causal forward for right-shifted ones) and accepts them in the draft's
order; with fewer than γ masks left the target finishes the block itself. Without `use_draft` the target drafts
for itself.

Design: docs/strategies.md#simsd
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from studio.engine.masks import simsd_temporal
from studio.engine.sampling import SamplingParams, process_logits
from studio.engine.strategies import drafting
from studio.engine.strategies import lookup as prompt_lookup
from studio.engine.strategies.base import DecodeContext
from studio.engine.strategies.blockdiff import SCHEDULES, BlockDiffusion
from studio.engine.strategies.unmasking import top_k, transfer_counts
from studio.engine.strategies.params import param
from studio.errors import BadInput

ACCEPTANCE = ("exact", "greedy-match")
REVEAL = ("auto", "confidence", "left-to-right")


class SimSD(BlockDiffusion):
    name = "simsd"
    edits = False   # its speculation rounds have no T2T step

    @dataclass
    class Params(BlockDiffusion.Params):
        gamma: int = param(0, "γ drafted tokens per round; 0 = every masked slot (paper: γ = B)")
        draft_steps: int = param(0, "drafter forwards per round; 0 = γ (one reveal per step, paper ds = B)")
        acceptance: str = param("exact", "exact | greedy-match (lossy when sampling)", choices=ACCEPTANCE)
        reveal: str = param("auto", "confidence | left-to-right; auto = confidence for position-aligned targets, "
                                    "left-to-right for right-shifted ones", choices=REVEAL)
        schedule: str = param("static", "the target's fallback rule: SDAR's low_confidence_static",
                              choices=SCHEDULES)
        drafting: str = param("auto", "auto: drafting for itself on an AR model with a block adapter, speculate only "
                                      "when that pays by the measured forward costs and the run's acceptance, else "
                                      "commit the block's filled prefix (an AR step) | fixed: always speculate",
                              choices=drafting.DRAFTING)
        lookup: int = param(2, prompt_lookup.HELP + " (on the AR steps drafting=auto falls back to)")

    def __init__(self, params: dict | None = None):
        super().__init__(params)
        self.draft_model = None        # a separate drafter (None = self draft)
        self.draft_mask_id: int | None = None
        self.draft_name = "self"

    @classmethod
    def validate(cls, p) -> None:
        super().validate(p)
        if p.gamma < 0 or p.draft_steps < 0:
            raise BadInput("simsd gamma and draft_steps must be >= 0 (0 = default)")
        if p.reveal not in REVEAL:
            raise BadInput(f"simsd reveal must be one of {', '.join(REVEAL)}, got {p.reveal!r}")
        if p.acceptance not in ACCEPTANCE:
            raise BadInput(f"simsd acceptance must be one of {', '.join(ACCEPTANCE)}, got {p.acceptance!r}")
        drafting.validate("simsd", p.drafting)
        prompt_lookup.validate("simsd", p.lookup)

    def use_draft(self, engine, target_config) -> None:
        """Draft with `engine`'s model (own KV cache). It must share the target's vocabulary and kind."""
        cfg = engine.config
        if cfg.vocab_size != target_config.vocab_size:
            raise BadInput(f"draft model {engine.name!r} has vocab {cfg.vocab_size}, the target "
                           f"{target_config.vocab_size}: they must share a tokenizer")
        if cfg.logit_shift != target_config.logit_shift:
            raise BadInput("draft and target must both be position-aligned or both right-shifted dLLMs")
        if cfg.mask_token_id is None:
            raise BadInput(f"draft model {engine.name!r} has no MASK token: give --draft-adapter or a preset")
        self.draft_model, self.draft_mask_id, self.draft_name = engine.model, cfg.mask_token_id, engine.name

    def header_params(self) -> dict:
        return dict(super().header_params(), draft_model=self.draft_name)

    # -- caches -----------------------------------------------------------------------------------
    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        super().start(ctx, prompt)
        self.dkv = None
        if self.draft_model is not None:
            self.dkv = self.draft_model.new_cache(ctx.kv.max_len)
            self._draft_extend(ctx, prompt[:self.block.start], "prefill")

    def _draft_extend(self, ctx: DecodeContext, tokens: list[int], role: str) -> None:
        """Write `tokens` into the drafter's own cache (prefill and block commits)."""
        if tokens:
            n = len(tokens)
            ctx.forward(role, tokens, mask=self._commit_mask(ctx, n, self.dkv.length),
                        lora_gate=self.gate(tokens, self.draft_mask_id),
                        logits_rows=[n - 1], model=self.draft_model, kv=self.dkv)
            self.dkv.commit(n)

    def _commit_draft_model(self, ctx: DecodeContext, tokens: list[int]) -> None:
        if self.dkv is not None:
            self._draft_extend(ctx, tokens, "commit")

    def _planner(self, ctx: DecodeContext) -> drafting.BlockPlanner | None:
        """A round's cost: its drafter forwards (γ reveals in `draft_steps`) of the block and one verifying forward.
        With a separate drafter, whose forwards the cost table does not measure, the rounds are not planned."""
        if self.draft_model is not None:
            return None
        p = self.params
        revealed = p.gamma or self.B - 1
        return drafting.BlockPlanner(ctx, self.B, forced=0, draft_forwards=min(p.draft_steps or revealed, revealed),
                                     all_gated=p.adapter_rows == "all")

    # -- rounds -----------------------------------------------------------------------------------
    def step(self, ctx: DecodeContext) -> None:
        b = self.block
        slots = b.masked_slots()
        if not slots:
            self._close(ctx)
        elif self._fall_back(ctx):
            return
        elif slots == list(range(slots[0], b.size)) and len(slots) >= max(1, self.params.gamma):
            self._speculate(ctx, slots)
        else:
            self._denoise(ctx, role="target")

    def _speculate(self, ctx: DecodeContext, slots: list[int]) -> None:
        revealed, q_rows = self._draft_round(ctx, slots)
        order = sorted(revealed, key=lambda j: (revealed[j][0], j))     # draft order: reveal step, then slot
        work = list(self.block.tokens)
        for j in order:
            work[j] = revealed[j][1]
        if self.shift:   # position order, up to the first slot the drafter left masked
            order = slots[:next((k for k, j in enumerate(slots) if j not in revealed), len(slots))]
            if not order:
                self._denoise(ctx, role="target")
                return
        drafts = [revealed[j][1] for j in order]
        q = None if q_rows[order[0]] is None else torch.stack([q_rows[j] for j in order])
        self._propose(ctx, order, drafts, q, "draft_model")

        logits = self._no_mask(ctx, self._target_logits(ctx, work, slots, revealed, order))
        params = SamplingParams(0.0) if self.params.acceptance == "greedy-match" else ctx.sampling
        self._verify_fill(ctx, order, drafts, process_logits(logits, params), q, params)

    def _draft_round(self, ctx: DecodeContext, slots: list[int]):
        """The drafter reveals γ of `slots`. Returns ({slot: (step, token)}, {slot: q row or None})."""
        p = self.params
        n = min(p.gamma or len(slots), len(slots))
        mask_id = ctx.mask_id if self.draft_model is None else self.draft_mask_id
        work = [mask_id if self.block.masked[j] else t for j, t in enumerate(self.block.tokens)]
        model, kv = (None, None) if self.draft_model is None else (self.draft_model, self.dkv)
        revealed: dict[int, tuple[int, int]] = {}
        q_rows: dict[int, torch.Tensor | None] = {}
        for step, k in enumerate(transfer_counts(n, min(p.draft_steps or n, n))):
            open_slots = [j for j in slots if j not in revealed]
            d = self._draft(ctx, "draft", model=model, kv=kv, tokens=work, slots=open_slots, mask_id=mask_id,
                            credit=False)
            for i in (list(range(k)) if self._left_to_right else top_k(d.conf, k)):
                j = d.slots[i]
                revealed[j], work[j] = (step, d.tokens[i]), d.tokens[i]
                q_rows[j] = None if d.q is None else d.q[i]
        return revealed, q_rows

    @property
    def _left_to_right(self) -> bool:
        return self.params.reveal == "left-to-right" or (self.params.reveal == "auto" and self.shift)

    def _target_logits(self, ctx: DecodeContext, work: list[int], slots: list[int], revealed: dict,
                       order: list[int]) -> torch.Tensor:
        """Target logits for the drafted slots in `order`."""
        b = self.block
        if self.shift:
            n = order[-1]
            return ctx.forward("verify", work[:n], lora_gate=self.gate(work[:n], ctx.mask_id),
                               logits_rows=[j - 1 for j in order])
        c = slots[0]                                  # filled prefix = the layout's context rows
        step_map = [revealed[j][0] if j in revealed else -1 for j in slots]
        mask, positions = simsd_temporal(step_map, n_past=b.start, context=c, device=ctx.device)
        data = [work[j] if j in revealed else ctx.mask_id for j in slots]
        tokens = work[:c] + data + [ctx.mask_id] * len(slots)
        rows = [c + len(slots) + (j - c) for j in order]   # the mask copy D~ of each drafted slot
        return ctx.forward("verify", tokens, positions=positions, mask=mask,
                           lora_gate=self.gate(tokens, ctx.mask_id), logits_rows=rows)

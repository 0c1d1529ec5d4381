"""Introspective Strided Decoding (the I-DLM paper's Algorithm 1) and its lossless gated-LoRA variant R-ISD: each
round is one causal forward that verifies the previous round's MASK-row proposals and proposes the next N-1;
MASK-row KV is never committed.

Design: docs/strategies.md#isd
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from studio.engine.sampling import Proposal, process_logits, sample, sample_token
from studio.engine.strategies import drafting
from studio.engine.strategies import lookup as prompt_lookup
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.engine.strategies.params import N, TAU, param
from studio.errors import BadInput

PROPOSALS = ("sample", "argmax")
MODES = ("exact", "reference")


class ISD(Strategy):
    name = "isd"
    needs_mask = True

    @dataclass
    class Params:
        stride: int = param(4, "N: tokens committed per forward when every draft is accepted", role=N, tune=(2, 8))
        proposal: str = param("sample", "sample (d ~ q) | argmax (deterministic draft, exact rule p(d))",
                              choices=PROPOSALS)
        tau: float = param(0.0, "relaxed acceptance (lossy; 0 = exact)", role=TAU)
        mode: str = param("exact", "exact | reference (the I-DLM code's biased argmax + softmax-q scoring)",
                          choices=MODES)
        drafting: str = param("auto", drafting.HELP + " (stride - 1 drafts)", choices=drafting.DRAFTING, tune=True)
        lookup: int = param(2, prompt_lookup.HELP + " (a cold round's, up to stride - 1; exact mode, not under "
                               "bench's oracle)")

    @staticmethod
    def validate(p) -> None:
        if p.stride < 2:
            raise BadInput(f"isd stride must be >= 2, got {p.stride}")
        if p.proposal not in PROPOSALS:
            raise BadInput(f"isd proposal must be 'sample' or 'argmax', got {p.proposal!r}")
        if p.tau < 0:
            raise BadInput(f"isd tau must be >= 0, got {p.tau}")
        if p.mode not in MODES:
            raise BadInput(f"isd mode must be 'exact' or 'reference', got {p.mode!r}")
        drafting.validate("isd", p.drafting)
        prompt_lookup.validate("isd", p.lookup)

    def kv_headroom(self, config=None) -> int:
        return 2 * self.params.stride - 1

    def causal_kv(self, config) -> bool:
        return True   # MASK-row KV is never committed

    def lossless(self) -> bool:
        return self.params.tau == 0 and self.params.mode == "exact"

    # -- rounds ---------------------------------------------------------------------------
    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        p = self.params
        self.drafts: list[int] = []
        self.source = "mask"   # where the drafts the next verify round checks came from: MASK rows, or lookup (ngram)
        # under the oracle a draft's source makes no difference to its verdict: cold rounds stay cold, as in the
        # paper's TPF formula (expected_tpf) that an oracle bench checks
        looks_up = p.lookup and p.mode == "exact" and ctx.oracle_accept is None
        self.lookup = prompt_lookup.ContextLookup(prompt, p.lookup) if looks_up else None
        self.planner = drafting.DraftPlanner(ctx, p.stride - 1) if self.plans_drafts else None
        self.lookup_planner = drafting.DraftPlanner(ctx, p.stride - 1) \
            if self.plans_drafts and looks_up else None
        n_mask = self._n_mask(ctx, verifying=0, prefill=True)
        P = len(prompt)
        logits = ctx.forward("prefill", prompt + [ctx.mask_id] * n_mask,
                             lora_gate=self._gate(ctx, P, n_mask), logits_rows=list(range(P - 1, P + n_mask)))
        ctx.commit(P)
        self._clean_and_propose(ctx, logits, already_emitted=0)

    def step(self, ctx: DecodeContext) -> None:
        if not self.drafts:
            self._look_up(ctx)
        if self.drafts:
            self._verify_round(ctx)
        else:
            self._cold_round(ctx)

    def _look_up(self, ctx: DecodeContext) -> None:
        """A round without MASK-row drafts (after a rejection, or when none paid) verifies drafts copied from the
        context where its last tokens occurred before (`lookup`): as many as pay under drafting=auto. They are
        deterministic functions of the tokens so far, verified by the deterministic rule: exact as before."""
        if self.lookup is None:
            return
        self.lookup.follow(ctx.out)
        looked = self.lookup.drafts(self.params.stride - 1)
        if looked and self.lookup_planner is not None:
            # the forward's plan event is its MASK rows' (_n_mask); these drafts show as propose{src: ngram}
            k = self.lookup_planner.plan(lambda reach, cost: drafting.chain_rate(reach, cost, ctx.clean_gate),
                                         limit=len(looked), report=False)
            looked = looked[:k]
        if looked:
            self.drafts, self.q, self.q_logits, self.source = looked, None, None, "ngram"

    def _cold_round(self, ctx: DecodeContext) -> None:
        n_mask = self._n_mask(ctx, verifying=0)
        logits = ctx.forward("cold", [self.pending] + [ctx.mask_id] * n_mask, lora_gate=self._gate(ctx, 1, n_mask))
        ctx.commit(1)
        self._clean_and_propose(ctx, logits, already_emitted=0)

    def _verify_round(self, ctx: DecodeContext) -> None:
        k = len(self.drafts)
        n_mask = self._n_mask(ctx, verifying=k)
        logits = ctx.forward("verify", [self.pending] + self.drafts + [ctx.mask_id] * n_mask,
                             lora_gate=self._gate(ctx, 1 + k, n_mask))
        base = self.pending_pos + 1
        if self.source == "ngram":
            ctx.event("propose", pos=list(range(base, base + k)), tok=self.drafts, q=[1.0] * k, src="ngram")
        reference = self.params.mode == "reference"
        # p and q are process_logits of these rows, except in reference mode (the untruncated softmax)
        raw = None if reference else (logits[:k], self.q_logits)
        res = ctx.verify(list(range(base, base + k)), self.drafts, self._target_probs(ctx, logits[:k]), self.q,
                         self._proposal(ctx), logits=raw, tau=self.params.tau, reference=reference)
        a = res.n_accepted
        planner = self.lookup_planner if self.source == "ngram" else self.planner
        if planner:
            planner.observe(k, a)
        if a < k:
            accepted = self.drafts[:a]
            ctx.commit(1 + a)
            self.pending, self.pending_pos, self.drafts = res.correction, base + a, []
            ctx.emit(accepted + [res.correction])
            return
        ctx.commit(1 + k)
        self._clean_and_propose(ctx, logits[k:], already_emitted=k, bonus=True)

    # -- pieces ---------------------------------------------------------------------------
    def _n_mask(self, ctx: DecodeContext, verifying: int, prefill: bool = False) -> int:
        """MASK rows in the next forward: the drafts of the round after it (all stride - 1, or as many as pay). A plan
        spends no rows on drafts that cannot become output: after this forward writes its `verifying` drafts and
        clean token, the round after it writes its own token after the drafts it accepts."""
        if self.planner is None:
            return self.params.stride - 1
        room = ctx.out.draft_room(written=verifying + 1)
        return self.planner.plan(lambda reach, cost: drafting.isd_rate(reach, cost, ctx.clean_gate),
                                 limit=room, prefill=prefill)

    def _clean_and_propose(self, ctx: DecodeContext, logits: torch.Tensor, already_emitted: int,
                           bonus: bool = False) -> None:
        """Row 0 of `logits` gives the next clean token; rows 1..N-1 (MASK rows) the next drafts."""
        pos = ctx.n_out + already_emitted
        clean, _ = sample_token(logits[0], ctx.sampling, ctx.gen)
        if bonus:
            ctx.event("bonus", pos=pos, tok=clean)
        accepted = self.drafts if bonus else []
        self.pending, self.pending_pos = clean, pos
        self.drafts, self.q = self._propose(ctx, logits[1:], pos + 1)
        self.source = "mask"
        self.q_logits = None if self.q is None else logits[1:]
        ctx.emit(accepted + [clean])

    def _propose(self, ctx: DecodeContext, mask_logits: torch.Tensor, first_pos: int):
        """Draft tokens from the MASK rows, with the distribution q each was drawn from."""
        if not len(mask_logits):
            return [], None
        if self._argmax_drafts(ctx):
            tokens = mask_logits.argmax(-1)
            q = self._draft_q_reference(ctx, mask_logits) if self.params.mode == "reference" else None
        else:
            q = process_logits(mask_logits, ctx.sampling)
            tokens = sample(q, ctx.gen)
        drafts = tokens.tolist()
        q_of = [1.0] * len(drafts) if q is None else q.gather(1, tokens[:, None])[:, 0].tolist()
        ctx.event("propose", pos=list(range(first_pos, first_pos + len(drafts))), tok=drafts, q=q_of, src="mask")
        return drafts, q

    def _argmax_drafts(self, ctx: DecodeContext) -> bool:
        p = self.params
        return ctx.sampling.greedy or p.proposal == "argmax" or p.mode == "reference"

    def _proposal(self, ctx: DecodeContext) -> Proposal:
        deterministic = self.source == "ngram" or self._argmax_drafts(ctx)
        return Proposal.DETERMINISTIC if deterministic else Proposal.SAMPLED

    def _target_probs(self, ctx: DecodeContext, logits: torch.Tensor) -> torch.Tensor:
        if self.params.mode == "reference" and not ctx.sampling.greedy:
            # the reference scores with the untruncated softmax(logits / T)
            return torch.softmax(logits / ctx.sampling.temperature, dim=-1)
        return process_logits(logits, ctx.sampling)

    @staticmethod
    def _draft_q_reference(ctx: DecodeContext, mask_logits: torch.Tensor) -> torch.Tensor | None:
        if ctx.sampling.greedy:
            return None
        return torch.softmax(mask_logits / ctx.sampling.temperature, dim=-1)

    @staticmethod
    def _gate(ctx: DecodeContext, n_clean: int, n_mask: int) -> list[bool]:
        """The clean rows decode the adapter's model (`Strategy.clean_gate`); the MASK rows always read the LoRA."""
        return [ctx.clean_gate] * n_clean + [True] * n_mask

    def expected_tpf(self, accept: float) -> float | None:
        return None if self.plans_drafts else expected_tpf(accept, self.params.stride)


class RISD(ISD):
    """R-ISD: the adapter is gated on at MASK rows only, so clean rows and their KV are base-only and
    the output follows the base model exactly."""
    name = "r-isd"

    def clean_gate(self, adapter) -> bool:
        return False   # by design, whatever rows the adapter adapts: lossless with respect to the base model


def expected_tpf(p: float, n: int) -> float:
    """ISD tokens per forward at per-token acceptance p (the I-DLM paper, appendix B)."""
    return (2 + sum(p ** i for i in range(1, n - 1))) / (2 - p ** (n - 1))

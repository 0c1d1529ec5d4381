"""Plain autoregressive decoding: the baseline every other strategy is measured against.

On a masked-diffusion model `ar` is the model's AR mode, where it has one: a shifted model (Dream, an AR model with a
bidirectional adapter) reads its next-token rows under a causal mask; a position-aligned block-causal model (LLaDA2)
decodes at block size 1 -- each forward is the pending token and one MASK after it, whose row predicts the next
token, under a causal mask (block-causal with blocks of 1). A bidirectional position-aligned model (LLaDA) has no AR
mode and is refused; its one-token-per-step decode is `canvas` (compare and bench use it as their baseline there).
"""
from __future__ import annotations

from dataclasses import dataclass

from studio.engine.sampling import sample_token
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.errors import BadInput


def has_ar_mode(config) -> bool:
    """Whether a model decodes token by token under a causal mask: trained causal, shifted (its rows predict the next
    token), or block-causal and position-aligned (block size 1: a MASK after the pending token)."""
    return config.attention == "causal" or config.logit_shift or config.attention == "block"


class AR(Strategy):
    name = "ar"
    wide_forwards = False
    needs_causal_model = False   # the AR mode of a diffusion model too (check_run)

    def lossless(self) -> bool:
        return True

    @dataclass
    class Params:
        pass

    def causal_kv(self, config) -> bool:
        return True

    @classmethod
    def fits(cls, config) -> bool:
        return config.attention != "canvas" and has_ar_mode(config)

    @classmethod
    def misfit(cls, config, name: str) -> str:
        if config.attention == "canvas":
            return super().misfit(config, name)
        return (f"ar: {name!r} was trained with {config.attention} attention and position-aligned logits: it has no "
                "AR mode (its one-token-per-step decode is canvas)")

    def check_run(self, config, max_new_tokens: int) -> None:
        if not config.logit_shift and config.mask_token_id is None:
            raise BadInput(f"ar: {config.name or 'this model'} is position-aligned (a MASK's row predicts its token) "
                           "and has no MASK token: give a model preset with mask_token_id")

    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        self.mask_row = not ctx.model.config.logit_shift   # position-aligned: the next token is a MASK's row
        tokens = prompt + [ctx.mask_id] * self.mask_row
        logits = ctx.forward("prefill", tokens, logits_rows=[len(tokens) - 1])
        ctx.commit(len(prompt))
        self._next(ctx, logits[0])

    def step(self, ctx: DecodeContext) -> None:
        logits = ctx.forward("extend", [self.pending] + [ctx.mask_id] * self.mask_row, logits_rows=[int(self.mask_row)])
        ctx.commit(1)
        self._next(ctx, logits[0])

    def _next(self, ctx: DecodeContext, row) -> None:
        if self.mask_row:   # a MASK's row may predict MASK itself: never a token of the output
            row = row.clone()
            row[ctx.mask_id] = float("-inf")
        self.pending, _ = sample_token(row, ctx.sampling, ctx.gen)
        ctx.emit([self.pending])

"""Plain autoregressive decoding: the baseline every other strategy is measured against."""
from __future__ import annotations

from dataclasses import dataclass

from studio.engine.sampling import sample_token
from studio.engine.strategies.base import DecodeContext, Strategy


class AR(Strategy):
    name = "ar"

    @dataclass
    class Params:
        pass

    def causal_kv(self, config) -> bool:
        return True

    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        logits = ctx.forward("prefill", prompt, logits_rows=[len(prompt) - 1])
        ctx.commit(len(prompt))
        self._next(ctx, logits[0])

    def step(self, ctx: DecodeContext) -> None:
        logits = ctx.forward("extend", [self.pending])
        ctx.commit(1)
        self._next(ctx, logits[0])

    def _next(self, ctx: DecodeContext, row) -> None:
        self.pending, _ = sample_token(row, ctx.sampling, ctx.gen)
        ctx.emit([self.pending])

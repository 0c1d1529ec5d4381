"""DiffusionGemma's own decoding loop as a strategy: canvases of uniform noise after the prompt, each denoised by
the model's bidirectional decoder pass (one pass per step) and, once done, committed through its causal encoder pass.
The sampler -- the temperature schedule, the entropy bound, the renoising, the stop -- is studio.engine.gemma_sampler.

The prompt's encoder pass is the prefill. A canvas of C tokens (the model's canvas_length, 256) then takes up to
`max_denoising_steps` decoder passes (role `draft`), each over the canvas as it stands, reading the committed K/V and
writing the canvas's own past them, never committed. The canvas's argmax on its last step is final: emitted up to an
EOS, and, if the output goes on, written into the cache by the encoder at the positions it was denoised at (its own
step: a `commit` forward and a `kv commit`) before the next canvas opens. Output grows in whole canvases
(ceil(--max-new-tokens / C) at most, the last cut at --max-new-tokens), as transformers' generate does.

Design: docs/strategies.md#gemma-canvas
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from studio.engine.gemma_sampler import DenoiseStep, NoiseCanvas, Schedule
from studio.engine.graphs import PassGraphs
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.engine.strategies.params import N, TAU, param
from studio.errors import BadInput


class ModelPass:
    """One of DiffusionGemma's two passes with the call `DecodeContext.forward` makes of a model, so that each is a
    `forward` event and counts like any other."""

    def __init__(self, model):
        self.model = model

    def modules(self):   # what the context counts the experts run over
        return self.model.modules()


class EncoderPass(ModelPass):
    """The causal encoder pass: it writes the K/V of its tokens (the strategy commits them) and returns the final
    hidden states, which nothing reads."""

    def __call__(self, tokens, positions, kv, mask=None, lora_gate=None, logits_rows=None) -> torch.Tensor:
        return self.model.encode(tokens, positions, kv)


class DecoderPass(ModelPass):
    """The bidirectional decoder pass over a canvas, self-conditioned on `self_conditioning` (the previous step's
    tempered logits [C, V]; None on a canvas's first step). With `graphs` (a run under CUDA graphs), the
    self-conditioned passes -- every one of a canvas after its first -- replay a graph captured per canvas."""
    self_conditioning: torch.Tensor | None = None

    def __init__(self, model, graphs: bool = False):
        super().__init__(model)
        self.graphs = PassGraphs(self._conditioned, model.lm_head.weight.device) if graphs else None

    def _conditioned(self, tokens, positions, kv, sc) -> torch.Tensor:
        return self.model(tokens, positions, kv, self_conditioning=sc[None])

    def __call__(self, tokens, positions, kv, mask=None, lora_gate=None, logits_rows=None) -> torch.Tensor:
        sc = self.self_conditioning
        if self.graphs is not None and sc is not None and mask is None and lora_gate is None and logits_rows is None:
            return self.graphs(tokens, positions, kv, sc)
        return self.model(tokens, positions, kv, mask=mask, lora_gate=lora_gate, logits_rows=logits_rows,
                          self_conditioning=None if sc is None else sc[None])


class GemmaCanvas(Strategy):
    name = "gemma-canvas"
    needs_causal_model = False   # it runs the model's own two passes
    decodes_ar_models = False
    own_sampling = True          # its temperature schedule

    @dataclass
    class Params:
        canvas_length: int = param(0, "C: tokens denoised together, a canvas after the prompt, then one after each "
                                      "committed canvas; 0 = the model's (256)", role=N)
        max_denoising_steps: int = param(48, "decoder passes per canvas at most")
        t_min: float = param(0.4, "the temperature schedule t_min + (t_max - t_min) * n / N at step n = N .. 1")
        t_max: float = param(0.8, "the temperature of the first step")
        entropy_bound: float = param(0.1, "a step keeps the lowest-entropy draws while the entropies before each sum "
                                          "to at most this (at least one); the rest become noise again", role=TAU)
        stability_threshold: int = param(1, "a canvas stops once its argmax canvas is the same as on the last this "
                                            "many steps (0 = always) and it is confident")
        confidence_threshold: float = param(0.005, "confident: the mean entropy of a step is below this (0 = never: "
                                                   "every canvas takes max_denoising_steps)")

    @classmethod
    def validate(cls, p) -> None:
        if p.canvas_length < 0 or p.max_denoising_steps < 1 or p.stability_threshold < 0:
            raise BadInput(f"{cls.name}: canvas_length must be >= 0 (0 = the model's), max_denoising_steps >= 1 and "
                           "stability_threshold >= 0")
        if p.entropy_bound <= 0 or p.confidence_threshold < 0:
            raise BadInput(f"{cls.name}: entropy_bound must be > 0 and confidence_threshold >= 0")
        if not 0 < p.t_min <= p.t_max:
            raise BadInput(f"{cls.name}: the temperatures must satisfy 0 < t_min <= t_max, got {p.t_min}, {p.t_max}")

    def block_size(self, config) -> int:
        """C: the params', else the model's canvas length."""
        return self.params.canvas_length or config.block_size

    @classmethod
    def fits(cls, config) -> bool:
        return config.attention == "canvas"

    @classmethod
    def misfit(cls, config, name: str) -> str:
        return (f"{cls.name}: {name!r} is not a DiffusionGemma model; {cls.name} runs DiffusionGemma's own "
                "encoder/decoder passes (canvas decodes masked-diffusion models)")

    def header_fields(self, config, max_new_tokens: int) -> dict:
        C = self.block_size(config)
        return {"canvas": {"length": -(-max_new_tokens // C) * C, "block_size": C}}

    def kv_headroom(self, config=None) -> int:
        # the last canvas's decoder pass writes C slots past the committed ones, up to C - 1 past --max-new-tokens
        return self.block_size(config)

    def schedule(self) -> Schedule:
        p = self.params
        return Schedule(p.max_denoising_steps, p.t_min, p.t_max, p.entropy_bound, p.stability_threshold,
                        p.confidence_threshold)

    # -- the loop -------------------------------------------------------------------------------
    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        cfg = ctx.model.config
        if not self.fits(cfg):
            raise BadInput(self.misfit(cfg, cfg.name))
        self.C = self.block_size(cfg)
        self.encoder, self.decoder = EncoderPass(ctx.model), DecoderPass(ctx.model, graphs=ctx.graphs)
        self.sc_dtype = ctx.model.lm_head.weight.dtype   # the embedding's (tied)
        ctx.forward("prefill", prompt, model=self.encoder)
        ctx.commit(len(prompt))
        self.start_pos = 0          # output position of the open canvas's first cell
        self.finished_canvas: list[int] | None = None   # committed, waiting for its encoder pass
        self._open(ctx)

    def _open(self, ctx: DecodeContext) -> None:
        self.canvas = NoiseCanvas(self.C, ctx.model.config.vocab_size, self.schedule(), ctx.gen, self.sc_dtype)
        ctx.event("block", op="open", start=self.start_pos, end=self.start_pos + self.C)
        ctx.event("remask", pos=self._pos(range(self.C)), tok=self.canvas.tokens.tolist())   # the canvas shows noise

    def _pos(self, cells) -> list[int]:
        return [self.start_pos + int(i) for i in cells]

    def step(self, ctx: DecodeContext) -> None:
        if self.finished_canvas is not None:   # its K/V, which the next canvas reads, come from the encoder
            ctx.forward("commit", self.finished_canvas, model=self.encoder)
            ctx.commit(self.C)
            self.start_pos += self.C
            self.finished_canvas = None
            self._open(ctx)
            return
        self.decoder.self_conditioning = self.canvas.self_conditioning
        logits = ctx.forward("draft", self.canvas.tokens.tolist(), model=self.decoder)
        s = self.canvas.step(logits)
        if s.done:
            self._finish(ctx, s)
        else:
            self._report(ctx, s)

    def _report(self, ctx: DecodeContext, s: DenoiseStep) -> None:
        """The canvas as this step leaves it: accepted draws shown (unmask), the rest noise again (remask) with the
        model's draw there as its current proposal."""
        kept = s.accepted.nonzero()[:, 0]
        renoised = (~s.accepted).nonzero()[:, 0]
        if len(renoised):
            ctx.event("propose", pos=self._pos(renoised), tok=s.drawn[renoised].tolist(),
                      q=s.drawn_prob[renoised].tolist(), src="diffusion")
        ctx.event("unmask", pos=self._pos(kept), tok=s.drawn[kept].tolist(), conf=s.drawn_prob[kept].tolist())
        if len(renoised):
            ctx.event("remask", pos=self._pos(renoised), tok=s.noise[renoised].tolist())

    def _finish(self, ctx: DecodeContext, s: DenoiseStep) -> None:
        """The last step: the argmax canvas replaces the sampled one and is final; emitted up to an EOS (the cells
        after it are padding, filled and never emitted) or --max-new-tokens."""
        tokens = s.argmax.tolist()
        ctx.event("unmask", pos=self._pos(range(self.C)), tok=tokens, conf=s.argmax_prob.tolist())
        ctx.emit(tokens)
        ctx.event("block", op="close", start=self.start_pos, end=self.start_pos + self.C)
        if not ctx.out.finished:
            self.finished_canvas = tokens

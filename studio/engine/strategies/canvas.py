"""Canvas decoding, LLaDA's pipeline and Fast-dLLM's parallel rules: the prompt followed by a canvas of
--max-new-tokens MASKs (LLaDA's gen_length), filled in semi-autoregressive blocks. Each step is one forward over the
prompt and the whole canvas -- later blocks' MASKs included -- under the attention the model was trained with
(bidirectional for LLaDA and Dream, block-causal on its grid for LLaDA2, causal for an AR model), and a rule that fills
some of the open block's MASKs; a filled token is never changed. `cache = none` recomputes every K/V each step: exact,
the reference of the cached variants.

Fill rules: LLaDA's fixed schedule (a block's MASKs spread over its share of `steps`, `remasking` low_confidence:
the most confident first, or random), Dream's (`schedule = dream`: int(masked * (1 - s/t)) per step, by confidence,
margin or entropy, or `origin`), Fast-dLLM's `threshold` (every MASK above it, at least the best one) and `factor`
(the n best while the n-th confidence stays above 1 - factor/(n+1)). `cfg_scale` is LLaDA's classifier-free
guidance: a second forward with the prompt masked, logits = un + (cfg + 1)(cond - un).

Design: docs/strategies.md#canvas
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from studio.engine.kv_cache import WindowWrite
from studio.engine.masks import bidirectional, block_causal, causal
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.engine.strategies.blockdiff import BlockDiffusion
from studio.engine.strategies.unmasking import (Credit, DecoderParams, Draft, select_dynamic, select_hierarchical,
                                               top_k, transfer_counts)
from studio.engine.strategies.params import N, TAU, param
from studio.errors import BadInput

REMASKING = ("low_confidence", "random", "margin", "entropy", "origin")
SCHEDULES = ("linear", "dream")
CACHES = ("none", "prefix", "dual")
ATTENTIONS = ("model", "bidirectional", "block", "causal")


def select_factor(conf: list[float], factor: float) -> list[int]:
    """Fast-dLLM's factor rule: confidences sorted descending c_1 >= c_2 >= ...; the n best are taken while
    c_n >= 1 - factor/(n+1) (c_1 always); as its code does, a miss at the last candidate still takes them all."""
    order = sorted(range(len(conf)), key=lambda i: -conf[i])
    n = next((i for i, j in enumerate(order) if i and conf[j] < 1 - factor / (i + 2)), len(order))
    if n == len(order) - 1:
        n = len(order)
    return sorted(order[:max(n, 1)])


class Canvas(Strategy):
    name = "canvas"
    needs_mask = True
    needs_causal_model = False   # its attention is the model's own
    decodes_ar_models = False    # an AR model has no canvas attention (-p attention=causal names one)

    @dataclass
    class Params(DecoderParams):
        block_size: int = param(0, "B: the canvas is filled block by block; 0 = the model's block size, else the "
                                   "whole canvas (LLaDA's block_length)", role=N,
                                tune=[4, 8, 16, 32])   # each divides the canvases bench and tune decode (32, 64, 128)
        steps: int = param(0, "denoising steps over the whole canvas, shared equally by its blocks; 0 = one per "
                              "token (LLaDA's steps)")
        remasking: str = param("low_confidence", "which MASKs a scheduled step fills: the most confident (LLaDA; "
                                                 "Dream's maskgit_plus), random ones (LLaDA), the largest top-1 - top-2 "
                                                 "margin or the lowest entropy (Dream's topk_margin, entropy), or each "
                                                 "with the step's share as its probability (Dream's origin)",
                               choices=REMASKING)
        schedule: str = param("linear", "how many MASKs a step fills: linear (LLaDA: a block's MASKs spread evenly "
                                        "over its steps) | dream (int(masked * (1 - s/t)) over t = linspace(1, eps, "
                                        "steps + 1), all on the last step)", choices=SCHEDULES)
        eps: float = param(1e-3, "the dream schedule's last time")
        alg_temp: float = param(0.0, "Dream: 0 = the k best scores; > 0 = k positions drawn by softmax(score / "
                                     "alg_temp)")
        threshold: float = param(0.0, "Fast-dLLM: fill every MASK of the block above this confidence, at least "
                                      "the best one (0 = the fixed schedule)", role=TAU, tune=(0.3, 0.99))
        factor: float = param(0.0, "Fast-dLLM factor rule (0 = off; e.g. 1.0)")
        cfg_scale: float = param(0.0, "classifier-free guidance: logits = un + (cfg+1)(cond - un), un with the prompt "
                                      "masked (LLaDA; 0 = off, one forward per step)")
        cache: str = param("none", "none: every step recomputes the prompt and canvas K/V (exact) | prefix: the K/V "
                                   "before the open block kept from its first step, each step forwards the block and "
                                   "the canvas after it | dual: the K/V after it kept too, each step forwards the block "
                                   "(Fast-dLLM)", choices=CACHES, tune=True)
        refresh_every: int = param(0, "prefix/dual: also rebuild the cache every n steps of a block (dInfer's "
                                      "cache_update_freq; 0 = at block starts only; 1 = every step, as cache=none)")
        prefix_look: int = param(0, "prefix/dual: dInfer's vicinity refresh -- every step also recomputes the K/V of "
                                    "this many positions before the block (dInfer's presets: 16)")
        after_look: int = param(0, "dual: the vicinity refresh's positions after the block (dInfer's presets: 16)")
        warmup_steps: int = param(0, "prefix/dual: the run's first n steps are full forwards without the cache "
                                     "(dInfer's vicinity warmup; its presets: 4)")
        cont_weight: float = param(0.0, "dInfer's iteration smoothing: a MASK still open after a step is fed its "
                                        "MASK embedding + w times its expected token embedding (softmax(logits) @ E) "
                                        "next step, w growing to this; the threshold then decays from 1 to its own "
                                        "(0 = off; dInfer's presets: 0.3)")
        cont_weight_init: float = param(0.15, "iteration smoothing: w at the run's first step")
        cont_weight_growth: float = param(0.02, "iteration smoothing: w's growth per step")
        threshold_decay: float = param(0.02, "iteration smoothing: the threshold is max(1 - this * step, threshold)")
        early_stop: bool = param(False, "stop once the output reaches EOS (dInfer's early termination); off: the "
                                        "canvas after an early EOS is decoded to its end as padding, as LLaDA, "
                                        "Fast-dLLM and Dream do (the padding is never output)")
        attention: str = param("model", "the canvas forward's attention: the model's own (bidirectional for LLaDA and "
                                        "Dream, block-causal on its block grid for LLaDA2, SDAR and Fast-dLLM v2), or "
                                        "one named", choices=ATTENTIONS)

    @classmethod
    def validate(cls, p) -> None:
        if p.block_size < 0 or p.steps < 0:
            raise BadInput(f"{cls.name} block_size and steps must be >= 0 (0 = default)")
        if not 0.0 <= p.threshold <= 1.0:
            raise BadInput(f"{cls.name} threshold must be in [0, 1], got {p.threshold}")
        if p.factor < 0 or p.cfg_scale < 0:
            raise BadInput(f"{cls.name} factor and cfg_scale must be >= 0")
        if p.threshold and p.factor:
            raise BadInput(f"{cls.name}: give threshold or factor, not both")
        if min(p.refresh_every, p.prefix_look, p.after_look, p.warmup_steps) < 0:
            raise BadInput(f"{cls.name} refresh_every, prefix_look, after_look and warmup_steps must be >= 0")
        if (p.prefix_look or p.after_look or p.warmup_steps) and p.cache == "none":
            raise BadInput(f"{cls.name}: prefix_look, after_look and warmup_steps refresh a cache: give cache=prefix "
                           "or dual")
        if p.after_look and p.cache != "dual":
            raise BadInput(f"{cls.name}: after_look refreshes K/V after the block, which only cache=dual keeps")
        if min(p.cont_weight, p.cont_weight_init, p.cont_weight_growth, p.threshold_decay) < 0:
            raise BadInput(f"{cls.name} cont_weight, cont_weight_init, cont_weight_growth and threshold_decay must be "
                           ">= 0")
        if p.cont_weight and p.cfg_scale:
            raise BadInput(f"{cls.name}: iteration smoothing (cont_weight) and guidance (cfg_scale) do not combine")
        DecoderParams.check(cls.name, p)
        if p.cfg_scale and p.cache != "none":
            raise BadInput(f"{cls.name}: guidance (cfg_scale) runs with cache=none only")
        if not 0 < p.eps < 1 or p.alg_temp < 0:
            raise BadInput(f"{cls.name} eps must be in (0, 1) and alg_temp >= 0")
        for name, value, choices in (("remasking", p.remasking, REMASKING), ("schedule", p.schedule, SCHEDULES),
                                     ("cache", p.cache, CACHES),
                                     ("attention", p.attention, ATTENTIONS)):
            if value not in choices:
                raise BadInput(f"{cls.name} {name} must be one of {', '.join(choices)}, got {value!r}")

    def check_run(self, config, max_new_tokens: int) -> None:
        """The canvas (--max-new-tokens) must split into whole blocks and the steps among them; an AR model has no
        canvas attention of its own."""
        B = self.block_size(config, max_new_tokens)
        if max_new_tokens % B:
            raise BadInput(f"canvas: --max-new-tokens {max_new_tokens} (the canvas) is not a multiple of the block "
                           f"size {B}")
        steps = self.params.steps or max_new_tokens
        if steps % (max_new_tokens // B):
            raise BadInput(f"canvas: steps {steps} do not divide among {max_new_tokens // B} blocks of {B}")
        if self.attention(config) is None:
            raise BadInput(f"canvas: {config.name or 'this model'} is an AR model, trained with causal attention and no "
                           "blocks: it decodes no canvas (a masked-diffusion model does; -p attention=causal runs it "
                           "anyway)")
        if self.params.cache == "dual" and self.attention(config) != "bidirectional":
            raise BadInput("canvas: cache=dual keeps the K/V of the canvas after the block, which a block-causal or "
                           "causal forward never reads: give cache=prefix (exact under that attention)")

    def exact_reference(self) -> dict | None:
        p = self.params
        if p.cache == "none":
            return None
        return {"cache": "none", "refresh_every": 0, "prefix_look": 0, "after_look": 0, "warmup_steps": 0}

    def header_fields(self, config, max_new_tokens: int) -> dict:
        return {"canvas": {"length": max_new_tokens, "block_size": self.block_size(config, max_new_tokens)}}

    def block_size(self, config, canvas: int = 0) -> int:
        """B: the params', else the model's, else the whole canvas (0 while its length is not known)."""
        return self.params.block_size or config.block_size or canvas

    def attention(self, config) -> str | None:
        """The canvas forward's attention; None for an AR model asked for its own."""
        if self.params.attention != "model":
            return self.params.attention
        if config.attention == "causal":   # SDAR, Fast-dLLM v2: causal K/V, trained block-causal
            return "block" if config.block_size else None
        return config.attention

    # -- the canvas -------------------------------------------------------------------------------
    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        cfg, p = ctx.model.config, self.params
        G = ctx.out.max_new_tokens
        self.check_run(cfg, G)
        self.B = B = self.block_size(cfg, G)
        self.steps_per_block = (p.steps or G) // (G // B)
        self.P = len(prompt)
        self.mask_id = ctx.mask_id
        self.tokens = prompt + [ctx.mask_id] * G
        self.mode, self.model_block = self.attention(cfg), cfg.block_size or B
        self.shift = int(cfg.logit_shift)   # a shifted model's row for position i is i - 1
        self.emitted_upto = self.P
        self.block_start = self.P
        self.steps_run = 0   # the run's steps (the vicinity warmup and iteration smoothing count them)
        self.soft: dict[int, torch.Tensor] = {}   # iteration smoothing: position -> w * expected token embedding
        self._open(ctx)

    def _open(self, ctx: DecodeContext) -> None:
        self.block_step = 0
        self.cached = False   # the block's first cached step (re)builds a prefix or dual cache
        self.at_open = self.B
        self.credit = Credit(self.params)
        ctx.event("block", op="open", start=self.block_start - self.P, end=self.block_start + self.B - self.P)

    def _masked(self) -> list[int]:
        return [i for i in range(self.block_start, self.block_start + self.B) if self.tokens[i] == self.mask_id]

    def kv_headroom(self, config=None) -> int:
        return 1   # the canvas is the run's --max-new-tokens: its K/V fit the run's slots

    def graph_tokens(self) -> int | None:
        return None   # every forward is canvas-wide, and of a few shapes a run: each replays its own graph

    def finished(self, ctx: DecodeContext) -> bool:
        """Over once the output is, except that after an early EOS the canvas is decoded to its end as padding
        unless `early_stop`."""
        return ctx.out.finished and not self._decoding_padding(ctx)

    def _decoding_padding(self, ctx: DecodeContext) -> bool:
        return (not self.params.early_stop and ctx.out.stop_reason == "eos"
                and self.block_start < len(self.tokens))

    # -- one step ---------------------------------------------------------------------------------
    def step(self, ctx: DecodeContext) -> None:
        slots = self._masked()
        logits = self._logits(ctx, slots)
        if self.params.decoder == "credit":
            logits = self.credit.fuse([s - self.block_start for s in slots], logits, self.B)
        d = Draft.from_logits(slots, logits, ctx.sampling, ctx.gen)
        ctx.event("propose", pos=[s - self.P for s in slots], tok=d.tokens, q=d.conf, src="diffusion")
        chosen = self._select(ctx, d)
        for i in chosen:
            self.tokens[d.slots[i]] = d.tokens[i]
            self.soft.pop(d.slots[i], None)
        ctx.event("unmask", pos=[d.slots[i] - self.P for i in chosen], tok=[d.tokens[i] for i in chosen],
                  conf=[d.conf[i] for i in chosen])
        self.block_step += 1
        self.steps_run += 1
        self._emit_ready(ctx)
        if not self._masked():
            ctx.event("block", op="close", start=self.block_start - self.P, end=self.block_start + self.B - self.P)
            self.block_start += self.B
            if self.block_start < len(self.tokens) and (not ctx.out.finished or self._decoding_padding(ctx)):
                self._open(ctx)

    def _logits(self, ctx: DecodeContext, slots: list[int]) -> torch.Tensor:
        """The rows predicting `slots` (MASK excluded): from one forward over prompt + canvas (two with guidance),
        or, on a step that reuses the cache, over the window of the canvas the cache does not hold."""
        p, n = self.params, len(self.tokens)
        rebuild = not self.cached or (p.refresh_every and self.block_step % p.refresh_every == 0)
        if p.cache == "none" or self.steps_run < p.warmup_steps or rebuild:
            lo, hi = 0, n
        elif p.cache == "prefix":   # a shifted model's first slot is predicted by the row before it
            lo, hi = max(0, self._prefix_end() - max(p.prefix_look, self.shift)), n
        else:
            lo = max(0, self.block_start - max(p.prefix_look, self.shift))
            hi = min(n, self.block_start + self.B + p.after_look)
        # iteration smoothing reads every MASK of the window, the fill rule the open block's
        wanted = slots + ([i for i in range(max(lo, self.P), hi) if self.tokens[i] == self.mask_id and i not in slots]
                          if p.cont_weight else [])
        rows = [s - self.shift - lo for s in wanted]
        shift = self._embed_shift(ctx, lo, hi)
        if p.cache == "none" or self.steps_run < p.warmup_steps:
            logits = self._full(ctx, rows, shift)
        elif rebuild:   # keep what later steps reuse: the prefix, or everything (dual)
            logits = self._full(ctx, rows, shift)
            kept = self._prefix_end() if p.cache == "prefix" else n
            ctx.commit(kept)
            ctx.event("kv", op="refresh", from_len=0, to_len=kept)
            self.cached = True
        elif p.cache == "prefix":
            logits = self._prefix_step(ctx, lo, rows, shift)
        else:
            logits = self._dual_step(ctx, lo, hi, rows, shift)
        if p.cfg_scale:
            unprompted = [ctx.mask_id] * self.P + self.tokens[self.P:]
            un = ctx.forward("draft", unprompted, mask=self._mask_for(ctx, n, 0), logits_rows=rows)
            logits = un + (p.cfg_scale + 1) * (logits - un)
        logits = BlockDiffusion._no_mask(ctx, logits)
        if p.cont_weight:
            self._smooth(ctx, wanted, logits)
        return logits[:len(slots)]

    def _full(self, ctx: DecodeContext, rows: list[int], shift) -> torch.Tensor:
        """A fresh forward over prompt + canvas (nothing cached is read)."""
        ctx.rollback(0)
        return ctx.forward("draft", self.tokens, mask=self._mask_for(ctx, len(self.tokens), 0), logits_rows=rows,
                           embed_shift=shift)

    def _prefix_step(self, ctx: DecodeContext, lo: int, rows: list[int], shift) -> torch.Tensor:
        """The block and the canvas after it against the cached prefix; the prefix's positions from `lo` on are
        recomputed too and kept (dInfer's vicinity refresh, and a shifted model's row before the block)."""
        n, start = len(self.tokens), self._prefix_end()
        ctx.rollback(lo)
        logits = ctx.forward("draft", self.tokens[lo:], torch.arange(lo, n, device=ctx.device),
                             mask=self._mask_for(ctx, n - lo, lo), logits_rows=rows, embed_shift=shift)
        if lo < start:
            ctx.commit(start - lo)
            ctx.event("kv", op="refresh", from_len=lo, to_len=start)
        return logits

    def _dual_step(self, ctx: DecodeContext, lo: int, hi: int, rows: list[int], shift) -> torch.Tensor:
        """The window [lo, hi) -- the block, and around it dInfer's vicinity and a shifted model's row before it --
        its K/V written over the cached ones, the rest as cached."""
        n = len(self.tokens)
        logits = ctx.forward("draft", self.tokens[lo:hi], torch.arange(lo, hi, device=ctx.device),
                             mask=torch.ones(hi - lo, n, dtype=torch.bool, device=ctx.device),
                             logits_rows=rows, kv=WindowWrite(ctx.kv, lo), embed_shift=shift)
        if (lo, hi) != (self.block_start, self.block_start + self.B):
            ctx.event("kv", op="refresh", from_len=lo, to_len=hi)
        return logits

    # -- iteration smoothing (dInfer) -----------------------------------------------------------------
    def _smooth(self, ctx: DecodeContext, slots: list[int], logits: torch.Tensor) -> None:
        """Each MASK read this step is fed, next step, its MASK embedding + w * softmax(its logits) @ E (dInfer's
        H2Embed, τ = 1), w = min(init + growth * step, cont_weight); a filled position drops it."""
        p = self.params
        w = min(p.cont_weight_init + p.cont_weight_growth * self.steps_run, p.cont_weight)
        table = ctx.model.model.embed_tokens.weight
        expected = torch.softmax(logits.float(), dim=-1) @ table[:logits.shape[-1]].float()
        self.soft.update(zip(slots, w * expected))

    def _embed_shift(self, ctx: DecodeContext, lo: int, hi: int) -> torch.Tensor | None:
        """The smoothing added to the embeddings of the forward over [lo, hi), or None."""
        held = [i for i in range(lo, hi) if i in self.soft]
        if not held:
            return None
        shift = torch.zeros(hi - lo, ctx.model.config.dim, device=ctx.device)
        shift[[i - lo for i in held]] = torch.stack([self.soft[i] for i in held])
        return shift

    def _threshold(self) -> float:
        """The fill threshold of this step: with iteration smoothing it decays from 1 to the set one."""
        p = self.params
        if not p.cont_weight:
            return p.threshold
        return max(1 - p.threshold_decay * self.steps_run, p.threshold)

    def _prefix_end(self) -> int:
        """Where a prefix cache ends: the open block's start, or under block-causal attention the start of the model's
        grid block holding it (K/V of the grid block's earlier positions see the open block: they are recomputed)."""
        if self.mode == "block":
            return self.block_start // self.model_block * self.model_block
        return self.block_start

    def _mask_for(self, ctx: DecodeContext, n_new: int, n_past: int) -> torch.Tensor:
        if self.mode == "causal":
            return causal(n_new, n_past, device=ctx.device)
        if self.mode == "block":   # the model's own block grid, from position 0
            return block_causal(n_new, n_past, self.model_block, offset=n_past % self.model_block, device=ctx.device)
        return bidirectional(n_new, n_past, device=ctx.device)

    def _select(self, ctx: DecodeContext, d: Draft) -> list[int]:
        p = self.params
        threshold = self._threshold()
        if p.decoder == "hierarchical":   # threshold 0: its run rule alone, as dInfer's threshold=None
            return select_hierarchical(d.conf, d.slots, threshold or 1.0, p.low_threshold)
        if p.threshold:
            return select_dynamic(d.conf, 1, threshold)
        if p.factor:
            return select_factor(d.conf, p.factor)
        n, last = len(d.slots), self.block_step >= self.steps_per_block - 1
        if p.schedule == "linear":
            quota = max(1, min(transfer_counts(self.at_open, self.steps_per_block)[min(self.block_step,
                                                                                       self.steps_per_block - 1)], n))
            share = torch.tensor(quota / n)
        else:   # Dream: a step may fill none; the last fills the rest
            t = torch.linspace(1, p.eps, self.steps_per_block + 1)
            share = 1 - t[self.block_step + 1] / t[self.block_step] if not last else torch.tensor(1.0)
            quota = n if last else int(n * share)
        if p.remasking == "origin":   # each MASK with the step's share (Dream's origin); the last step fills the rest
            draws = torch.rand(n, generator=ctx.gen, device=ctx.device).cpu()
            return list(range(n)) if last else [i for i in range(n) if draws[i] < share]
        score = self._scores(ctx, d)
        if p.alg_temp and quota:
            weights = torch.softmax(torch.tensor(score, device=ctx.device) / p.alg_temp, dim=0)
            return sorted(torch.multinomial(weights, quota, replacement=False, generator=ctx.gen).tolist())
        return top_k(score, quota)

    def _scores(self, ctx: DecodeContext, d: Draft) -> list[float]:
        """Each MASK's claim to be filled now: its confidence, a random draw, its top-1 - top-2 margin, or its
        negative entropy."""
        kind = self.params.remasking
        if kind == "random":
            return torch.rand(len(d.conf), generator=ctx.gen, device=ctx.device).tolist()
        if kind == "margin":
            top = d.dist.topk(2, dim=-1).values
            return (top[:, 0] - top[:, 1]).tolist()
        if kind == "entropy":
            return torch.special.xlogy(d.dist, d.dist).sum(-1).tolist()
        return d.conf

    def _emit_ready(self, ctx: DecodeContext) -> None:
        """Emit the filled positions that continue the output without a gap."""
        j, toks = self.emitted_upto, []
        while j < len(self.tokens) and self.tokens[j] != ctx.mask_id:
            toks.append(self.tokens[j])
            j += 1
        if toks:
            self.emitted_upto = j
            ctx.emit(toks)

"""Block diffusion with confidence-threshold unmasking (dInfer / Fast-dLLM / SDAR / LLaDA2), the baseline S2D2 and
SimSD are measured against, and the machinery they share: blocks at multiples of B, one forward of the open block per
step, an unmasking rule, LLaDA2.1's token editing, and a commit forward that writes each finished block's KV.

Design: docs/strategies.md#blockdiff
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from studio.engine.masks import bidirectional, block_causal, partially_causal_draft
from studio.engine.sampling import Proposal, SamplingParams, process_logits, sample_token
from studio.engine.strategies import drafting
from studio.engine.strategies import lookup as prompt_lookup
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.engine.strategies.editing import select_edits
from studio.engine.strategies.params import N, TAU, param
from studio.engine.strategies.unmasking import (Credit, DecoderParams, Draft, select_dynamic, select_hierarchical,
                                               top_k, transfer_counts)
from studio.errors import BadInput

DEFAULT_BLOCK = 4   # SDAR's training block size; used when neither the params nor the model give one
SCHEDULES = ("dynamic", "static")
ADAPTER_ROWS = ("mask", "all")
CACHES = ("auto", "block", "causal")


@dataclass
class OpenBlock:
    start: int              # absolute position of slot 0 (= the committed KV length while it is open)
    tokens: list[int]       # the MASK id at masked slots
    masked: list[bool]
    n_masked_at_open: int
    step: int = 0           # denoising steps taken in this block
    post_steps: int = 0     # editing: forwards taken after the block was full
    settled: bool = False   # editing: a forward of the full block edited nothing

    @property
    def size(self) -> int:
        return len(self.tokens)

    def masked_slots(self) -> list[int]:
        return [j for j, m in enumerate(self.masked) if m]

    def fill(self, slot: int, tok: int) -> None:
        self.tokens[slot], self.masked[slot] = tok, False


def is_d2f(config) -> bool:
    """A bidirectional masked-diffusion model (Dream, LLaDA) with a block adapter attached (an adapter whose config
    records the block size it was trained at): a D2F student, trained block-causal behind a bidirectional prompt."""
    return config.attention == "bidirectional" and config.adapter_block_size is not None


class BlockDiffusion(Strategy):
    name = "blockdiff"
    needs_mask = True
    needs_causal_model = False   # its masks are its own: block-causal drafts fit a bidirectional model too
    edits = True                 # its denoising step can run LLaDA2.1's token editing

    @dataclass
    class Params(DecoderParams):
        block_size: int = param(0, "B; 0 = the model's block_size (SDAR 4, Fast-dLLM v2 32), else the block "
                                   "adapter's training block size, else 4", role=N)
        steps: int = param(0, "S denoising steps per block; 0 = B (one token per step at least)")
        schedule: str = param("dynamic", "dynamic (threshold + quota) | static (quota only)", choices=SCHEDULES)
        threshold: float = param(0.9, "τ: the confidence that unmasks a slot; Fast-dLLM / dInfer serving default "
                                      "(S2D2's SDAR configs use 0.85)", role=TAU, tune=(0.3, 0.99))
        cache: str = param("auto", "prefill/commit attention: block (bidirectional in a block) | causal (S2D2 "
                                   'cache_ver, "AR-like caching") | auto: block for native dLLMs (the model has a '
                                   "block_size), causal for an AR model + adapter", choices=CACHES)
        causal_prefix: bool = param(False, "partially causal drafting: decoded prefix rows causal (S2D2 draft_ver)")
        adapter_rows: str = param("mask", "where an adapter applies: MASK rows only (R-ISD style) | all rows",
                                  choices=ADAPTER_ROWS)
        edit_threshold: float = param(1.0, "τ_edit, LLaDA2.1's token editing: a filled slot of the open block whose "
                                           "prediction differs and is more probable than this takes the prediction "
                                           "(1 = no editing; LLaDA2.1 default 0.9)")
        max_post_steps: int = param(16, "editing: forwards a full block may still take while they edit it (LLaDA2.1 "
                                        "default)")

    @classmethod
    def validate(cls, p) -> None:
        if p.block_size < 0 or p.steps < 0:
            raise BadInput(f"{cls.name} block_size and steps must be >= 0 (0 = default)")
        if p.adapter_rows not in ADAPTER_ROWS:
            raise BadInput(f"{cls.name} adapter_rows must be one of {', '.join(ADAPTER_ROWS)}, got {p.adapter_rows!r}")
        if p.cache not in CACHES:
            raise BadInput(f"{cls.name} cache must be one of {', '.join(CACHES)}, got {p.cache!r}")
        if p.schedule not in SCHEDULES:
            raise BadInput(f"{cls.name} schedule must be one of {', '.join(SCHEDULES)}, got {p.schedule!r}")
        for f in ("threshold", "edit_threshold"):
            if not 0.0 <= getattr(p, f) <= 1.0:
                raise BadInput(f"{cls.name} {f} must be in [0, 1], got {getattr(p, f)}")
        DecoderParams.check(cls.name, p)
        if p.max_post_steps < 0:
            raise BadInput(f"{cls.name} max_post_steps must be >= 0, got {p.max_post_steps}")
        if p.edit_threshold < 1 and not cls.edits:
            raise BadInput(f"{cls.name} has no token editing: edit_threshold must be 1")
        if p.edit_threshold < 1 and p.causal_prefix:
            raise BadInput(f"{cls.name}: token editing reads every row of the block bidirectionally, causal_prefix "
                           "makes the decoded rows causal: give one of them")

    def check_run(self, config, max_new_tokens: int) -> None:
        if self.editing and config.logit_shift:
            raise BadInput(f"{self.name}: token editing (edit_threshold < 1) is LLaDA2.1's, for position-aligned "
                           f"models; {config.name or 'this model'} is right-shifted")

    @property
    def editing(self) -> bool:
        return self.params.edit_threshold < 1.0

    def block_size(self, config) -> int:
        """B: the params', else the native dLLM's, else the block adapter's training block, else 4."""
        return self.params.block_size or (config and (config.block_size or config.adapter_block_size)) or DEFAULT_BLOCK

    def kv_headroom(self, config=None) -> int:
        return 3 * self.block_size(config)   # a block past the last token + a 2B-row verifier

    def causal_commits(self, config) -> bool:
        """The causal cache (S2D2's "AR-like caching"); block-attention KV depends on where blocks fall. `auto` is
        causal only for an AR model (no native block size, trained causal): a dLLM gets the block cache."""
        return self.params.cache == "causal" or (self.params.cache == "auto" and config.block_size is None
                                                 and config.attention == "causal")

    def causal_kv(self, config) -> bool:
        return self.causal_commits(config) and not is_d2f(config)   # a D2F prompt is bidirectional

    def prefill_gate(self, ctx: DecodeContext) -> bool:
        return self.params.adapter_rows == "all"   # `gate` of a clean token

    # -- blocks -----------------------------------------------------------------------------------
    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        cfg = ctx.model.config
        self.B = self.block_size(cfg)
        self.S = self.params.steps or self.B
        self.shift = cfg.logit_shift
        self.causal_cache = self.causal_commits(cfg)
        self.prompt_len = P = len(prompt)
        self.emitted_upto = P     # absolute position of the next token to emit
        # blocks on a grid from position 0 where the model was trained on one (SDAR, Fast-dLLM v2, LLaDA2: the prompt's
        # tail opens the first block); from the prompt's end behind a bidirectional prompt (D2F), and on an AR model
        # with a block adapter (trained at free block starts) whose cache is causal: its prefill is then ar's and
        # gives the first token, where a tail in the first block cost one wider forward more than ar
        self.d2f = is_d2f(cfg)
        free_start = self.d2f or (self.shift and self.causal_cache and cfg.block_size is None)
        aligned = P if free_start else P // self.B * self.B
        pending = []
        if aligned:
            logits = self._prefill(ctx, prompt[:aligned])
            if self.shift and aligned == P:
                pending = [self._next_token(ctx, logits[-1])]
        self.planner = self._planner(ctx) if self.plans_drafts and self._can_fall_back() else None
        self.lookup, self.lookup_planner = self._prompt_lookup(ctx, prompt)
        self._open(ctx, aligned, prompt[aligned:] + pending)

    def _can_fall_back(self) -> bool:
        """Whether committing the open block's filled prefix is the model's own next-token step, so that cost-aware
        drafting may fall back to it: on a right-shifted model whose cache is causal (an AR model with a block
        adapter). A native dLLM's block cache and a D2F prompt are not causal; editing may still change a prefix."""
        return self.shift and self.causal_cache and not self.d2f and not self.editing

    def _planner(self, ctx: DecodeContext) -> drafting.BlockPlanner | None:
        """The cost-aware planner of a verifying strategy (S2D2, SimSD: `drafting = "auto"`); blockdiff has none."""
        return None

    def _prompt_lookup(self, ctx: DecodeContext, prompt: list[int]):
        """(context, planner) for prompt lookup on the AR steps cost-aware drafting falls back to (S2D2, SimSD:
        `lookup`); (None, None) without. Its planner has a regret of its own: the block planner's refused cycles would
        otherwise hold back the copied drafts, which cost a few percent of a step where the cycles cost whole steps.
        Not under the oracle, whose verdicts would make copied drafts as good as the strategy's own."""
        shortest = getattr(self.params, "lookup", 0)
        if self.planner is None or not shortest or ctx.oracle_accept is not None:
            return None, None
        return prompt_lookup.ContextLookup(prompt, shortest), drafting.DraftPlanner(ctx, self.B - 1)

    def _prefill(self, ctx: DecodeContext, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        mask = bidirectional(n, 0, device=ctx.device) if self.d2f else self._commit_mask(ctx, n, 0)
        logits = ctx.forward("prefill", tokens, mask=mask, lora_gate=self.gate(tokens, ctx.mask_id),
                             logits_rows=[n - 1])
        ctx.commit(n)
        return logits

    def _commit_mask(self, ctx: DecodeContext, n: int, n_past: int) -> torch.Tensor | None:
        if self.causal_cache:
            return None   # the model's own causal mask over the committed KV: an AR step builds no mask tensor
        return block_causal(n, n_past, self.B, offset=0, device=ctx.device)

    def _open(self, ctx: DecodeContext, start: int, filled: list[int]) -> None:
        n_mask = self.B - len(filled)
        self.block = OpenBlock(start, filled + [ctx.mask_id] * n_mask, [False] * len(filled) + [True] * n_mask,
                               n_mask)
        self.credit = Credit(self.params)
        ctx.event("block", op="open", start=max(0, start - self.prompt_len), end=start + self.B - self.prompt_len)
        self._emit_ready(ctx)

    def _close(self, ctx: DecodeContext, upto: int | None = None, looked_up: list[int] = ()) -> None:
        """Commit forward: write the finished block's KV (and, right-shifted, predict the next block's slot 0). With
        editing the block's tokens become final only now; nothing more is computed once they end the output.
        `upto`: commit only the block's first `upto` (filled) slots and open the next block after them: cost-aware
        drafting's fallback, a plain AR step when one slot is filled (the close event names the block as opened).
        `looked_up`: with `upto`, drafts copied from the context after those slots, verified by the same forward's
        rows (as an AR model verifies a chain): the accepted ones are committed too, the next block opens after them."""
        b = self.block
        if self.editing:
            self._emit_ready(ctx, final=True)
            if ctx.out.finished:
                return
        n = b.size if upto is None else upto
        tokens = b.tokens[:n] + list(looked_up)
        logits = ctx.forward("commit", tokens, mask=self._commit_mask(ctx, len(tokens), b.start),
                             lora_gate=self.gate(tokens, ctx.mask_id), logits_rows=list(range(n - 1, len(tokens))))
        if looked_up:
            accepted, after = self._verify_looked_up(ctx, n, tokens[n:], logits)
        else:
            accepted, after = 0, self._next_token(ctx, logits[0]) if self.shift else None
        n += accepted
        ctx.commit(n)
        self._commit_draft_model(ctx, tokens[:n])
        ctx.event("block", op="close", start=max(0, b.start - self.prompt_len), end=b.start + b.size - self.prompt_len)
        self._open(ctx, b.start + n, [] if after is None else [after])

    def _verify_looked_up(self, ctx: DecodeContext, n: int, drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
        """Verify drafts copied from the context at the open block's slots n.. against rows 1.. of the commit forward
        of its first n slots (row 0 predicts slot n): deterministic functions of the tokens so far, so the
        deterministic-draft rule keeps the run exact. Emits the accepted ones; returns (how many, the token after
        them: the correction, or the bonus read on the last row)."""
        k = len(drafts)
        slots = list(range(n, n + k))
        self._propose(ctx, slots, drafts, None, "ngram")
        p = process_logits(self._no_mask(ctx, logits[:k]), ctx.sampling)
        res = ctx.verify([self.out_pos(j) for j in slots], drafts, p, None, Proposal.DETERMINISTIC)
        self.lookup_planner.observe(k, res.n_accepted)
        accepted = drafts[:res.n_accepted]
        if accepted:
            ctx.emit(accepted)
            self.emitted_upto += len(accepted)
        after = res.correction if res.correction is not None else self._next_token(ctx, logits[k])
        return len(accepted), after

    def _commit_draft_model(self, ctx: DecodeContext, tokens: list[int]) -> None:
        """Hook for strategies that keep a second model's cache in step (SimSD): `tokens` were just committed."""

    def _fall_back(self, ctx: DecodeContext) -> bool:
        """Cost-aware drafting: when drafting the open block's masked suffix does not pay, commit its filled prefix
        instead (the step's forward). Returns whether it did (never without a planner, or while the filled slots are
        not a prefix)."""
        b = self.block
        slots = b.masked_slots()
        if self.planner is None or not slots or not slots[0] or slots != list(range(slots[0], b.size)):
            return False
        if self.planner.draft_pays(filled=slots[0], masked=len(slots)):
            return False
        self._close(ctx, upto=slots[0], looked_up=self._looked_up(ctx, filled=slots[0]))
        return True

    def _looked_up(self, ctx: DecodeContext, filled: int) -> list[int]:
        """Drafts for an AR step committing `filled` slots: the tokens that followed the context's last tokens where
        they occurred before (`lookup`), as many as pay by the costs and their own acceptance so far."""
        if self.lookup is None:
            return []
        self.lookup.follow(ctx.out)
        looked = self.lookup.drafts(self.B - 1)
        if not looked:
            return []
        gated = self.planner.all_gated   # the block planner's reading of the adapter's rows: clean rows gated too
        k = self.lookup_planner.plan(lambda reach, cost: drafting.chain_rate(reach, cost, gated,
                                                                             rows=filled + len(reach)),
                                     limit=len(looked), report=False)
        return looked[:k]

    def _next_token(self, ctx: DecodeContext, row: torch.Tensor) -> int:
        tok, _ = sample_token(self._no_mask(ctx, row[None])[0], ctx.sampling, ctx.gen)
        return tok

    def _emit_ready(self, ctx: DecodeContext, final: bool = False) -> None:
        """Emit the filled slots that continue the output without a gap (with editing, only when the block closes:
        until then an edit may still change them)."""
        if self.editing and not final:
            return
        b, toks = self.block, []
        j = self.emitted_upto - b.start
        while 0 <= j < b.size and not b.masked[j]:
            toks.append(b.tokens[j])
            j += 1
        if toks:
            self.emitted_upto += len(toks)
            ctx.emit(toks)

    def out_pos(self, slot: int) -> int:
        return self.block.start + slot - self.prompt_len

    # -- one denoising step -------------------------------------------------------------------------
    def step(self, ctx: DecodeContext) -> None:
        if not any(self.block.masked) and not self._post_step():
            self._close(ctx)
        elif not self._fall_back(ctx):
            self._denoise(ctx, role="draft")

    def _post_step(self) -> bool:
        """Whether a full block takes one more forward (LLaDA2.1: up to `max_post_steps`, until one edits nothing)."""
        b = self.block
        if not self.editing or b.settled or b.post_steps >= self.params.max_post_steps:
            return False
        b.post_steps += 1
        return True

    def _denoise(self, ctx: DecodeContext, role: str) -> None:
        """One forward of the open block and the unmasking rule (the whole blockdiff step)."""
        d = self._draft_step(ctx, role)
        self._unmask(ctx, d, self._select(d, self._quota()))
        self.block.step += 1

    def _draft_step(self, ctx: DecodeContext, role: str) -> Draft:
        """The step's forward of the open block: the drafter's view of its masked slots, and with editing on, LLaDA2.1's
        edits of its filled slots read from the same forward, applied before anything else."""
        if not self.editing:
            return self._draft(ctx, role)
        b = self.block
        masked = b.masked_slots()
        filled = [j for j in range(b.size) if not b.masked[j]]
        both = self._draft(ctx, role, slots=masked + filled)
        edited = self._edit(ctx, both.subset(list(range(len(masked), len(both.slots)))))
        if not masked and not edited:
            b.settled = True
        return both.subset(list(range(len(masked))))

    def _edit(self, ctx: DecodeContext, e: Draft) -> int:
        """T2T: replace the filled slots of `e` whose prediction differs and beats τ_edit, the prompt's excepted.
        Returns how many."""
        b = self.block
        old = [b.tokens[j] for j in e.slots]
        editable = [b.start + j >= self.prompt_len for j in e.slots]
        chosen = select_edits(old, e.tokens, e.conf, editable, self.params.edit_threshold)
        for i in chosen:
            b.tokens[e.slots[i]] = e.tokens[i]
        if chosen:
            ctx.event("edit", pos=[self.out_pos(e.slots[i]) for i in chosen], old=[old[i] for i in chosen],
                      tok=[e.tokens[i] for i in chosen], conf=[e.conf[i] for i in chosen])
        return len(chosen)

    def _draft(self, ctx: DecodeContext, role: str = "draft", model=None, kv=None, tokens: list[int] | None = None,
               slots: list[int] | None = None, mask_id: int | None = None, credit: bool = True) -> Draft:
        """Forward the open block (bidirectional) and read the distributions at `slots` (default: the
        masked ones). `tokens` overrides the block's tokens (SimSD's drafter fills its own copy, with its
        own `mask_id`)."""
        b = self.block
        tokens = b.tokens if tokens is None else tokens
        slots = b.masked_slots() if slots is None else slots
        rows = [j - 1 for j in slots] if self.shift else slots
        gate = self.gate(tokens, ctx.mask_id if mask_id is None else mask_id)
        logits = ctx.forward(role, tokens, mask=self._draft_mask(ctx, slots), lora_gate=gate,
                             logits_rows=rows, model=model, kv=kv)
        logits = self._no_mask(ctx, logits)
        if credit and self.params.decoder == "credit":
            logits = self.credit.fuse(slots, logits, self.B)
        return Draft.from_logits(slots, logits, ctx.sampling, ctx.gen)

    def gate(self, tokens: list[int], mask_id: int | None) -> list[bool]:
        """LoRA gate per row. With `adapter_rows = "mask"` the model is the base on clean tokens and
        base + adapter on MASK tokens (the R-ISD convention for an AR model + adapter), so committed KV and
        right-shifted verification stay base-only; "all" is for adapters that are the whole dLLM."""
        if self.params.adapter_rows == "all":
            return [True] * len(tokens)
        return [t == mask_id for t in tokens]

    def _draft_mask(self, ctx: DecodeContext, slots: list[int]) -> torch.Tensor:
        b = self.block
        if self.params.causal_prefix:
            return partially_causal_draft(b.size, b.start, slots[0] if slots else b.size, device=ctx.device)
        return block_causal(b.size, b.start, b.size, device=ctx.device)

    @staticmethod
    def _no_mask(ctx: DecodeContext, logits: torch.Tensor) -> torch.Tensor:
        if ctx.mask_id is not None and ctx.mask_id < logits.shape[-1]:
            logits = logits.clone()
            logits[..., ctx.mask_id] = float("-inf")
        return logits

    def _quota(self) -> int:
        b = self.block
        counts = transfer_counts(b.n_masked_at_open, self.S)
        return max(1, min(counts[min(b.step, self.S - 1)], len(b.masked_slots())))

    def _select(self, d: Draft, quota: int) -> list[int]:
        """Indices into `d` of the slots to unmask this step."""
        p = self.params
        if p.decoder == "hierarchical":
            return select_hierarchical(d.conf, d.slots, p.threshold, p.low_threshold)
        if p.schedule == "static":
            return top_k(d.conf, quota)
        return select_dynamic(d.conf, quota, p.threshold)

    def _propose(self, ctx: DecodeContext, slots: list[int], drafts: list[int], q: torch.Tensor | None,
                 src: str) -> None:
        """The drafts about to be verified, with q(d) (1.0 for greedy drafts)."""
        if q is None:
            q_of = [1.0] * len(drafts)
        else:
            q_of = q.gather(1, torch.tensor(drafts, device=q.device)[:, None])[:, 0].tolist()
        ctx.event("propose", pos=[self.out_pos(j) for j in slots], tok=drafts, q=q_of, src=src)

    def _verify_fill(self, ctx: DecodeContext, slots: list[int], drafts: list[int], p: torch.Tensor,
                     q: torch.Tensor | None, sampling: SamplingParams | None = None, forced: int = 0, **rule) -> int:
        """Verify the sampled drafts at `slots` (`ctx.verify`; `forced` as there) and fill the accepted ones and the
        correction into the block. Returns the number of slots filled."""
        res = ctx.verify([self.out_pos(j) for j in slots], drafts, p, q, Proposal.SAMPLED, sampling, forced=forced,
                         **rule)
        if self.planner:
            self.planner.observe(len(drafts) - forced, max(0, res.n_accepted - forced))
        filled = drafts[:res.n_accepted] + ([] if res.correction is None else [res.correction])
        for j, t in zip(slots, filled):
            self.block.fill(j, t)
        self._emit_ready(ctx)
        return len(filled)

    def _unmask(self, ctx: DecodeContext, d: Draft, chosen: list[int]) -> None:
        if not chosen:
            return
        for i in chosen:
            self.block.fill(d.slots[i], d.tokens[i])
        ctx.event("unmask", pos=[self.out_pos(d.slots[i]) for i in chosen], tok=[d.tokens[i] for i in chosen],
                  conf=[d.conf[i] for i in chosen])
        self._emit_ready(ctx)

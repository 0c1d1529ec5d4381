"""Jacobi decoding and Jacobi MR (multi-block decoding + rejection recycling) on a causal AR model.

Both are exact: the drafts are deterministic (argmax) proposals checked with the deterministic-draft rule, so
greedy output equals greedy AR token for token and sampled output has the AR law. The last committed token
(`pending`) is not in the KV cache yet: every forward starts with it and extends the committed KV.

Design: docs/strategies.md#jacobi and docs/strategies.md#jacobi-mr (layouts, draft initialisation, pseudo
blocks, rejection recycling, the tree of the window and the candidates, events).
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

import torch

from studio.engine.draft_tree import DraftTree
from studio.engine.sampling import Proposal, process_logits, sample_token
from studio.engine.strategies import drafting
from studio.engine.strategies.base import DecodeContext, Strategy
from studio.engine.strategies import lookup as prompt_lookup
from studio.engine.strategies.params import N, param
from studio.errors import BadInput

INITS = ("context", "repeat-last")
MODES = ("intended", "reference")


class _JacobiBase(Strategy):
    """Shared by Jacobi and Jacobi MR: draft initialisation and the exact verification of one chain."""

    def causal_kv(self, config) -> bool:
        return True   # only verified tokens are committed, each over its causal prefix

    def lossless(self) -> bool:
        return True   # every committed token passed the exact rule (reference mode drops progress, not exactness)

    def _setup(self, ctx: DecodeContext, prompt: list[int]) -> None:
        cfg = getattr(ctx.model, "config", None)
        if cfg is not None and not getattr(cfg, "logit_shift", True):
            raise BadInput(f"strategy {self.name!r} needs a causal model with logit shift (hidden i predicts "
                           "token i+1); this model is position-aligned")
        self.prompt = list(prompt)
        self.rng = random.Random(ctx.gen.initial_seed())   # draft init only, never the sampler's stream
        n = self.params.block_size
        self.lookup = prompt_lookup.ContextLookup(self.prompt, self.params.lookup) if self.params.lookup else None
        # looked-up drafts are right far more often than the window's own guesses: each source has its own
        # acceptance by slot, so neither one's record decides whether the other is worth its rows
        self.planners = {src: drafting.DraftPlanner(ctx, n) for src in ("jacobi", "ngram")} \
            if self.plans_drafts else {}
        self.source = "jacobi"   # where this forward's first drafts came from

    def _look_up(self, ctx: DecodeContext, k: int) -> list[int]:
        """Up to k drafts copied from the context (`lookup`), [] where its last tokens never occurred before; sets
        the source of the forward's first drafts."""
        looked = []
        if self.lookup is not None:
            self.lookup.follow(ctx.out)
            looked = self.lookup.drafts(k)
        self.source = "ngram" if looked else "jacobi"
        return looked

    def _plan(self, ctx: DecodeContext, open_drafts: int, looked: int = 0, full_rows: int | None = None) -> int:
        """How many of the `open_drafts` drafts the next forward verifies: all of them, or under `drafting="auto"`
        as many as pay (0: a plain AR step), at most the `looked` looked-up ones when there are any. `full_rows`:
        what the forward with all of them costs in rows, when it carries more than the chain (Jacobi MR's pseudo
        blocks and candidates). A plan spends no rows on drafts that cannot become output: the forward writes a token
        of its own after the drafts it accepts."""
        planner = self.planners.get(self.source)
        if planner is None:
            return open_drafts
        room = ctx.out.draft_room()
        return planner.plan(lambda reach, cost: drafting.chain_rate(
            reach, cost, ctx.clean_gate, full_rows if len(reach) == open_drafts else None),
            limit=min(looked or open_drafts, room))

    def _propose(self, ctx: DecodeContext, base: int, drafts: list[int], looked: int) -> None:
        """The propose events of a forward's chain: its looked-up drafts (src ngram), then the window's own."""
        for src, first, toks in (("ngram", 0, drafts[:looked]), ("jacobi", looked, drafts[looked:])):
            if toks:
                ctx.event("propose", pos=list(range(base + first, base + first + len(toks))), tok=toks,
                          q=[1.0] * len(toks), src=src)

    def _init_tokens(self, ctx: DecodeContext, k: int) -> list[int]:
        """k fresh draft tokens by the `init` rule."""
        if k <= 0:
            return []
        out = ctx.out.token_ids
        if self.params.init == "repeat-last":
            return [out[-1] if out else self.prompt[-1]] * k
        P, n_ctx = len(self.prompt), len(self.prompt) + len(out)
        idx = [self.rng.randrange(n_ctx) for _ in range(k)]
        return [self.prompt[i] if i < P else out[i - P] for i in idx]

    def _decide(self, ctx: DecodeContext, drafts: list[int], p: torch.Tensor, target_logits: torch.Tensor,
                bonus_logits: torch.Tensor, base: int) -> tuple[int, list[int]]:
        """Verify deterministic drafts at output positions base.. against p (one row per draft; the processed
        `target_logits`); emit the verdict events. Returns (accepted count, the new tokens: accepted drafts +
        correction or bonus). No drafts: a plain AR step."""
        k = len(drafts)
        if not k:
            return 0, [sample_token(bonus_logits, ctx.sampling, ctx.gen)[0]]
        res = ctx.verify(list(range(base, base + k)), drafts, p, None, Proposal.DETERMINISTIC,
                         logits=(target_logits, None))
        a = res.n_accepted
        if self.source in self.planners:
            self.planners[self.source].observe(k, a)
        if a < k:
            return a, drafts[:a] + [res.correction]
        bonus, _ = sample_token(bonus_logits, ctx.sampling, ctx.gen)
        ctx.event("bonus", pos=base + k, tok=bonus)
        return a, drafts + [bonus]


def _check_common(name: str, p) -> None:
    drafting.validate(name, p.drafting)
    if p.block_size < 1:
        raise BadInput(f"{name} block_size must be >= 1, got {p.block_size}")
    if p.init not in INITS:
        raise BadInput(f"{name} init must be one of {', '.join(INITS)}, got {p.init!r}")
    if p.max_iters < 1:
        raise BadInput(f"{name} max_iters must be >= 1, got {p.max_iters}")
    prompt_lookup.validate(name, p.lookup)


class Jacobi(_JacobiBase):
    """Greedy fixed-point (Jacobi) iteration on a running window of n drafts; exact (docs/strategies.md#jacobi)."""
    name = "jacobi"

    @dataclass
    class Params:
        block_size: int = param(16, "n: drafts verified per forward", role=N, tune=(2, 16))
        init: str = param("context", "context (reference: tokens drawn from prompt + output) | repeat-last",
                          choices=INITS)
        max_iters: int = param(128, "safety cap: iterations without a fully accepted window before the drafts "
                                    "are re-initialised (each iteration commits >= 1 token anyway)")
        drafting: str = param("auto", drafting.HELP + " (of the n drafts)", choices=drafting.DRAFTING, tune=True)
        lookup: int = param(2, prompt_lookup.HELP + " (the window's first)")

    @staticmethod
    def validate(p) -> None:
        _check_common("jacobi", p)

    def kv_headroom(self, config=None) -> int:
        return self.params.block_size + 1

    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        self._setup(ctx, prompt)
        n, P = self.params.block_size, len(prompt)
        init = self._init_tokens(ctx, n)
        logits = ctx.forward("prefill", prompt + init, logits_rows=list(range(P - 1, P + n)))
        ctx.commit(P)
        first, _ = sample_token(logits[0], ctx.sampling, ctx.gen)
        self.drafts = logits[1:].argmax(-1).tolist()   # init token at position i predicts position i + 1
        self.pending, self.iters = first, 0
        ctx.emit([first])

    def step(self, ctx: DecodeContext) -> None:
        n, base = len(self.drafts), ctx.n_out
        looked = self._look_up(ctx, n)
        self.drafts[:len(looked)] = looked
        k = self._plan(ctx, n, len(looked))
        d, unsent = self.drafts[:k], self.drafts[k:]
        logits = ctx.forward("jacobi", [self.pending] + d)
        self._propose(ctx, base, d, min(len(looked), k))
        a, new = self._decide(ctx, d, process_logits(logits[:k], ctx.sampling), logits[:k], logits[k], base)
        ctx.commit(1 + a)
        self.pending = new[-1]
        ctx.emit(new)
        self.iters += 1
        if (k and a == k) or self.iters >= self.params.max_iters:
            self.drafts, self.iters = self._init_tokens(ctx, n), 0
        else:
            # rows a+1..k predict the positions after the new pending token (the Jacobi update), the last one the
            # position of the first draft this forward did not carry; the others stay as they were
            kept = logits[a + 1:].argmax(-1).tolist() + unsent[1:]
            self.drafts = kept + self._init_tokens(ctx, n - len(kept))


@dataclass
class _Block:
    start: int        # first output position; the block covers [start, start + n)
    acc: int = 0      # pseudo-accepted (frozen) leading tokens


class JacobiMR(_JacobiBase):
    """Multi-block Jacobi decoding with rejection recycling (Jacobi Forcing, appendix A, Algorithm 1); exact."""
    name = "jacobi-mr"

    @dataclass
    class Params:
        block_size: int = param(64, "n: the size of each block", role=N, tune=(2, 16))
        blocks: int = param(2, "K: real-active + up to K-1 pseudo-active blocks", tune=(1, 4))
        spawn_ratio: float = param(0.85, "r: spawn a pseudo block when the newest block has ceil(r n) accepted",
                                   tune=(0.5, 0.95))
        pool_size: int = param(4, "n-gram pool entries kept = most candidates verified per forward (0 = off)")
        init: str = param("context", "context | repeat-last: how a new block's drafts start", choices=INITS)
        mode: str = param("intended", "intended | reference (drop the promoted block's progress and the pool)",
                          choices=MODES)
        max_iters: int = param(128, "safety cap: iterations on one real-active block before its open drafts "
                                    "are re-initialised")
        drafting: str = param("auto", drafting.HELP + ": the whole layout (the real-active block's open drafts, the "
                                      "pseudo blocks, the candidates), or the first drafts of the real-active block "
                                      "alone", choices=drafting.DRAFTING, tune=True)
        lookup: int = param(2, prompt_lookup.HELP + " (the real-active block's first)")

    @staticmethod
    def validate(p) -> None:
        _check_common("jacobi-mr", p)
        if p.blocks < 1:
            raise BadInput(f"jacobi-mr blocks (K) must be >= 1, got {p.blocks}")
        if not (0.0 < p.spawn_ratio <= 1.0) or math.isnan(p.spawn_ratio):
            raise BadInput(f"jacobi-mr spawn_ratio (r) must be in (0, 1], got {p.spawn_ratio}")
        if p.pool_size < 0:
            raise BadInput(f"jacobi-mr pool_size must be >= 0, got {p.pool_size}")
        if p.mode not in MODES:
            raise BadInput(f"jacobi-mr mode must be one of {', '.join(MODES)}, got {p.mode!r}")

    def kv_headroom(self, config=None) -> int:
        p = self.params
        return 1 + p.block_size * (p.blocks + p.pool_size)

    # -- state ----------------------------------------------------------------------------
    # guess: output position -> current draft token, for every open position in [n_out, horizon);
    # ra_end: end of the real-active block; pseudo: the pseudo-active blocks, contiguous after ra_end.

    def _horizon(self) -> int:
        return self.ra_end + self.params.block_size * len(self.pseudo)

    def _frozen(self, pos: int) -> bool:
        return any(b.start <= pos < b.start + b.acc for b in self.pseudo)

    def start(self, ctx: DecodeContext, prompt: list[int]) -> None:
        self._setup(ctx, prompt)
        n, P = self.params.block_size, len(prompt)
        self.pool: deque[tuple[int, ...]] = deque(maxlen=self.params.pool_size)
        self.pseudo: list[_Block] = []
        self.ra_end, self.iters = n, 0
        init = self._init_tokens(ctx, n - 1)
        logits = ctx.forward("prefill", prompt + init, logits_rows=list(range(P - 1, P + n - 1)))
        ctx.commit(P)
        first, _ = sample_token(logits[0], ctx.sampling, ctx.gen)
        self.guess = dict(enumerate(logits[1:].argmax(-1).tolist(), start=1))   # positions 1..n-1
        self.pending = first
        ctx.emit([first])
        if not ctx.out.finished:
            self._settle(ctx, {})

    def step(self, ctx: DecodeContext) -> None:
        n_out = ctx.n_out
        horizon = self._horizon()
        window = [self.guess[j] for j in range(n_out, horizon)]
        m = self.ra_end - n_out                       # open RA positions (>= 1 after _settle)
        looked = self._look_up(ctx, m)
        window[:len(looked)] = looked
        self.guess.update(zip(range(n_out, n_out + len(looked)), looked))
        chains = [window[:m]] + self._candidates(self.pending, m)
        tree = DraftTree.from_chains(chains)          # the RA's drafts, then what the candidates add to them
        # cost-aware: the whole layout, or a narrow forward of the first k RA drafts (pseudo blocks wait); not the
        # whole layout where it reaches the last position (as _plan's cap: drafts there never become output)
        whole = not self.plans_drafts or horizon < ctx.out.max_new_tokens
        k = self._plan(ctx, m, len(looked), full_rows=1 + len(window) + len(tree) - m if whole else None)
        narrow = k < m or not whole
        if narrow:
            window = window[:k]
        if narrow or len(tree) == m:   # no candidate adds a row: one causal chain
            fwd = self._chain_forward(ctx, window, m)
            self._propose(ctx, n_out, window[:k], min(len(looked), k))
            new = self._verify_chain(ctx, fwd, window[:k])
        else:
            fwd, new = self._tree_forward(ctx, tree, chains, window[m:])
        if ctx.out.finished:
            return
        # rejection recycling: the rejected noisy tail (RA drafts, then pseudo guesses) after the (up to n)
        # known tokens that precede it; the last of those is the key
        if self.params.pool_size:
            n = self.params.block_size
            j = next((i for i in range(min(k, len(new))) if window[i] != new[i]), None)
            if j is not None:
                out = ctx.out.token_ids
                self._push((*out[max(0, n_out + j - n):n_out + j], *window[j:j + n]))
        self._jacobi_update(ctx, fwd, narrow, horizon)

    def _rows(self, n_out: int, m: int, predicted: list[int]) -> list[int]:
        """The layout rows whose logits are read: all but those predicting a frozen pseudo position (`predicted`:
        the position each row predicts)."""
        return [r for r, pos in enumerate(predicted) if pos - n_out <= m or not self._frozen(pos)]

    def _chain_forward(self, ctx: DecodeContext, window: list[int], m: int) -> "_Forward":
        """One causal forward of [pending | window (RA drafts + pseudo blocks)]."""
        n_out, t = ctx.n_out, 1 + len(window)
        rows = self._rows(n_out, m, list(range(n_out, n_out + t)))
        logits = ctx.forward("jacobi", [self.pending] + window, logits_rows=None if len(rows) == t else rows)
        return _Forward(logits, {r: i for i, r in enumerate(rows)}, logits.argmax(-1).tolist(), n_out,
                        main=list(range(t)), won=list(range(t)))

    def _verify_chain(self, ctx: DecodeContext, fwd: "_Forward", drafts: list[int]) -> list[int]:
        """Verify the RA's drafts, commit what they accept; the new tokens."""
        k, logits, at = len(drafts), fwd.logits, fwd.at
        target_rows = logits[[at[r] for r in range(k)]]
        a, new = self._decide(ctx, drafts, process_logits(target_rows, ctx.sampling), target_rows, logits[at[k]],
                              fwd.n_out)
        ctx.keep(list(range(1 + a)))
        self.pending = new[-1]
        ctx.emit(new)
        return new

    def _tree_forward(self, ctx: DecodeContext, tree: DraftTree, chains: list[list[int]],
                      pseudo: list[int]) -> tuple["_Forward", list[int]]:
        """One forward of the draft tree of the RA's drafts and the recycled candidates (shared prefixes once), the
        pseudo blocks' guesses under the RA's last draft; the tree's walk commits what it accepts (`verify_tree`: the
        multi-draft rule keeps the target's law). Returns the forward and the new tokens."""
        n_out, L, m = ctx.n_out, ctx.kv.length, len(chains[0])
        layout = DraftTree(list(tree.tokens), list(tree.parents))
        main = tree.path_of(chains[0])
        node = main[-1]
        for token in pseudo:
            node = layout.child(node, token, add=True)
            main.append(node)
        depths = layout.depths()
        rows = self._rows(n_out, m, [n_out] + [n_out + d for d in depths])
        read = {}

        def forward(role, tokens, positions, mask):   # the whole layout; the walk reads the tree's rows
            read["logits"] = ctx.forward("jacobi", [self.pending] + layout.tokens, layout.positions(L),
                                         mask=layout.attention_mask(L, device=ctx.device),
                                         logits_rows=None if len(rows) == 1 + len(layout) else rows)
            return read["logits"][:1 + len(tree)]

        v = ctx.verify_tree(tree, self.pending, "jacobi", forward)
        if self.source in self.planners:
            self.planners[self.source].observe(m, len(v.accepted))
        new = [tree.tokens[i] for i in v.accepted] + [v.next_token]
        self.pending = new[-1]
        ctx.emit(new)
        # the chain the walk followed (the RA's drafts where it stayed on them) predicts the RA's next guesses
        won = next(p for p in map(tree.path_of, chains) if p[:len(v.accepted)] == v.accepted)
        logits = read["logits"]
        return _Forward(logits, {r: i for i, r in enumerate(rows)}, logits.argmax(-1).tolist(), n_out,
                        main=[0] + [1 + i for i in main], won=[0] + [1 + i for i in won]), new

    def _jacobi_update(self, ctx: DecodeContext, fwd: "_Forward", narrow: bool, horizon: int) -> None:
        """Grow the pseudo blocks' frozen prefixes, take the forward's predictions as the next guesses, restart a
        stalled block, settle."""
        n, n_out, new_n_out = self.params.block_size, fwd.n_out, ctx.n_out

        # pseudo blocks: grow the frozen prefix by the leading matches + the prediction after them
        old_frozen = {pos for b in self.pseudo for pos in range(b.start, b.start + b.acc)}
        unmasked: list[int] = []
        for b in [] if narrow else self.pseudo:
            old = b.acc
            while b.acc < n and self.guess[b.start + b.acc] == fwd.main_pred(b.start + b.acc):
                b.acc += 1
            if b.acc < n:
                b.acc += 1
            unmasked += range(b.start + old, b.start + b.acc)
        # the Jacobi update of every open position that was not frozen: RA positions take the predictions of the
        # chain the verdict followed, pseudo positions the main chain's (they were conditioned on it); positions a
        # narrow forward did not reach keep their guesses
        def update(pos: int) -> int | None:
            if pos in old_frozen:
                return None
            return fwd.main_pred(pos) if pos >= self.ra_end else fwd.next_guess(pos)
        self.guess = {pos: g if (g := update(pos)) is not None else self.guess[pos] for pos in range(new_n_out, horizon)}
        unmasked = [pos for pos in unmasked if pos >= new_n_out]
        if unmasked:
            conf = torch.softmax(fwd.logits[[fwd.at[fwd.main[pos - n_out]] for pos in unmasked]].float(), -1)
            toks = [fwd.main_pred(pos) for pos in unmasked]
            ctx.event("unmask", pos=unmasked, tok=toks,
                      conf=conf.gather(1, torch.tensor(toks, device=conf.device)[:, None])[:, 0].tolist())

        self.iters += 1
        if self.iters >= self.params.max_iters:
            self.iters = 0
            fresh = self._init_tokens(ctx, self.ra_end - new_n_out)
            self.guess.update(zip(range(new_n_out, self.ra_end), fresh))
        self._settle(ctx, {horizon: fwd.main_pred(horizon)})

    # -- pieces ---------------------------------------------------------------------------
    def _settle(self, ctx: DecodeContext, known: dict[int, int | None]) -> None:
        """Promote while the RA is complete, then spawn a pseudo block if the newest one is far enough.
        `known`: model predictions for positions past the horizon (the last row's)."""
        n, n_out, reference = self.params.block_size, ctx.n_out, self.params.mode == "reference"
        while n_out >= self.ra_end:
            self.iters = 0
            if self.pseudo and not reference:
                b = self.pseudo.pop(0)
                ctx.event("block", op="close", start=b.start, end=b.start + n)
                self.ra_end = b.start + n          # its guesses stay: they are the new RA's drafts
                continue
            for b in self.pseudo:                  # reference: the call ends, everything else is dropped
                ctx.event("block", op="close", start=b.start, end=b.start + n)
                for pos in range(b.start, b.start + n):
                    self.guess.pop(pos, None)
            if reference:
                self.pool.clear()
            self.pseudo = []
            old_end, self.ra_end = self.ra_end, self.ra_end + n
            fresh = iter(self._init_tokens(ctx, self.ra_end - max(n_out, old_end)))
            for pos in range(max(n_out, old_end), self.ra_end):
                k = None if reference else known.get(pos)
                self.guess[pos] = k if k is not None else next(fresh)
        newest = self.pseudo[-1].acc if self.pseudo else min(n_out, self.ra_end) - (self.ra_end - n)
        if len(self.pseudo) + 1 < self.params.blocks and newest >= math.ceil(self.params.spawn_ratio * n):
            start = self._horizon()
            first = known.get(start)
            fresh = self._init_tokens(ctx, n if first is None else n - 1)
            toks = ([] if first is None else [first]) + fresh
            self.guess.update(zip(range(start, start + n), toks))
            self.pseudo.append(_Block(start, acc=0))
            ctx.event("block", op="open", start=start, end=start + n)

    def _push(self, entry: tuple[int, ...]) -> None:
        if len(entry) < 2:
            return
        if entry in self.pool:
            self.pool.remove(entry)
        self.pool.append(entry)

    def _candidates(self, pending: int, m: int) -> list[list[int]]:
        """One candidate per pool entry (newest first) that contains `pending`: the tokens after its first
        occurrence, cut to the RA's `m` open positions (the tree shares what repeats the RA's drafts or another)."""
        out = []
        for entry in reversed(self.pool):
            try:
                i = entry.index(pending, 0, len(entry) - 1)
            except ValueError:
                continue
            out.append(list(entry[i + 1:i + 1 + m]))
        return out


@dataclass
class _Forward:
    """One Jacobi forward: its logits by row (`at`: layout row -> logits row, for the rows read), their argmax, and
    the rows of two chains, by depth (row 0: the pending token, predicting the first open position): the main one
    (the window) and the one the verdict followed (the window, or the recycled candidate it accepted)."""
    logits: torch.Tensor
    at: dict[int, int]
    pred: list[int]
    n_out: int                 # the output length when it ran (depth d predicts position n_out + d)
    main: list[int]
    won: list[int]

    def _pred(self, rows: list[int], pos: int) -> int | None:
        d = pos - self.n_out
        return self.pred[self.at[rows[d]]] if 0 <= d < len(rows) and rows[d] in self.at else None

    def main_pred(self, pos: int) -> int | None:
        """The main chain's prediction for position `pos`, None where no row of it was read."""
        return self._pred(self.main, pos)

    def next_guess(self, pos: int) -> int | None:
        """The next guess for an RA position: the followed chain's prediction where it reaches, else the main one's."""
        return self._pred(self.won, pos) if pos - self.n_out < len(self.won) else self.main_pred(pos)

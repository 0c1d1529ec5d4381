"""Cost-aware drafting: how many draft rows the next forward should carry.

A draft row costs its share of the forward whether or not it is accepted, and on a CPU that share is large and
uneven (`dlm-studio models costs`). A strategy in `drafting="auto"` asks its `DraftPlanner` before each forward and drafts
as many tokens as maximise the expected tokens per millisecond -- from 0 (a plain AR step) to its maximum:

- expected tokens come from the run's own acceptance by draft slot (`SlotAcceptance`);
- the cost of a forward of n rows (and LoRA rows) is the machine's cost table (`studio.engine.cost_model`),
  measured once per model, device, dtype and thread count. Not the run's own clock: a plan that followed timings
  would make a seeded sampled run decode differently from one run to the next.

Exact whatever the plan: the plan is a function of verdicts already made, never of the drafts about to be
verified, so each draft is still accepted by the unchanged rule (a draft length chosen from the past is a
stopping rule, which leaves a speculative chain's law intact). docs/strategies.md#cost-aware-drafting.
"""
from __future__ import annotations

import math
from typing import Callable

from studio.errors import BadInput

DRAFTING = ("auto", "fixed")
HELP = ("auto: each forward drafts as many tokens (0 = a plain AR step, up to the maximum) as pay for their rows "
        "by the measured forward costs and the run's acceptance so far | fixed: always the maximum")


def validate(owner: str, value: str) -> None:
    """BadInput unless `value` is a drafting mode."""
    if value not in DRAFTING:
        raise BadInput(f"{owner} drafting must be 'auto' or 'fixed', got {value!r}")


# The expected gain over a plain AR step a draft must promise before a DraftPlanner verifies it: the cost table
# prices a forward's rows, not the drafting step's own work (building the rows, verifying, the bookkeeping), which
# made drafts promising a few percent lose about as much on ordinary prompts (R-ISD 0.90x ar at TPF 1.1)
MARGIN = 0.05

# How much slower than AR a cost-aware run may get, as a share of its forwards' cost by the table: the acceptance
# estimate is optimistic about what it knows little of, so a run probes with drafts, and on a prompt where they are
# refused each probe is lost time; once the run's loss exceeds this share of its time, it takes AR steps until its
# time (growing with each) makes room for the next probe. A run whose drafts pay is never held back. Each drafting
# forward is also charged MARGIN of a step, the drafting work the table does not price: a table whose 2-row forward
# reads as cheap as a 1-row one (the CPU kernel's, give or take its noise) counted Jacobi's refused 1-draft probes as
# free, so the bound never held and a probe every other step cost ~3 % (0.97x ar on ordinary prompts)
REGRET_SHARE = 0.01

# The most a block strategy's draft cycle may stake: were every draft it carries refused, the run would still be within
# this share of AR's time for the tokens it has written. The regret bound above acts once a loss is made, and a short
# answer cannot pay one back: S2D2's first cycle (~3 steps' time for at least 2 tokens) was 4-7 % of a 33-token answer.
# So a cycle waits until the answer can absorb its loss (~25 tokens for S2D2's) or cycles that paid have made room.
# Not for a DraftPlanner: its probe can be one draft (a 2-row forward), and bounding its longer chains the same way
# kept R-ISD and Jacobi MR from the lists they win on (the numbered-list demo: R-ISD 1.55x -> 1.33x ar)
RISK_SHARE = 0.05

# Forward costs for a planner: ms of a forward of `rows` rows, `gated` of them with the LoRA on.
Cost = Callable[[int, int], float]


class SlotAcceptance:
    """Slot i's chance that draft i is accepted given that drafts 1..i-1 were, from the run's verdicts: a Beta
    posterior read optimistically (its mean plus `optimism` standard deviations), whose evidence fades by `decay`
    per forward. Its prior is `prior` for the first slot and the previous slot's posterior mean for each later one:
    a slot is only tried when the ones before it were accepted, so where the first is rarely accepted the later
    ones would keep reading as `prior` for ever and make long chains look worth their rows. A slot with little
    evidence reads high, so a run tries drafts it knows little about, and one that fell back to AR steps sees its
    evidence fade and tries again: how it finds the list in an answer."""

    def __init__(self, slots: int, prior: float = 0.5, weight: float = 2.0, decay: float = 0.97,
                 optimism: float = 1.0, deep: bool = True):
        self.prior, self.weight, self.decay, self.optimism = prior, weight, decay, optimism
        self.deep = deep   # False: only the first slot reads optimistically (DraftPlanner says why)
        self.hits = [0.0] * slots
        self.tries = [0.0] * slots

    def fade(self) -> None:
        self.hits = [h * self.decay for h in self.hits]
        self.tries = [t * self.decay for t in self.tries]

    def observe(self, verified: int, accepted: int) -> None:
        """A chain of `verified` drafts whose first `accepted` were accepted: those slots succeeded, the next one
        (if any) failed, the rest were never decided."""
        for i in range(min(accepted + 1, verified, len(self.tries))):
            self.tries[i] += 1.0
            self.hits[i] += 1.0 if i < accepted else 0.0

    def rates(self, d: int) -> list[float]:
        """The first d slots' rates, each slot's prior the posterior mean of the one before it."""
        out, prior = [], self.prior
        for i in range(d):
            n = self.tries[i] + self.weight
            mean = (self.hits[i] + prior * self.weight) / n
            bonus = self.optimism * math.sqrt(mean * (1.0 - mean) / (n + 1.0)) if i == 0 or self.deep else 0.0
            out.append(min(1.0, mean + bonus))
            prior = mean
        return out

    def rate(self, i: int) -> float:
        return self.rates(i + 1)[i]

    def reach(self, d: int) -> list[float]:
        """reach[j] = the chance that the first j + 1 of d drafts are all accepted."""
        out, r = [], 1.0
        for rate in self.rates(d):
            r *= rate
            out.append(r)
        return out


def chain_rate(reach: list[float], cost: Cost, clean_gated: bool = False, rows: int | None = None) -> float:
    """Tokens per ms of a forward that verifies d = len(reach) drafts after the pending token (Jacobi's layout): the
    accepted prefix plus one more token (a correction or the bonus), for `rows` rows (default 1 + d: the chain
    alone), all read with the LoRA when the run's clean rows are (`clean_gated`)."""
    rows = 1 + len(reach) if rows is None else rows
    return (1.0 + sum(reach)) / cost(rows, rows * clean_gated)


def isd_rate(reach: list[float], cost: Cost, clean_gated: bool) -> float:
    """Tokens per ms of ISD at d = len(reach) drafts per round, in steady state. A verify round (1 + d clean rows,
    d MASK rows) emits the accepted drafts and a correction, or all d and the bonus; after a rejection the next
    round is cold (1 clean row, d MASK rows) and emits one token. With A = reach[-1], the share of verify rounds
    is 1 / (2 - A). MASK rows always read the LoRA; clean rows when `clean_gated`."""
    d = len(reach)
    if d == 0:
        return 1.0 / cost(1, int(clean_gated))
    A = reach[-1]
    verify_tokens = 1.0 + sum(reach)
    verify_ms = cost(1 + 2 * d, d + (1 + d) * clean_gated)
    cold_ms = cost(1 + d, d + clean_gated)
    share = 1.0 / (2.0 - A)
    return (share * verify_tokens + (1 - share)) / (share * verify_ms + (1 - share) * cold_ms)


class PlanView:
    """All a planner may read of its run: the cost table, the clean rows' LoRA gate, the step, what the table prices
    the forwards so far at, and how many tokens are out -- the verdicts themselves reach it as counts (`observe`).
    Never a token: a plan that read the tokens or drafts it is about to verify (their values, their probabilities)
    would make whether a draft is verified depend on the draft, which biases a sampled run's law
    (docs/verification.md#what-a-plan-may-depend-on). Each planner holds one of these instead of the run's context,
    so no strategy can hand it more by accident."""

    __slots__ = ("_ctx",)
    READS = frozenset({"costs", "clean_gate", "step", "table_ms", "n_out"})

    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name: str):
        if name in PlanView.READS:
            return getattr(self._ctx, name)
        raise AttributeError(f"a planner does not read its run's {name!r} (PlanView.READS)")

    def event(self, kind: str, **fields) -> None:
        self._ctx.event(kind, **fields)


class Regret:
    """A run's loss to AR steps since a planner's first plan after the prefill, by the cost table plus MARGIN of a step
    per drafting forward. Each planner keeps its own: a strategy's refused probes (whole steps of loss for S2D2's
    block cycles) would otherwise hold back the drafts copied from the context, which cost a few percent of a step."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._start: tuple[float, int] | None = None   # (table ms, tokens out) at the first plan after the prefill
        self.charged = 0.0                              # ms of drafting work the table does not price
        self._charged_step = -1                         # the last step charged: a forward is charged once

    def _step_ms(self) -> float:
        return self.ctx.costs.forward_ms(1, int(self.ctx.clean_gate))

    def charge(self) -> None:
        """A forward about to carry drafts (once, however many of the run's planners drafted for it)."""
        if self._charged_step != self.ctx.step:
            self._charged_step = self.ctx.step
            self.charged += MARGIN * self._step_ms()

    def _since_start(self) -> tuple[float, int]:
        """(ms the run's forwards and their drafting work cost, tokens they gave) since the first plan; (0, 0) before."""
        ctx = self.ctx
        if self._start is None:
            return 0.0, 0
        return ctx.table_ms - self._start[0] + self.charged, ctx.n_out - self._start[1]

    def affords(self, worst_ms: float) -> bool:
        """Whether a drafting forward that loses `worst_ms` to AR steps when every draft is refused (plus MARGIN of a
        step) keeps the run within RISK_SHARE of AR's time for the tokens written since the first plan, and one more."""
        step = self._step_ms()
        spent, tokens = self._since_start()
        lost = spent - tokens * step
        return lost + worst_ms + MARGIN * step <= RISK_SHARE * (tokens + 1) * step

    def in_debt(self) -> bool:
        """Whether the run has lost more than REGRET_SHARE of its time to drafts: its forwards since the first plan
        (and their drafting work) cost more than AR steps for the tokens they gave, by more than that share."""
        if self._start is None:
            self._start = (self.ctx.table_ms, self.ctx.n_out)
            return False
        spent, tokens = self._since_start()
        return spent - tokens * self._step_ms() > REGRET_SHARE * spent


class _Planner:
    """What every planner of a run holds: its context, its acceptance by slot, the cost table it reads and its
    regret."""

    def __init__(self, ctx, max_drafts: int):
        self.ctx = PlanView(ctx)
        self.max_drafts = max_drafts
        self.acceptance = SlotAcceptance(max(max_drafts, 1))
        self.cost: Cost = ctx.costs.forward_ms
        self.regret = Regret(self.ctx)

    def observe(self, verified: int, accepted: int) -> None:
        self.acceptance.observe(verified, accepted)

    def in_debt(self) -> bool:
        return self.regret.in_debt()


class DraftPlanner(_Planner):
    """Chooses each forward's draft count for one run: `plan(rate)` with `rate(reach, cost)` the strategy's expected
    tokens per ms at len(reach) drafts, `cost` the run's cost table (`DecodeContext.costs`). The plan depends on the
    table and the run's verdicts only, never on a clock, so a seeded run decodes the same on the same table.

    Only the first slot reads optimistically. Deeper slots are rarely tried where the first is rarely accepted, so
    their bonus for little evidence stayed large and made a 5-draft chain look worth its ~1.3-step forward every few
    forwards of an ordinary prompt (Jacobi at acceptance 0: 24 such probes in 126 forwards, 0.93x ar). At their
    plain means the run probes with one draft instead, a 2-row forward costing ~1.03 steps on a CPU, and lengthens
    the chain as the first slot's acceptance shows."""

    def __init__(self, ctx, max_drafts: int):
        super().__init__(ctx, max_drafts)
        self.acceptance.deep = False

    def plan(self, rate: Callable[[list[float], Cost], float], limit: int | None = None, prefill: bool = False,
             report: bool = True) -> int:
        """The draft count for the next forward (0..max_drafts, or 0..`limit` when fewer drafts are open), reported
        as a `plan` event of that forward's step (`prefill`: the prefill, step 0) with its expected gain over a plain
        AR step; not reported when `report` is False (a forward has one plan event: ISD's is its MASK rows')."""
        self.acceptance.fade()
        top = self.max_drafts if limit is None else min(limit, self.max_drafts)
        if not prefill and self.in_debt():   # AR steps until the run's time makes room again: nothing to weigh
            best, rates = 0, [rate([], self.cost)]
        else:
            reach = self.acceptance.reach(top)   # a slot's rate reads only the slots before it: d drafts reach reach[:d]
            rates = [rate(reach[:d], self.cost) for d in range(top + 1)]
            best = max(range(len(rates)), key=rates.__getitem__)
            if rates[best] < rates[0] * (1.0 + MARGIN):
                best = 0
        if best and not prefill:
            self.regret.charge()
        if not report:
            return best
        gain = rates[best] * self.cost(1, 0)
        self.ctx.event("plan", at_step=0 if prefill else self.ctx.step + 1, drafts=best, max_drafts=self.max_drafts,
                       gain=gain)
        return best


class BlockPlanner(_Planner):
    """Cost-aware drafting for a block strategy (S2D2, SimSD) on an AR model with a block adapter, whose cache is
    causal: before each draft cycle, whether drafting the rest of the open block pays, or committing its filled
    prefix (one forward whose last row gives the next token: with one filled slot, a plain AR step) does.

    A cycle of a block with m masked slots (a suffix) costs `draft_forwards` forwards of the B-row block (m MASK
    rows) and one verifying forward of B - 1 rows; it fills the `forced` slots (S2D2's first slot, the target's
    own sample), the accepted drafts and, after a rejection, the correction. A full block's commit forward (B rows)
    writes its KV and gives the next block's first token. `finish_ms` is the expected cost of finishing a block from
    m masked slots by cycles; the plan continues when that beats committing now and going on at the better of AR
    steps and fresh blocks. Exact whatever it decides: both paths verify or sample from the target."""

    def __init__(self, ctx, block: int, forced: int, draft_forwards: int, all_gated: bool):
        super().__init__(ctx, block - 1 - forced)
        self.B, self.forced, self.draft_forwards, self.all_gated = block, forced, draft_forwards, all_gated

    def _ms(self, rows: int, mask_rows: int = 0) -> float:
        return self.cost(rows, rows if self.all_gated else mask_rows)

    def finish_ms(self, m_max: int) -> list[float]:
        """E[m], m = 0..m_max: the expected ms to fill the last m slots of a block by draft cycles and commit it."""
        B, f = self.B, self.forced
        reach = [1.0] + self.acceptance.reach(self.max_drafts)   # reach[k]: the first k drafts all accepted
        E = [self._ms(B)]
        for m in range(1, m_max + 1):
            r = max(m - f, 0)                                    # real drafts verified this cycle
            after = reach[r] * E[0] + sum((reach[k] - reach[k + 1]) * E[m - f - k - 1] for k in range(r))
            E.append(self.cycle_ms(m) + after)
        return E

    def cycle_ms(self, m: int) -> float:
        """A draft cycle of a block with m masked slots: its draft forwards (m MASK rows) and the verifying forward."""
        return self.draft_forwards * self._ms(self.B, m) + self._ms(self.B - 1)

    def min_filled(self, m: int) -> int:
        """The slots a cycle of m masked slots fills however its drafts fare: the forced ones, and a correction when it
        verifies a real draft."""
        return min(self.forced, m) + (m > self.forced)

    def draft_pays(self, filled: int, masked: int) -> bool:
        """Whether the next forward drafts the block's `masked` last slots (a cycle), or commits its `filled` first
        slots instead; reported as a `plan` event of that forward's step."""
        self.acceptance.fade()
        E = self.finish_ms(self.B - 1)
        ar_ms = self._ms(1)
        best = max(1.0 / ar_ms, self.B / E[self.B - 1])   # tokens per ms: AR steps, or fresh blocks (B - 1 slots + 1)
        commit_ms = self._ms(filled)
        worst = self.cycle_ms(masked) - self.min_filled(masked) * ar_ms   # a cycle whose drafts are all refused
        go = not self.in_debt() and E[masked] <= commit_ms + masked / best and self.regret.affords(worst)
        if go:
            self.regret.charge()
        self.ctx.event("plan", at_step=self.ctx.step + 1, drafts=max(masked - self.forced, 0) if go else 0,
                       max_drafts=self.max_drafts, gain=(masked + 1) / E[masked] * ar_ms if go else ar_ms / commit_ms)
        return go

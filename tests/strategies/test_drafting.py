"""Cost-aware drafting: the planner's arithmetic (acceptance by slot, expected tokens per ms) and what a run
does with it. Exactness under `drafting="auto"` is tested with each strategy's own exactness tests."""
import math

import pytest

from studio.engine.cost_table import CostTable
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.engine.strategies.drafting import (MARGIN, REGRET_SHARE, RISK_SHARE, BlockPlanner, DraftPlanner, Regret,
                                               SlotAcceptance, chain_rate, isd_rate)
from studio.engine.strategies.isd import expected_tpf
from studio.run.session import Run, Settings, drive, prepare, run_to_end
from tests.support.dlm import generate
from tests.support.plans import plan_with, planned
from tests.support.tiny import tiny_dlm, tiny_engine

FLAT = CostTable({}, 0, (1.0,) * 16)


def test_a_verdict_counts_the_accepted_slots_and_the_first_rejected_one_only():
    acc = SlotAcceptance(4, prior=0.5, weight=2.0, decay=1.0, optimism=0.0)
    acc.observe(verified=3, accepted=1)      # slot 0 accepted, slot 1 rejected, slot 2 never decided
    assert acc.tries == [1.0, 1.0, 0.0, 0.0] and acc.hits == [1.0, 0.0, 0.0, 0.0]
    # each slot's prior is the slot before it's posterior mean: slot 1 = (0 + 2/3 * 2) / 3, slot 2 = slot 1's mean
    assert acc.rates(3) == pytest.approx([2 / 3, 4 / 9, 4 / 9]) and acc.rate(1) == pytest.approx(4 / 9)
    assert acc.reach(3) == pytest.approx([2 / 3, 8 / 27, 32 / 243])
    acc.observe(verified=2, accepted=2)       # all accepted: nothing failed
    assert acc.tries[:2] == [2.0, 2.0] and acc.hits[:2] == [2.0, 1.0]


def test_slots_behind_a_rarely_accepted_first_draft_read_as_low_as_it():
    """Later slots are only tried after the first is accepted: where it rarely is, they must not keep reading as the
    prior, or a cheap wide forward makes a long chain of them look worth its rows (Jacobi on an ordinary prompt)."""
    acc = SlotAcceptance(8, decay=0.97)
    for _ in range(60):
        acc.fade()
        acc.observe(verified=4, accepted=0)
    assert max(acc.rates(8)[1:]) < 0.2
    cheap = CostTable({}, 0, (1.0, 1.03) + (1.27,) * 14)   # this CPU's table with oneDNN's flat 3-16 rows
    reach = {d: acc.reach(d) for d in range(9)}
    best = max(reach, key=lambda d: chain_rate(reach[d], cheap.forward_ms))
    assert best <= 1


def test_evidence_fades_back_to_the_prior_so_an_abandoned_slot_is_tried_again():
    acc = SlotAcceptance(1, prior=0.5, weight=2.0, decay=0.9, optimism=0.0)
    for _ in range(20):
        acc.observe(verified=1, accepted=0)
    low = acc.rate(0)
    assert low < 0.15
    for _ in range(60):
        acc.fade()
    assert low < acc.rate(0) and acc.rate(0) == pytest.approx(0.5, abs=0.05)


def test_a_slot_with_little_evidence_reads_optimistically():
    """The run drafts what it knows little about: the same mean reads higher on less evidence, never above 1."""
    few, many = SlotAcceptance(1, decay=1.0), SlotAcceptance(1, decay=1.0)
    few.observe(1, 1), few.observe(1, 0)
    for _ in range(50):
        many.observe(1, 1), many.observe(1, 0)
    assert few.rate(0) > many.rate(0) == pytest.approx(0.5 + (0.25 / 103) ** 0.5)   # one sd over 100 tries
    sure = SlotAcceptance(1, decay=1.0)
    for _ in range(20):
        sure.observe(1, 1)
    assert sure.rate(0) <= 1.0


@pytest.mark.parametrize("p", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("d", [1, 3, 7])
def test_isd_rate_on_equal_costs_is_the_papers_tokens_per_forward(p, d):
    # with every forward costing one unit, tokens per ms is tokens per forward: the closed form of appendix B
    assert isd_rate([p ** (j + 1) for j in range(d)], FLAT.forward_ms, clean_gated=False) == \
        pytest.approx(expected_tpf(p, d + 1))


def test_drafts_pay_only_when_their_rows_are_cheap_enough_for_the_acceptance():
    cpu = CostTable({}, 0, (1.0, 1.3, 1.4, 1.2, 1.0, 1.05, 1.15, 1.1))
    rates = lambda p, rate: [rate([p ** (j + 1) for j in range(d)]) for d in range(4)]
    isd = lambda reach: isd_rate(reach, cpu.forward_ms, clean_gated=False)
    chain = lambda reach: chain_rate(reach, cpu.forward_ms)
    for rate in (isd, chain):
        low, high = rates(0.1, rate), rates(0.9, rate)
        assert max(range(4), key=low.__getitem__) == 0        # a plain AR step beats drafts nobody accepts
        assert max(range(4), key=high.__getitem__) == 3       # and loses to drafts that are accepted
    # the table is read as measured: 1 draft (2 rows, 1.3) costs more here than 3 drafts of Jacobi (4 rows, 1.2)
    assert chain_rate([0.5] * 3, cpu.forward_ms) > chain_rate([0.5], cpu.forward_ms)


class _Ctx:
    """What a planner reads of a run: its costs, its step, the table's price of its forwards and its tokens so far,
    and where its plan events go."""
    step, table_ms, n_out, clean_gate = 0, 0.0, 0, False

    def __init__(self, costs):
        self.costs, self.events = costs, []

    def event(self, kind, at_step=None, **fields):
        self.events.append(fields)


def run_of(planner) -> _Ctx:
    """The stand-in context behind a planner's `PlanView` (a test moves its clock and reads its events)."""
    return planner.ctx._ctx


CPU = CostTable({}, 0, (1.0, 1.03) + (1.27,) * 4 + (1.3,) * 10)   # this CPU's table: 2 rows ~free, 3-16 rows flat


def _chain_plan(planner: DraftPlanner, top: int = 8) -> int:
    return planner.plan(lambda reach, cost: chain_rate(reach, cost), limit=top)


def test_a_planner_probes_with_one_draft_before_a_long_chain():
    """The first slot, accepted now and then, reads optimistically; the deeper ones, hardly ever tried behind it,
    at their means: a cheap one-draft probe, not a 5-draft chain whose unknown slots would read high for having
    no evidence (what made Jacobi probe every few forwards of an ordinary prompt)."""
    planner = DraftPlanner(_Ctx(CPU), 8)
    for i in range(60):
        planner.acceptance.fade()
        if i % 4 == 0:
            planner.observe(1, 1 if i % 12 == 0 else 0)   # the first draft accepted a third of the time
    assert _chain_plan(planner) == 1
    planner.regret = Regret(run_of(planner))   # as at a run's start (that probe was charged, and this ctx stands still)
    planner.acceptance.deep = True   # every slot optimistic: the long chain looked worth its rows
    assert _chain_plan(planner) > 3


def test_a_draft_must_promise_more_than_the_margin_over_an_ar_step():
    """The cost table prices rows, not the drafting step's own work: a draft promising under MARGIN stays an AR
    step; one promising more is verified."""
    planner = DraftPlanner(_Ctx(FLAT), 1)
    planner.acceptance = SlotAcceptance(1, weight=1e9, decay=1.0, optimism=0.0, prior=0.04)   # pinned: +4 %
    assert planner.plan(lambda reach, cost: chain_rate(reach, cost)) == 0
    planner.acceptance.prior = 2 * MARGIN
    assert planner.plan(lambda reach, cost: chain_rate(reach, cost)) == 1


def _drive(planner: DraftPlanner, accepted: bool, forwards: int = 400) -> list[int]:
    """Jacobi-like forwards of one draft at most, whose draft is always accepted or always refused: the plans."""
    ctx, plans = run_of(planner), []
    for _ in range(forwards):
        d = _chain_plan(planner, top=1)
        plans.append(d)
        ctx.table_ms += planner.cost(1 + d, 0)
        ctx.n_out += 1 + (d if accepted else 0)
        ctx.step += 1
        if d:
            planner.observe(d, d if accepted else 0)
    return plans


@pytest.mark.parametrize("share", [REGRET_SHARE, 1.0])
def test_refused_drafts_cost_a_run_at_most_the_regret_share(monkeypatch, share):
    """The acceptance estimate keeps a refused draft worth probing (its evidence fades back to an optimistic prior);
    the regret bound holds the run's loss to AR at REGRET_SHARE of its time, by the table, and still probes now and
    then. Without the bound (share 1) the same run loses ~20 %."""
    monkeypatch.setattr("studio.engine.strategies.drafting.REGRET_SHARE", share)
    costly = CostTable({}, 0, (1.0, 1.25) + (1.3,) * 14)
    planner = DraftPlanner(_Ctx(costly), 1)
    planner.acceptance = SlotAcceptance(1, prior=0.9, weight=1e9, decay=1.0, optimism=0.0)   # pinned: always drafts
    plans = _drive(planner, accepted=False)
    ctx = run_of(planner)
    lost = (ctx.table_ms - ctx.n_out * 1.0) / ctx.table_ms
    if share < 1:
        assert lost <= REGRET_SHARE + 0.25 / ctx.table_ms and sum(plans) >= 10   # one probe past the bound at most
    else:
        assert lost > 0.15 and sum(plans) == len(plans)


def test_drafts_the_table_prices_as_free_are_still_charged_their_drafting_work():
    """A 2-row forward the table prices as a 1-row one (the CPU kernel's, within its noise): refused 1-draft probes
    counted as free, so the regret bound never held and Jacobi probed every other forward (~3 % lost). Each drafting
    forward is charged MARGIN of a step, so the bound holds the probes to REGRET_SHARE of the run's time."""
    planner = DraftPlanner(_Ctx(CostTable({}, 0, (1.0,) * 16)), 1)
    planner.acceptance = SlotAcceptance(1, prior=0.9, weight=1e9, decay=1.0, optimism=0.0)   # pinned: always drafts
    plans = _drive(planner, accepted=False)
    assert 10 <= sum(plans) <= REGRET_SHARE * len(plans) / MARGIN + 2


def test_drafts_that_are_accepted_are_never_held_back():
    planner = DraftPlanner(_Ctx(CostTable({}, 0, (1.0, 1.25) + (1.3,) * 14)), 1)
    planner.acceptance = SlotAcceptance(1, prior=0.9, weight=1e9, decay=1.0, optimism=0.0)
    assert _drive(planner, accepted=True) == [1] * 400


def _block_planner(costs, accept: float, forced: int = 1) -> BlockPlanner:
    planner = BlockPlanner(_Ctx(costs), block=4, forced=forced, draft_forwards=1, all_gated=False)
    planner.acceptance = SlotAcceptance(3, prior=accept, weight=1e9, decay=1.0, optimism=0.0)   # pinned
    return planner


def test_a_block_cycle_costs_its_draft_and_verify_forwards_until_the_block_is_full():
    """Equal costs, B = 4, S2D2's forced first slot. All drafts accepted: one cycle (draft + verify) fills the 3 open
    slots, the commit gives the 4th token: 3 forwards for 4 tokens. None accepted: a cycle fills the forced slot and
    the correction, a second the last slot: 5 forwards."""
    assert _block_planner(FLAT, 1.0).finish_ms(3) == pytest.approx([1.0, 3.0, 3.0, 3.0])
    assert _block_planner(FLAT, 0.0).finish_ms(3)[3] == pytest.approx(5.0)
    half = _block_planner(FLAT, 0.5)        # a cycle of 2 drafts: 0, 1 or 2 accepted with 1/2, 1/4, 1/4
    assert half.finish_ms(3)[3] == pytest.approx(2 + 0.5 * 3.0 + 0.25 * 1.0 + 0.25 * 1.0)
    assert _block_planner(FLAT, 1.0).draft_pays(filled=1, masked=3)         # 4 tokens in 3 forwards beat AR
    assert not _block_planner(FLAT, 0.0).draft_pays(filled=1, masked=3)     # 4 in 5 do not
    planner = _block_planner(FLAT, 0.0)
    planner.draft_pays(filled=1, masked=3)
    assert run_of(planner).events[-1] == {"drafts": 0, "max_drafts": 2, "gain": pytest.approx(1.0)}
    # a CPU where the block's 4-row forwards cost 2 steps: even accepted drafts do not pay
    assert not _block_planner(CostTable({}, 0, (1.0, 1.3, 1.7, 2.0)), 1.0).draft_pays(filled=1, masked=3)


@pytest.mark.parametrize("share", [REGRET_SHARE, 1.0])
def test_refused_block_cycles_cost_a_run_at_most_the_regret_share(monkeypatch, share):
    """A block cycle that is refused costs two wide forwards for two tokens (the forced slot and the correction):
    the regret bound holds a block strategy's loss to AR as it does a chain's, and it still probes now and then."""
    monkeypatch.setattr("studio.engine.strategies.drafting.REGRET_SHARE", share)
    monkeypatch.setattr("studio.engine.strategies.drafting.RISK_SHARE", math.inf)   # the other bound, tested below
    planner = _block_planner(CostTable({}, 0, (1.0, 1.0, 1.05) + (1.1,) * 13), 0.9)   # pinned: every cycle pays
    ctx, cycles = run_of(planner), 0
    for _ in range(400):
        if planner.draft_pays(filled=1, masked=3):
            cycles += 1
            ctx.table_ms += planner.cost(4, 3) + planner.cost(3, 0)
            ctx.n_out, ctx.step = ctx.n_out + 2, ctx.step + 2
        else:
            ctx.table_ms += planner.cost(1, 0)
            ctx.n_out, ctx.step = ctx.n_out + 1, ctx.step + 1
    lost = (ctx.table_ms - ctx.n_out * 1.0) / ctx.table_ms
    if share < 1:
        assert lost <= REGRET_SHARE + 0.15 / ctx.table_ms and cycles >= 5   # one cycle past the bound at most
    else:
        assert lost > 0.05 and cycles == 400


@pytest.mark.parametrize("risk", [RISK_SHARE, math.inf])
def test_a_block_cycle_waits_until_the_answer_can_absorb_its_refusal(monkeypatch, risk):
    """A cycle that pays on average (4 tokens for 3.84 steps) but, its drafts all refused, loses 0.42 of a step (2.42
    steps for the forced slot and the correction) waits for the answer to reach the length whose RISK_SHARE covers
    that loss and MARGIN of a step: 9 tokens of AR steps. Without the bound it goes at once."""
    monkeypatch.setattr("studio.engine.strategies.drafting.RISK_SHARE", risk)
    planner = _block_planner(CostTable({}, 0, (1.0, 1.0, 1.0, 1.42)), 1.0)   # pinned: every draft accepted
    ctx, waited = run_of(planner), 0
    while not planner.draft_pays(filled=1, masked=3):
        assert run_of(planner).events[-1]["drafts"] == 0
        ctx.table_ms, ctx.n_out, ctx.step, waited = ctx.table_ms + 1.0, ctx.n_out + 1, ctx.step + 1, waited + 1
    assert waited == (9 if risk < 1 else 0)
    assert run_of(planner).events[-1]["drafts"] == 2


def _run(engine, params, n=40):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(0.0), seed=0)
    return run_to_end(engine, make_strategy("isd", params), s, "", [1, 2, 3, 4])


@pytest.mark.parametrize("costs", [(1.0,) + (50.0,) * 15, (1.0,) * 16])
def test_a_run_plans_each_forward_from_its_costs_and_says_so(monkeypatch, costs):
    """Rows 50x dearer than a step: every forward is a plain AR step; rows free: every forward drafts (as many as
    the acceptance by slot makes best: a long chain that is rejected early costs a cold round). The plan is in
    the events and the output is ar's either way."""
    engine = tiny_engine("llama", seed=3, vocab=24)
    table = CostTable({}, 0, costs)
    monkeypatch.setattr("studio.run.session.cost_table", lambda engine: table)
    got = _run(engine, {"stride": 4, "lookup": 0})   # the MASK rows' plan alone: no drafts copied from the context
    plans = [e for e in got.events if e["t"] == "plan"]
    forwards = [e for e in got.events if e["t"] == "forward"]
    drafts = {p["drafts"] for p in plans}
    assert len(plans) == len(forwards) and all(p["max_drafts"] == 3 for p in plans)
    if costs[1] > 1:
        assert drafts == {0}
        assert {f["n_tokens"] for f in forwards[1:]} == {1}
        assert all(p["gain"] == pytest.approx(1.0) for p in plans)
    else:
        # rows free, but not the drafting work (MARGIN a drafting forward, the regret bound's charge): a run whose
        # first drafts are refused takes a few AR steps, and most forwards still draft
        drafting = [p for p in plans if p["drafts"]]
        assert 3 in drafts and len(drafting) > 0.7 * len(plans) and all(p["gain"] > 1.0 for p in drafting)
        assert max(f["n_tokens"] for f in forwards) == 7
    assert got.token_ids == _run(engine, {"stride": 4, "drafting": "fixed"}).token_ids == _run(engine, {}).token_ids


@pytest.mark.parametrize("name", ["isd", "jacobi", "jacobi-mr"])
def test_a_plan_spends_no_rows_on_drafts_past_the_end(monkeypatch, name):
    """Rows free: every plan takes as many drafts as it has, except that none is proposed for the last position or
    beyond (the forward writes a token of its own after the drafts it accepts, so a draft there only adds a row).
    The plans shrink over the last steps, and the output is still ar's. (The regret bound lifted: refused probes would
    hold this tiny model's runs to AR steps.)"""
    plan_with(monkeypatch, (1.0,) * 16)
    monkeypatch.setattr("studio.engine.strategies.drafting.REGRET_SHARE", 1.0)
    engine = tiny_engine("llama", seed=3, vocab=24)
    n = 11
    got = generate(engine, name, {"lookup": 0, **({"block_size": 6, "spawn_ratio": 0.2} if name == "jacobi-mr" else {})},
                   n=n)
    proposed = [p for e in got.events if e["t"] == "propose" for p in e["pos"]]
    assert proposed and max(proposed) <= n - 2
    if name != "isd":   # pending at n_out - 1, its drafts (and Jacobi MR's pseudo blocks) after it: none at n - 1
        written = 0
        for e in got.events:
            written += len(e["pos"]) if e["t"] == "emit" else 0
            assert not (e["t"] == "forward" and e["role"] == "jacobi" and e["n_tokens"] > n - written), (e, written)
        if name == "jacobi-mr":
            assert any(e["t"] == "block" and e["op"] == "open" for e in got.events)
    plans = [e for e in got.events if e["t"] == "plan"]
    assert plans[-1]["drafts"] < plans[-1]["max_drafts"]
    assert got.token_ids == generate(engine, "ar", n=n).token_ids


def test_the_plan_shows_in_the_tui_metrics_and_the_web_trajectory(monkeypatch):
    from studio.tui.widgets.metrics import metrics_text
    from studio.viz.view import RunView
    from studio.web.render import row_html
    from tests.support.plans import ISD_MIXED, plan_with

    plan_with(monkeypatch, ISD_MIXED)
    got = _run(tiny_engine("llama", seed=3, vocab=24), {"stride": 4})
    plans = {e["step"]: e for e in got.events if e["t"] == "plan"}
    ar_step = next(s for s, p in plans.items() if s and p["drafts"] == 0)
    drafting = next(s for s, p in plans.items() if s and p["drafts"] > 0)
    view = RunView()
    view.feed(got.events)
    assert "plan     AR step (drafts do not pay)" in metrics_text(view.upto(ar_step), "", 60).plain
    p = plans[drafting]
    assert f"plan     {p['drafts']}/3 drafts for {p['gain']:.2f}× AR" in metrics_text(view.upto(drafting), "", 60).plain
    assert f">d{p['drafts']}</b>" in row_html(view.grid, drafting) and ">d0</b>" in row_html(view.grid, ar_step)
    assert "no draft pays" in row_html(view.grid, ar_step)


def test_a_run_that_planned_ar_steps_says_so_in_its_diagnostics(monkeypatch):
    """TPF ~1 is not 'parallelism collapsed' when the planner chose it: the trace report says why."""
    from studio.viz.stats import diagnostics
    from tests.support.plans import plan_with

    plan_with(monkeypatch, (1.0,) + (50.0,) * 15)
    notes = diagnostics(_run(tiny_engine("llama", seed=3, vocab=24), {"stride": 4}).events, "isd")
    assert any("planned 40 of 40 forwards as plain AR steps" in n for n in notes)
    assert not any("collapsed" in n for n in notes)


def test_a_seeded_sampled_run_decodes_the_same_twice():
    """Plans follow the cost table and the verdicts, never a clock: a seed reproduces an auto run."""
    engine = tiny_engine("qwen2", seed=4, vocab=24)
    s = Settings(max_new_tokens=40, sampling=SamplingParams(1.0), seed=7)
    runs = [run_to_end(engine, make_strategy(name, params), s, "", [1, 2, 3, 4])
            for name, params in (("isd", None), ("jacobi-mr", {"block_size": 8})) for _ in range(2)]
    for a, b in (runs[:2], runs[2:]):
        assert a.token_ids == b.token_ids
        plans = [[{k: v for k, v in e.items() if k != "ms"} for e in r.events if e["t"] == "plan"] for r in (a, b)]
        assert plans[0] == plans[1] and len({p["drafts"] for p in plans[0]}) > 1


@pytest.mark.parametrize("name,params", [("s2d2", {"policy": "always", "causal_prefix": True}),
                                         ("simsd", {"draft_steps": 1})])
def test_auto_drafting_falls_back_to_ar_steps_and_back_and_stays_ar(monkeypatch, name, params):
    """Cost-aware drafting on an AR model + block adapter: when a block's drafts do not pay, the step commits the
    block's filled prefix instead -- one row, an AR step -- and the run drafts again once its evidence fades (the
    regret bound lifted: on this tiny model it would hold the run to AR steps after its first refused cycles).
    Greedy output is AR's; every block opened is closed under the name it was opened with."""
    monkeypatch.setattr("studio.engine.strategies.drafting.REGRET_SHARE", 1.0)
    engine = tiny_dlm("llama", True, vocab=24, seed=7)
    r = generate(engine, name, {"cache": "causal", "block_size": 4, "lookup": 0, **params}, n=100)   # no copied drafts
    assert r.token_ids == generate(engine, "ar", n=100).token_ids
    plans = planned(r)
    drafted = [i for i, d in enumerate(plans) if d]
    assert 0 in plans and len(drafted) >= 3 and drafted[-1] > plans.index(0)   # drafts again after AR steps
    early = [e["n_tokens"] for e in r.events if e["t"] == "forward" and e["role"] == "commit" and e["n_tokens"] < 4]
    assert len(early) == plans.count(0) and 1 in early      # each fallback commits a filled prefix; some are AR steps
    opened_ = [(e["start"], e["end"]) for e in r.events if e["t"] == "block" and e["op"] == "open"]
    closed = [(e["start"], e["end"]) for e in r.events if e["t"] == "block" and e["op"] == "close"]
    assert closed == opened_[:len(closed)] and len(opened_) - len(closed) <= 1


@pytest.mark.parametrize("name", ["s2d2", "simsd"])
def test_the_ar_steps_of_a_block_strategy_verify_drafts_looked_up_in_the_context(name):
    """Prompt lookup on the AR steps cost-aware drafting falls back to: the commit forward of a block's filled prefix
    also carries the tokens that followed the context's last tokens where they occurred before, and its rows verify
    them. On a model that cycles they are right (its MASK rows, untrained, are not), so the run commits several
    tokens a forward and still writes exactly ar's tokens; lookup=0 copies none."""
    from tests.strategies.test_jacobi import cycling_engine, ngram_accepted
    engine = cycling_engine()
    ar = generate(engine, "ar", n=60)
    params = {"cache": "causal", "block_size": 4, "drafting": "auto"}
    on = generate(engine, name, params, n=60)
    off = generate(engine, name, dict(params, lookup=0), n=60)
    assert on.token_ids == off.token_ids == ar.token_ids
    assert ngram_accepted(on) > 0 and ngram_accepted(off) == 0
    assert on.footer["tpf"] > off.footer["tpf"] + 0.5, (on.footer["tpf"], off.footer["tpf"])


@pytest.mark.parametrize("name", ["s2d2", "simsd"])
def test_sampled_block_runs_with_looked_up_drafts_keep_the_ar_law(monkeypatch, name):
    """Whole sequences, real KV: costs under which a block's cycle never pays but a 2-row forward does make every step
    an AR step, a prompt that repeats gives them drafts to copy, and the sampled law of the first three tokens is
    still the model's own (block-size-1) law. Five tokens are written, the law of the first three is tested: drafts
    are capped by the tokens left, so the later ones leave room for the early steps to look up."""
    from tests.support.dlm import block_size_one_law
    from tests.support.exact import chi_square_pvalue
    plan_with(monkeypatch, (1.0, 1.05) + (50.0,) * 14)
    engine = tiny_dlm("llama", True, vocab=6, seed=11, dim=16, layers=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    law = block_size_one_law(engine, prompt, 3, SamplingParams(1.0))
    params = {"cache": "causal", "block_size": 4, "drafting": "auto", "lookup": 1}
    runs = [generate(engine, name, dict(params, policy="always") if name == "s2d2" else params, prompt=prompt, n=5,
                     temperature=1.0, seed=seed) for seed in range(4000)]
    assert chi_square_pvalue([tuple(r.token_ids[:3]) for r in runs], law) > 0.01
    looked_up = sum(any(e["t"] == "propose" and e["src"] == "ngram" for e in r.events) for r in runs)
    assert looked_up > len(runs) // 2, looked_up


def test_a_planner_reads_no_token_of_its_run(monkeypatch):
    """A plan may depend on verdicts, costs and how many tokens are out, never on the tokens (docs/verification.md):
    the planners of a real run hold a view without the output, the cache or the model."""
    engine = tiny_engine(vocab=12)
    s = Settings(max_new_tokens=6, sampling=SamplingParams(1.0), seed=0)
    run = Run(prepare(engine, make_strategy("jacobi")), s, "", [1, 2, 3])
    drive([run])
    planner = run.strategy.planners["jacobi"]
    assert planner.ctx.n_out == len(run.result.token_ids)
    for name in ("out", "kv", "model", "gen", "sampling", "tokenizer"):
        assert not hasattr(planner.ctx, name), name

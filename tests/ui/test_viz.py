"""Palette, trajectory grid, per-step stats, plotly figures and text renderers (no model needed)."""
from __future__ import annotations

import io
import math
import re
from pathlib import Path

import pytest

from studio import events as ev
from studio.events import read_trace, summarize
from studio.events.metrics import Tally
from studio.viz.grid import build_grid
from studio.viz.palette import (INK, PALETTE, PRIORITY, RICH_FG, RICH_STYLE, RICH_TEXT, State, glyph, legend_text,
                                 tint)
from studio.viz.stats import acceptance, diagnostics, progress
from studio.viz.text import render_plain, rich_step_line, rich_text, step_line
from studio.viz.view import RunView
from tests.support.fixtures.traces import (footer_for, hand_events, synthetic_blockdiff, synthetic_isd, vocab_text,
                                           write_trace)

FIXTURES = Path(__file__).parents[1] / "support" / "fixtures"
C, P, A, RJ, RS, B, U = (State.COMMITTED, State.PROPOSED, State.ACCEPTED, State.REJECTED, State.RESAMPLED,
                         State.BONUS, State.UNMASKED)


# -- palette ----------------------------------------------------------------------------------------
def test_palette_covers_every_state_with_distinct_colour_and_glyph():
    assert set(PALETTE) == set(State)
    for s, (col, g, lab) in PALETTE.items():
        assert re.fullmatch(r"#[0-9A-F]{6}", col), col
        assert len(g) == 1 and lab
    shown = [s for s in State if s is not State.EMPTY]
    assert len({PALETTE[s][0] for s in shown}) == len(shown)
    assert len({PALETTE[s][1] for s in State}) == len(State)
    # precedence of the brief: resample > reject > bonus > accept > unmask > propose
    order = [RS, RJ, B, A, U, P]
    assert [PRIORITY[s] for s in order] == sorted((PRIORITY[s] for s in order), reverse=True)
    assert glyph(U, held=True) != glyph(U)
    assert tint("#000000", 1.0) == "#FFFFFF" and tint("#0072B2", 0.0) == "#0072B2"
    legends = legend_text() + legend_text(canvas=True)
    for s in State:   # every state is in the legend of the runs that show it
        assert s is State.EMPTY or f"{PALETTE[s][1]} " in legends
        assert INK[s].startswith("#")
    assert "░ masked" in legend_text(canvas=True) and "░" not in legend_text()


def test_rich_styles_parse():
    from rich.style import Style

    for s in State:
        Style.parse(RICH_STYLE[s])
        Style.parse(RICH_FG[s])
        Style.parse(RICH_TEXT[s])
    from studio.viz.text import rich_legend, rich_text_legend

    assert "✓ accepted" in rich_legend().plain and "bold: accepted draft" in rich_text_legend().plain


# -- grid -------------------------------------------------------------------------------------------
EXPECTED = {
    0: {0: C, 1: P, 2: P, 3: P},
    1: {0: C, 1: A, 2: A, 3: RS, 4: P, 5: P, 6: P},
    2: {0: C, 1: C, 2: C, 3: C, 4: A, 5: A, 6: A, 7: B},
    3: {**{p: C for p in range(8)}, 8: U, 9: U},
    4: {**{p: C for p in range(8)}, 8: U, 9: U, 10: U},
    5: {**{p: C for p in range(8)}, 8: U, 9: U, 10: U, 11: U},
    6: {p: C for p in range(12)},
}


def test_grid_states_of_hand_made_events():
    g = build_grid(None, hand_events())
    assert g.steps == list(range(7))
    assert g.n_pos == 12
    got = {s: {p: g.state(s, p) for p in range(g.n_pos) if g.state(s, p) is not State.EMPTY} for s in g.steps}
    assert got == EXPECTED
    # held = an unmasked token carried over a step without an event; emitted = emitted at that very step
    held = {k for k, c in g.cells.items() if c.held}
    assert held == {(4, 8), (4, 9), (5, 8), (5, 9), (5, 10)}
    emitted = {k for k, c in g.cells.items() if c.emitted}
    assert emitted == {(0, 0), (1, 1), (1, 2), (1, 3), (2, 4), (2, 5), (2, 6), (2, 7), (6, 8), (6, 9), (6, 10), (6, 11)}


def test_grid_cell_details():
    g = build_grid(None, hand_events())
    c = g.cell(0, 1)
    assert (c.tok, c.q, c.src, c.p, c.ratio) == (101, 0.5, "mask", None, None)
    c = g.cell(1, 1)
    assert (c.tok, c.p, c.q, c.ratio) == (101, 0.9, 0.5, 1.0)
    assert g.cell(1, 2).ratio == pytest.approx(0.2 / 0.4)
    c = g.cell(1, 3)  # reject + resample: the correction's token; p, q and ratio are the rejected draft's, kept apart
    assert (c.tok, c.draft_tok, c.draft_p, c.draft_q) == (103, 150, 0.05, 0.3)
    assert (c.p, c.q, c.ratio) == (None, None, None)
    assert c.kinds == ("reject", "resample", "emit")
    assert g.cell(2, 7).tok == 107 and g.cell(2, 7).kinds == ("bonus", "emit")
    assert g.cell(3, 8).conf == 0.95 and g.cell(4, 8).conf == 0.95
    assert g.cell(6, 8).committed_step == 6 and g.cell(6, 0).committed_step == 0
    assert g.cell(3, 10).state is State.EMPTY and g.cell(1, 7).state is State.EMPTY
    lines = g.cell(1, 3).describe()
    draft = next(i for i, line in enumerate(lines) if line.startswith("rejected draft 150"))
    assert "p=" not in "".join(lines[:draft])             # nothing computed for the correction itself
    assert lines[draft + 1].split() == ["p=0.05", "q=0.3", "min(1,p/q)=0.167"]
    # rows: forward info, routing, kv, blocks
    assert [g.rows[s].role for s in g.steps] == ["prefill", "verify", "verify", "draft", "draft", "draft", "commit"]
    assert g.rows[3].route == {"verify": False, "score": 0.31, "policy": "dynamic"}
    assert g.rows[1].kv == [{"op": "rollback", "from_len": 8, "to_len": 7}]
    assert [(b.start, b.end, b.open_step, b.close_step) for b in g.blocks] == [(8, 12, 3, 5)]
    assert g.rows[2].emitted == [104, 105, 106, 107]


def test_grid_final_tokens_keep_their_provenance():
    g = build_grid(None, hand_events())
    prov = {p: c.state for p, c in sorted(g.final.items())}
    assert prov == {0: C, 1: A, 2: A, 3: RS, 4: A, 5: A, 6: A, 7: B, 8: U, 9: U, 10: U, 11: U}
    assert [g.final[p].tok for p in range(12)] == list(range(100, 112))
    assert g.text == summarize(hand_events())["text"]


def test_token_text_sources():
    g = build_grid(None, hand_events())
    assert g.cell(0, 0).text == "Sure"         # a single-token emit names its token
    assert g.cell(1, 1).text is None           # inside a multi-token emit, nothing else names 101
    g = build_grid(None, hand_events(), token_text=vocab_text)
    assert g.cell(1, 1).text == ","
    assert g.cell(1, 3).draft_text == vocab_text(150)
    # a decoder that fails on an id does not break the grid
    g = build_grid(None, hand_events(), token_text=lambda t: 1 / 0)
    assert g.cell(1, 1).text is None


def test_token_text_by_elimination_and_pieces():
    E = [
        ev.forward(0, 1.0, role="prefill", n_tokens=3, lora_rows=0, wall_ms=1.0),
        ev.emit(0, 1.0, pos=[0], tok=[7], text=" a"),
        ev.forward(1, 2.0, role="verify", n_tokens=3, lora_rows=0, wall_ms=1.0),
        ev.emit(1, 2.0, pos=[1, 2, 3], tok=[7, 8, 7], text=" a big a"),   # one unknown: 8 = " big"
        ev.forward(2, 3.0, role="verify", n_tokens=3, lora_rows=0, wall_ms=1.0),
        {**ev.emit(2, 3.0, pos=[4, 5], tok=[9, 10], text="xyz"), "pieces": ["x", "yz"]},  # extra field
    ]
    for e in E:
        ev.validate_event(e)
    g = build_grid(None, E)
    assert [g.final[p].text for p in range(6)] == [" a", " a", " big", " a", "x", "yz"]
    assert [s.text for s in g.segments] == [" a", " a", " big", " a", "x", "yz"]


def test_grid_handles_unknown_extra_fields_and_empty_input():
    g = build_grid(None, [])
    assert g.steps == [] and g.n_pos == 0 and g.text == ""
    E = [{**ev.forward(0, 1.0, role="prefill", n_tokens=1, lora_rows=0, wall_ms=1.0), "future": 1}]
    assert build_grid(None, E).rows[0].role == "prefill"


def test_grid_of_real_traces_matches_footer_text():
    for name in ("isd_smollm2.jsonl", "ar_smollm2.jsonl"):
        t = read_trace(FIXTURES / name)
        g = build_grid(t.header, t.events)
        assert g.text == t.footer["text"]
        assert len(g.final) == t.footer["n_tokens"]
        assert len(g.steps) == t.footer["forwards"] + 1


def test_block_diffusion_provenance_survives_a_separate_commit_step():
    E = synthetic_blockdiff(16, 8, seed=3)
    g = build_grid(None, E)
    assert {c.state for c in g.final.values()} == {U}
    assert any(c.held for c in g.cells.values())


# -- stats ------------------------------------------------------------------------------------------
def test_acceptance_matches_summarize():
    for E in (hand_events(), synthetic_isd(50, 4, 0.6, seed=2), read_trace(FIXTURES / "isd_smollm2.jsonl").events):
        acc, m = acceptance(E), summarize(E)
        assert acc.by_pos == m["accept_by_pos"]
        assert acc.rate == m["accept_rate"]
    acc = acceptance(hand_events())
    assert acc.per_verify_step == {1: 2, 2: 3}
    assert acc.histogram() == {0: 0, 1: 0, 2: 1, 3: 1}
    assert acc.mean_acceptance_length == pytest.approx(3.5)


def test_progress_series():
    pts = progress(hand_events())
    assert [p.emitted for p in pts] == [1, 3, 4, 0, 0, 0, 4]
    assert [p.unmasked for p in pts] == [0, 0, 0, 2, 1, 1, 0]
    assert [p.forwards for p in pts] == [0, 1, 2, 3, 4, 5, 6]
    assert pts[0].tpf is None and pts[-1].tpf == summarize(hand_events())["tpf"]
    assert pts[-1].kv_len == 15
    assert all(p.progressed for p in pts)


def test_diagnostics_flag_stalls_and_no_parallelism():
    E = hand_events() + [ev.forward(7, 40.0, role="draft", n_tokens=4, lora_rows=0, wall_ms=1.0)]
    assert any("steps 7" in n for n in diagnostics(E))
    real = read_trace(FIXTURES / "isd_smollm2.jsonl").events
    notes = diagnostics(real, "isd")
    assert any("TPF" in n for n in notes) and any("No draft was accepted" in n for n in notes)
    assert not any("TPF" in n for n in diagnostics(read_trace(FIXTURES / "ar_smollm2.jsonl").events, "ar"))


# -- text renderers ---------------------------------------------------------------------------------
def test_plain_rows():
    g = build_grid(None, hand_events(), token_text=vocab_text)
    lines = render_plain(g).splitlines()
    assert len(lines) == len(g.steps) + 1 and lines[-1].startswith("legend:")
    assert lines[0] == '   0 prefill  ■○○○········  +1 "Sure"'
    assert lines[1].startswith("   1 verify   ■✓✓↻○○○·····  +3 ")
    assert lines[2].startswith("   2 verify   ■■■■✓✓✓★····  +4 ")
    assert lines[4] == "   4 draft    ■■■■■■■■◇◇◆·"
    assert lines[6].startswith("   6 commit   ■■■■■■■■■■■■  +4 ")


def test_plain_rows_window_long_outputs():
    g = build_grid(None, synthetic_isd(80, 4, 0.5, seed=1))
    for s in g.steps:
        line = step_line(g, s, width=20)
        glyphs = line[14:].split("  +")[0]
        assert len(glyphs) <= 20
    late = step_line(g, g.steps[-1], width=20)
    assert late[14] == "…"


def test_rich_rows_match_plain_text():
    from rich.console import Console

    g = build_grid(None, hand_events(), token_text=vocab_text)
    for s in g.steps:
        assert rich_step_line(g, s).plain == step_line(g, s)
    assert rich_text(g).plain == g.text
    assert rich_text(g, upto_step=1).plain == "Sure, here are"
    con = Console(file=io.StringIO(), force_terminal=True, color_system="truecolor", width=100)
    con.print(rich_step_line(g, 1))
    assert "\x1b[" in con.file.getvalue()


# -- figures ----------------------------------------------------------------------------------------
def _trace(tmp_path, events, **kw):
    return read_trace(write_trace(tmp_path / "t.jsonl", events, **kw))


def test_trajectory_figure_levels_glyphs_and_hover(tmp_path):
    from studio.viz.figures import trajectory_figure

    t = _trace(tmp_path, hand_events())
    fig = trajectory_figure(t.header, t.events, t.footer, token_text=vocab_text)
    bg, hm = fig.data[0], fig.data[1]
    assert (bg.type, bg.name, hm.type, hm.name) == ("heatmap", "committed", "heatmap", "cells")
    assert len(hm.z) == 7 and len(hm.z[0]) == 12
    assert not math.isnan(hm.z[5][11]) and math.isnan(hm.z[3][10]) and math.isnan(bg.z[3][10])
    assert not math.isnan(bg.z[3][0]) and math.isnan(hm.z[3][0])  # carried committed: background layer
    assert "committed at step 0" in bg.hovertext[3][0]
    assert hm.text[1][3] == "↻" and hm.text[2][7] == "★" and hm.text[4][8] == "◇"
    assert hm.text[3][0] == ""  # old committed cells stay quiet; their emit step shows ■
    assert hm.text[0][0] == "■"
    assert "min(1,p/q)=0.167" in hm.hovertext[1][3] and "token 103" in hm.hovertext[1][3]
    names = [d.name for d in fig.data[2:] if d.showlegend]
    for s in (P, A, RJ, RS, B, U, C):
        assert any(PALETTE[s][1] in n for n in names)
    assert any("held" in n for n in names)
    assert len(fig.layout.shapes) == 1  # the diffusion block
    fig.to_json()


def test_other_figures(tmp_path):
    from studio.viz.figures import (acceptance_by_position_figure, acceptance_length_figure, comparison_figure,
                                    tpf_figure)

    t = _trace(tmp_path, synthetic_isd(40, 4, 0.6, seed=5))
    f = tpf_figure(t.header, t.events, t.footer)
    bars = [d for d in f.data if d.type == "bar"]
    assert sum(sum(d.y) for d in bars) == t.footer["n_tokens"]
    line = [d for d in f.data if d.name and d.name.startswith("running TPF")][0]
    assert line.y[-1] == pytest.approx(t.footer["tpf"])
    f = acceptance_by_position_figure(t.header, t.events, t.footer)
    assert list(f.data[0].y) == pytest.approx(t.footer["accept_by_pos"])
    f = acceptance_length_figure(t.header, t.events, t.footer)
    acc = acceptance(t.events)
    assert sum(f.data[0].y) == acc.verify_steps
    ar = read_trace(FIXTURES / "ar_smollm2.jsonl")
    f = acceptance_by_position_figure(ar.header, ar.events, ar.footer)
    assert not f.data and "no drafts" in f.layout.annotations[0].text
    f = comparison_figure([ar, t, read_trace(FIXTURES / "isd_smollm2.jsonl")])
    assert len([d for d in f.data if d.type == "scatter"]) == 4  # 3 runs + the 1 token/forward line
    assert list(f.data[0].x) == ["ar", "isd #1", "isd #2"]
    # acceptance of a run that verified nothing is "n/a", not 0
    assert f.data[1].text[0] == "n/a"
    f.to_json()


# -- the run view -----------------------------------------------------------------------------------
def numbers_of(n):
    """What the interfaces show of a RunNumbers, comparable with ==."""
    return (n.points, n.tally.n_tokens, n.tally.forwards, n.tpf, n.acceptance, n.tally.decode_rate(), n.tally.text,
            n.footer)


@pytest.mark.parametrize("name", ["isd", "jacobi-mr", "s2d2"])
def test_a_run_view_fed_live_equals_the_view_of_its_trace(name):
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    from studio.run.session import Run, Settings, prepare
    from tests.support.tiny import tiny_dlm, tiny_engine

    engine = tiny_dlm("llama", shift=False, block=4, vocab=20) if name == "s2d2" else tiny_engine(vocab=20, seed=4)
    params = {"block_size": 4} if name == "jacobi-mr" else {}
    run = Run(prepare(engine, make_strategy(name, params)), Settings(24, SamplingParams(1.0), seed=3), "",
              [1, 2, 3, 4, 5])
    live = RunView(run.token_text, run.header)
    while not run.done:
        live.feed(run.advance())
    result = run.result
    live.footer = result.footer
    replayed = RunView.of_trace(ev.Trace(result.header, result.events, result.footer), run.token_text)
    assert live.grid.steps and live.grid == replayed.grid == build_grid(result.header, result.events, run.token_text)
    assert numbers_of(live.numbers) == numbers_of(replayed.numbers)
    assert live.points == progress(result.events) and live.tally.acceptance == acceptance(result.events)
    assert live.text == result.footer["text"] and live.tally.n_tokens == result.footer["n_tokens"]


def test_upto_a_step_equals_a_view_fed_up_to_that_step():
    events = synthetic_isd(40, 4, 0.6, seed=5)
    trace = ev.Trace({}, events, footer_for(events))
    view = RunView.of_trace(trace)
    steps = view.grid.steps
    for k in steps[:-1]:
        fresh = RunView()
        fresh.feed(e for e in events if e["step"] <= k)
        assert numbers_of(view.upto(k)) == numbers_of(fresh.numbers)
    middle = view.upto(steps[len(steps) // 2])
    assert 0 < middle.tally.n_tokens < view.tally.n_tokens and middle.acceptance.verified < view.tally.acceptance.verified
    assert view.upto(steps[-1]).footer == trace.footer and view.upto(-1).last is None


def test_the_decode_rate_counts_from_the_end_of_the_prefill_and_the_footer_has_the_last_word():
    view = RunView()
    view.feed([ev.forward(0, 5.0, role="prefill", n_tokens=4, lora_rows=0, wall_ms=5.0),
               ev.emit(0, 10.0, pos=[0], tok=[1], text="a")])
    assert view.numbers.tok_s() is None            # no decode step yet
    view.feed([ev.forward(1, 20.0, role="verify", n_tokens=3, lora_rows=0, wall_ms=9.0),
               ev.emit(1, 30.0, pos=[1, 2], tok=[2, 3], text="bc")])
    view.feed([ev.forward(2, 40.0, role="verify", n_tokens=3, lora_rows=0, wall_ms=9.0),
               ev.emit(2, 60.0, pos=[3, 4], tok=[4, 5], text="de")])
    assert view.numbers.tok_s() == pytest.approx(4 / 0.050)     # 4 tokens after the prefill in 50 ms
    assert view.upto(1).tok_s() == pytest.approx(2 / 0.020)
    assert view.numbers.tpf == pytest.approx(5 / 2) and view.text == "abcde"
    view.footer = {"tok_s": 12.5}
    assert view.numbers.tok_s() == 12.5


def test_a_trace_view_names_tokens_from_its_emits_then_the_tokenizer():
    trace = ev.Trace({}, hand_events(), None)   # truncated: no footer
    plain = RunView.of_trace(trace)
    assert plain.grid.cell(1, 3).draft_text is None and plain.footer is None   # a rejected draft: never emitted
    named = RunView.of_trace(trace, token_text=lambda t: f"<{t}>")
    assert named.grid.cell(1, 3).draft_text == "<150>"
    assert named.grid.cell(0, 0).text == "Sure"   # an emitted token keeps the text its emit gave it


def test_a_draft_tree_step_shows_its_branch_points_with_the_accepted_path_and_the_refused_and_pruned_siblings():
    """A tree whose root has children x, y and w (x refused, y accepted, w never tried) and y a child z (accepted),
    then a bonus. The cell keeps the path's token; acceptance counts x against slot 1."""
    events = [ev.make("forward", 0, 1.0, role="prefill", n_tokens=3, lora_rows=0, wall_ms=1.0),
              ev.make("emit", 0, 1.0, pos=[0], tok=[1], text="b", pieces=["b"]),
              ev.make("forward", 1, 2.0, role="verify", n_tokens=5, lora_rows=0, wall_ms=1.0),
              ev.make("propose", 1, 2.0, pos=[1, 1, 2, 1], tok=[5, 6, 7, 9], q=[1.0] * 4, src="draft_model",
                      parent=[-1, -1, 1, -1]),
              ev.make("accept", 1, 2.0, pos=[1, 2], tok=[6, 7], p=[0.6, 0.9], q=[1.0, 1.0], node=[1, 2]),
              ev.make("reject", 1, 2.0, pos=1, tok=5, p=0.2, q=1.0, node=0),
              ev.make("bonus", 1, 2.0, pos=3, tok=8),
              ev.make("emit", 1, 2.0, pos=[1, 2, 3], tok=[6, 7, 8], text="ghi", pieces=["g", "h", "i"])]
    grid = build_grid(None, events, token_text=lambda t: chr(97 + t))
    fork = grid.cell(1, 1)
    assert fork.tok == 6 and fork.draft_tok is None
    assert [(t, verdict) for t, _, verdict in fork.branches] == [(5, "refused"), (6, "accepted path"), (9, "pruned")]
    assert grid.cell(1, 2).branches == ()   # one candidate there: a plain cell
    lines = fork.describe()
    assert "draft tree: 3 candidates here" in lines and '  5 "f" refused' in lines and '  6 "g" accepted path' in lines
    assert '  9 "j" pruned' in lines
    assert Tally().feed_all(events).acceptance.by_pos == [0.5, 1.0]
    from studio.viz.svg import trajectory_svg
    from studio.web.render import row_html
    assert row_html(grid, 1).count('<sup class="br">3</sup>') == 1
    report = trajectory_svg(grid)   # the offline HTML report's trajectory
    assert report.count('class="br"') == 1 and '>3</text>' in report

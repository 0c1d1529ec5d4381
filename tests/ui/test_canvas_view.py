"""A masked-diffusion canvas run as the interfaces show it: the grid model's canvas states (masked cells from the
first step, guesses, fills, edits, noise, padding after an early EOS), padding never counted as output, a KV refresh
that leaves the KV length alone, what the inspectors say, the web rows. From the synthetic canvas trace
(tests/support/fixtures/traces.py: synthetic_canvas) and a real canvas run on a tiny masked-diffusion model."""
from __future__ import annotations

from pathlib import Path

import pytest

from studio import events as ev
from studio.events import read_trace
from studio.viz.grid import GridBuilder, build_grid
from studio.viz.palette import State, legend_text
from studio.viz.stats import progress
from studio.viz.text import render_plain, step_line
from studio.viz.view import RunView
from tests.support.fixtures.traces import CANVAS_HEADER, EOS, synthetic_canvas, vocab_text

FIXTURE = Path(__file__).parents[1] / "support" / "fixtures" / "canvas_synthetic.jsonl"
LETTER = {"M": State.MASKED, "P": State.PROPOSED, "U": State.UNMASKED, "C": State.COMMITTED, "E": State.EDITED,
          "N": State.NOISE, "D": State.PADDING}
# the synthetic canvas, step by step (positions 0..11): see synthetic_canvas's docstring
EXPECTED = {0: "MMMMMMMMMMMM", 1: "PUPPMMMMMMMM", 2: "UCPUMMMMMMMM", 3: "CCUEMMMMMMMM", 4: "CCCCNUNNMMMM",
            5: "CCCCUCUMMMMM", 6: "CCCCCCCUMMMM", 7: "CCCCCCCCPUDD", 8: "CCCCCCCCUCDD", 9: "CCCCCCCCCCDD"}


@pytest.fixture(scope="module")
def trace():
    return read_trace(FIXTURE)


@pytest.fixture(scope="module")
def view(trace):
    return RunView.of_trace(trace, vocab_text)


def test_the_fixture_file_is_the_synthetic_canvas_run(trace):
    assert trace.events == synthetic_canvas() and trace.header["canvas"] == CANVAS_HEADER["canvas"]
    assert trace.footer["stop_reason"] == "eos" and trace.footer["n_tokens"] == 10


def test_a_canvas_is_laid_out_from_its_first_step_and_each_event_has_its_state(trace, view):
    first = GridBuilder(vocab_text, header=trace.header)
    first.feed(e for e in trace.events if e["step"] == 0)   # a block open, nothing filled yet
    assert first.grid.n_pos == 12 and [c.state for c in first.grid.row_cells(0)] == [State.MASKED] * 12
    g = view.grid
    assert {s: "".join(k for c in g.row_cells(s) for k, v in LETTER.items() if v is c.state) for s in g.steps} \
        == EXPECTED
    guess = g.cell(1, 0)
    assert (guess.tok, guess.q, guess.src, guess.kinds) == (100, 0.4, "diffusion", ("propose",))
    noise = g.cell(4, 4)   # guessed, then re-noised at the same step: the noise shows, the guess is kept
    assert (noise.tok, noise.guess, noise.q, noise.kinds) == (120, 104, 0.5, ("propose", "remask"))
    remasked = g.cell(5, 7)   # re-noised at step 4, back to MASK at step 5 (the header's mask_id)
    assert remasked.kinds == ("remask",) and "remasked: back to MASK" in remasked.describe()
    edit = g.cell(3, 3)
    assert (edit.old, edit.old_text, edit.tok, edit.conf) == (150, vocab_text(150), 103, 0.92)
    assert g.final[3].state is State.EDITED and g.final[3].filled_step == 3
    assert g.final[5].state is State.UNMASKED and g.final[5].filled_step == 4   # filled at 4, emitted at 5
    assert "legend: " + legend_text(True) in render_plain(g) and "░" in legend_text(True)


def test_an_edited_token_is_held_until_emitted_and_keeps_its_provenance():
    h = {**CANVAS_HEADER, "tokenizer": {"eos_ids": [EOS], "mask_id": 0}, "canvas": {"length": 2, "block_size": 2}}
    g = build_grid(h, [ev.unmask(1, 1.0, pos=[1], tok=[101], conf=[0.5]),
                       ev.edit(2, 2.0, pos=[1], old=[101], tok=[105], conf=[0.9]),
                       ev.unmask(3, 3.0, pos=[0], tok=[100], conf=[0.8]),
                       ev.emit(4, 4.0, pos=[0, 1], tok=[100, 105], text="ab")])
    assert [c.state for c in g.row_cells(3)] == [State.UNMASKED, State.EDITED] and g.cell(3, 1).held
    assert g.final[1].state is State.EDITED and g.final[1].old == 101 and g.segments[-1].state is State.EDITED


def test_padding_after_an_early_eos_is_never_output_nor_counted(trace, view):
    g = view.grid
    assert sorted(g.final) == list(range(10)) and g.final[9].tok == EOS
    assert [g.rows[s].eos_pos for s in g.steps] == [None] * 7 + [9, 9, 9]
    padded = g.cell(9, 10)   # filled at step 8 with an EOS, carried: still padding
    assert padded.state is State.PADDING and padded.tok == EOS and not padded.held
    assert view.tally.n_tokens == trace.footer["n_tokens"] == 10 and view.text == trace.footer["text"]
    # a step's count of tokens filled and emitted later: never the padding filled at steps 8 and 9
    assert [p.unmasked for p in view.points] == [0, 1, 1, 0, 1, 0, 0, 1, 0, 0]
    assert view.points == progress(trace.events)


def test_padding_lasts_only_while_the_eos_does():
    h = {**CANVAS_HEADER, "tokenizer": {"eos_ids": [EOS], "mask_id": 0}, "canvas": {"length": 4, "block_size": 4}}
    g = build_grid(h, [ev.unmask(1, 1.0, pos=[1], tok=[EOS], conf=[0.9]),
                       ev.edit(2, 2.0, pos=[1], old=[EOS], tok=[101], conf=[0.95])])
    assert [c.state for c in g.row_cells(1)] == [State.MASKED, State.UNMASKED, State.PADDING, State.PADDING]
    assert [c.state for c in g.row_cells(2)] == [State.MASKED, State.EDITED, State.MASKED, State.MASKED]


def test_a_kv_refresh_marks_its_step_and_leaves_the_kv_length(view):
    from studio.tui.widgets.metrics import metrics_text
    from studio.web.render import row_html

    assert [p.kv_len for p in view.points[1:]] == [4] * 9
    assert {p.step: p.refreshed for p in view.points if p.refreshed} == {4: ((4, 16),), 7: ((12, 16),)}
    assert view.grid.rows[4].refreshes == [(4, 16)]
    assert "KV       4  ⟳ refresh [4,16)" in metrics_text(view.upto(4), "", 44).plain
    assert "refresh" not in metrics_text(view.upto(5), "", 44).plain
    assert step_line(view.grid, 4).endswith("⟳ refresh [4,16)") and "⟳ refresh [4,16)" in row_html(view.grid, 4)


def test_the_inspectors_explain_an_edited_and_a_padded_cell(view):
    from studio.tui.widgets.inspector import position_history
    from studio.web.render import inspector_html

    g = view.grid
    edited = position_history(g, 3).plain.splitlines()
    assert edited[:3] == ['position 3  " are"  committed at step 3 draft forward · edited (T2T)',
                          " filled at step 2 (conf 0.6)", ' edited at step 3: 150 " the" → 103 " are" (conf 0.92)']
    assert "guess, not verified  q=0.35" in edited[3] and 'T2T edit: 150 " the" → 103 " are"' in edited[5]
    padded = position_history(g, 10).plain.splitlines()
    assert padded[:2] == ["position 10  padding after the EOS at position 9: never output",
                          " filled at step 8 (conf 0.9)"]
    assert "⊘ padding" in padded[2] and "guess, not verified" in padded[2] and "q=0.4" in padded[2]
    assert "not committed yet" in position_history(g, 10, upto_step=6).plain   # no EOS yet at step 6
    assert 'guess 104 " five" not taken' in position_history(g, 4).plain
    web = inspector_html(g, 10)
    assert "padding after the EOS at position 9: never output" in web and "<li>filled at step 8 (conf 0.9)</li>" in web
    assert "T2T edit: 150 &quot; the&quot; → 103 &quot; are&quot;" in inspector_html(g, 3)


def test_the_web_rows_draw_the_whole_canvas_and_escape_its_tokens(trace):
    from studio.web.render import CSS, legend_html, row_html

    g = build_grid(trace.header, trace.events, lambda t: "<i>")
    first = row_html(g, 0)   # the open block's masked cells, then the rest of the canvas as one bar
    assert first.count('class="c s-masked') == 4 and 'class="cb s-masked" data-lo="4" data-n="8"' in first
    assert row_html(g, 4).count('class="c s-noise') == 3 and 'class="c s-edited' in row_html(g, 3)
    assert row_html(g, 9).count('class="c s-padding') == 2 and "+" not in row_html(g, 9)
    assert "&lt;i&gt;" in row_html(g, 4) and "<i>" not in row_html(g, 4)
    assert ".c.s-edited.held{" in CSS and ".cb.s-padding{" in CSS
    assert all(label in legend_html() for label in ("edited (T2T)", "re-noised", "padding (after EOS)", "masked"))


def test_a_real_canvas_run_fed_live_shows_its_canvas_from_the_first_step_as_its_trace_does():
    from studio.engine.strategies import make_strategy
    from studio.run.session import Run, Settings, prepare
    from tests.support.tiny import tiny_mdm

    engine = tiny_mdm()
    run = Run(prepare(engine, make_strategy("canvas", {"block_size": 4})), Settings(8), "", [1, 2, 3])
    live = RunView(run.token_text, run.header)
    first = run.advance()
    live.feed(first)
    assert live.is_canvas and live.grid.n_pos == 8
    assert [c.state for c in live.grid.row_cells(live.grid.steps[0])].count(State.MASKED) >= 7
    while not run.done:
        live.feed(run.advance())
    result = run.result
    replayed = RunView.of_trace(ev.Trace(result.header, result.events, result.footer), run.token_text)
    assert live.grid == replayed.grid and len(live.grid.final) == result.footer["n_tokens"]
    unfilled = {p for p in range(8) if "unmask" not in live.grid.cell(live.grid.steps[0], p).kinds}
    assert all(live.grid.cell(live.grid.steps[0], p).state is State.MASKED for p in unfilled)

"""The chat screen as a daily tool: a layout that fits 80×24 and survives resizes mid-run, input that is never
lost (a refused message stays, focus comes back to it), prefill progress, and the small legends."""
from __future__ import annotations

import asyncio

import pytest

from tests.ui.test_tui import SIZE, fake_clock, press_button, say, session, status, turn, wait_until  # noqa: F401

pytest.importorskip("textual")

from studio.tui.app import StudioApp
from studio.tui.widgets import TokenGrid
from studio.viz.palette import FORWARD_ROLES

SMALL = (80, 24)


def on_screen(app, widget) -> bool:
    """Whether `widget` is shown whole inside the terminal."""
    return widget.display and widget.region.area > 0 and app.screen.region.contains_region(widget.region)


def visible_grid_rows(screen) -> list[str]:
    """The text of the token grid's rows that its scrolled box shows now."""
    box, grid = screen.query_one("#grid-box"), screen.query_one(TokenGrid)
    top = round(box.scroll_offset.y)
    return [grid.render_line(y).text for y in range(top, top + box.scrollable_content_region.height)]


# -- 1. a layout that adapts ---------------------------------------------------------------------
def test_at_80x24_the_input_is_on_screen_and_the_run_panel_folds_away_until_f6():
    async def go():
        app = StudioApp(session("isd", n=12))
        async with app.run_test(size=SMALL) as pilot:
            screen = app.screen
            prompt, side = screen.query_one("#prompt"), screen.query_one("#side")
            assert on_screen(app, prompt) and not side.display
            result = await turn(pilot, "bcdefg")
            assert on_screen(app, prompt) and screen.query_one(TokenGrid).region.area > 0
            await pilot.press("f6")
            await pilot.pause()
            assert on_screen(app, side) and on_screen(app, prompt)
            last_role = [e["role"] for e in result.events if e["t"] == "forward"][-1]
            # drawn while the panel was hidden, redrawn for the width it has once shown
            assert FORWARD_ROLES[last_role][:20] in str(screen.query_one("#metrics").render())
            await pilot.press("f6")
            await pilot.pause()
            assert not side.display
            await pilot.resize_terminal(*SIZE)   # wide: the panel is back by default, f6 hides it there too
            await pilot.pause()
            assert on_screen(app, side)
            await pilot.press("f6")
            await pilot.pause()
            assert not side.display and on_screen(app, prompt)
    asyncio.run(go())


def test_a_resize_mid_run_keeps_the_grid_rows_in_view_and_a_row_s_width_fixed():
    async def go():
        app = StudioApp(session("ar", n=100))
        # 134 columns: the grid is 88 wide, 11 cells a row, but 10 once a scrollbar took two columns
        async with app.run_test(size=(134, 42)) as pilot:
            screen = app.screen
            grid = screen.query_one(TokenGrid)
            await pilot.press("ctrl+t")                 # step mode: the run advances as far as the test asks
            await say(pilot, "bcdef")
            await wait_until(pilot, lambda: screen.worker is not None)

            async def decode_to(n_pos):                 # ar: one position a step, after the prefill's
                for _ in range(n_pos - screen.view.grid.n_pos + 1):
                    screen.worker.step()
                await wait_until(pilot, lambda: screen.view.grid.n_pos >= n_pos)
                await pilot.pause(0.1)                  # the frame that draws it

            await decode_to(2 * grid.per_row())
            per_row = grid.per_row()
            await decode_to(9 * per_row)                # more rows than the box shows: its scrollbar appears
            assert grid.per_row() == per_row            # and no row reflows

            await pilot.resize_terminal(40, 30)         # narrow: four cells a row, the grid grows to many rows
            await pilot.pause()
            await decode_to(grid.grid.n_pos + 4)
            await pilot.resize_terminal(200, 42)        # wide again, mid-run
            await pilot.pause(0.2)
            rows = visible_grid_rows(screen)
            end_row = grid.render_line((grid.grid.n_pos - 1) // grid.per_row()).text
            assert rows[0].strip() and end_row in rows, rows   # not scrolled past the end: the output's end in view
            await pilot.press("escape")
            await wait_until(pilot, lambda: screen.worker is None)
    asyncio.run(go())


# -- 2. nothing typed is lost --------------------------------------------------------------------
KEY_NAMES = {" ": "space", "/": "slash", ".": "full_stop", "_": "underscore"}


async def type_text(pilot, text):
    """Type `text` key by key into whatever has focus, as a user would."""
    await pilot.press(*[KEY_NAMES.get(c, c) for c in text])


def notes(screen, cls="note") -> list[str]:
    return [str(n.render()) for n in screen.query(f".{cls}")]


def test_a_refused_message_stays_in_the_input_with_the_reason_and_a_running_turn_keeps_new_text():
    async def go():
        app = StudioApp(session("ar", n=20))
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            prompt = screen.query_one("#prompt")
            long = "b" * 200                          # more than the tiny model's 128-token context
            await say(pilot, long)
            await pilot.pause()
            assert prompt.value == long and screen.worker is None and app.session.turns == []
            assert "longer than the model's context" in status(app)
            assert any("longer than the model's context" in n for n in notes(screen, "error"))   # whole, in the log

            await pilot.press("ctrl+t")               # step mode holds the turn open
            await say(pilot, "bcdef")
            assert prompt.value == "" and screen.worker is not None   # accepted: the input is free again
            await say(pilot, "next question")
            assert prompt.value == "next question" and "a generation is running: Esc stops it" in status(app)
            await pilot.press("escape")
            await wait_until(pilot, lambda: screen.worker is None)
            await pilot.press("enter")                # what waited in the input is sent now
            await wait_until(pilot, lambda: screen.worker is not None or len(app.session.turns) == 2)
            assert prompt.value == ""
            await pilot.press("escape")
            await wait_until(pilot, lambda: screen.worker is None)

            await say(pilot, "/set")                  # wrong usage: an error, and the line comes back to be mended
            await wait_until(pilot, lambda: status(app).startswith("usage: /set KEY VALUE"))
            assert prompt.value == "/set" and prompt.has_focus
            await say(pilot, "/save")
            await wait_until(pilot, lambda: status(app).startswith("usage: /save FILE"))
            assert screen.query_one("#status").has_class("error") and prompt.value == "/save"
    asyncio.run(go())


def test_focus_comes_back_to_the_input_after_another_screen_and_a_command(tmp_path, monkeypatch):
    async def go():
        app = StudioApp(session("ar", n=8, temperature=0.8))
        async with app.run_test(size=SIZE) as pilot:
            await turn(pilot, "bcdef")
            await pilot.press("ctrl+g")               # the grid has focus, then compare and back
            assert app.screen.query_one(TokenGrid).has_focus
            await pilot.press("f3")
            await wait_until(pilot, lambda: app.screen.id == "compare")
            await pilot.press("f2")
            await wait_until(pilot, lambda: app.screen.id == "chat")
            await pilot.pause()
            assert app.focused is app.screen.query_one("#prompt")
            await type_text(pilot, "/set temperature 0")
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.session.choice.build()[1].sampling.temperature == 0)
            await wait_until(pilot, lambda: "/set: ok" in status(app))
            assert app.focused is app.screen.query_one("#prompt") and app.focused.value == ""
            assert float(app.screen.query_one("#ctl-temperature").value) == 0   # the run panel follows the command
            await type_text(pilot, "/save last")      # a file written: the status line says where, not "ok"
            await pilot.press("enter")
            await wait_until(pilot, lambda: status(app).startswith("saved"))
            assert status(app) == f"saved {(tmp_path / 'last.jsonl').resolve()}"
    monkeypatch.chdir(tmp_path)
    asyncio.run(go())


# -- 3. the prefill as a visible step ------------------------------------------------------------
@pytest.fixture
def slow_chunked_prefill(monkeypatch):
    """Prefill in chunks of 4 tokens, each 0.1 s (a tiny model's would be over before a frame could show it)."""
    import time

    import studio.run.session as sess
    from studio.engine.strategies.base import DecodeContext
    chunk = DecodeContext.prefill_prefix

    def slow_chunk(ctx, tokens, lora_gate):
        time.sleep(0.1)
        chunk(ctx, tokens, lora_gate)
    monkeypatch.setattr(sess, "PREFILL_CHUNK", 4)
    monkeypatch.setattr(DecodeContext, "prefill_prefix", slow_chunk)


@pytest.mark.usefixtures("slow_chunked_prefill")
def test_a_long_prefill_shows_its_progress_and_esc_stops_it_within_a_chunk():
    async def go():
        app = StudioApp(session("ar", n=8))
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            await turn(pilot, "bcd")
            await say(pilot, "bcdefgh" * 14)          # ≈100 prompt tokens: some 25 chunks
            await wait_until(pilot, lambda: "prefilling" in status(app))
            assert " / " in status(app) and "prompt tokens" in str(screen.answer.render())
            metrics = str(screen.query_one("#metrics").render())
            assert "no steps yet" in metrics          # the last turn's numbers went when this one started
            run = screen.worker.runs[0]
            in_at_esc = run.prefill_progress[0]
            screen.action_stop()                      # what Esc does
            assert "stopping after this chunk" in status(app)
            await wait_until(pilot, lambda: screen.worker is None, timeout=5)
            cancelled = run.result
            prompt_len = len(cancelled.header["prompt"]["token_ids"])
            prefilled = sum(e["n_tokens"] for e in cancelled.events if e["t"] == "forward")
            assert cancelled.footer["stop_reason"] == "cancelled" and cancelled.footer["n_tokens"] == 0
            # stopped within a chunk or so of Esc (in_at_esc also counts the first turn's reused tokens)
            assert prefilled < prompt_len and prefilled <= in_at_esc + 4 * 3
            assert "cancelled during the prefill" in status(app)
            # not in the conversation: the message is back in the input, to edit or resend
            assert screen.query_one("#prompt").value == "bcdefgh" * 14 and len(app.session.turns) == 1
    asyncio.run(go())


# -- 4. the small ones ----------------------------------------------------------------------------
def test_step_mode_reads_on_or_off_and_forward_roles_are_explained():
    from studio.tui.screens.help import HelpScreen
    from tests.ui.test_tui import plain

    async def go():
        app = StudioApp(session("isd", n=8))
        async with app.run_test(size=SIZE) as pilot:
            box = app.screen.query_one("#ctl-step")
            off = str(box.label)
            await pilot.press("ctrl+t")
            on = str(box.label)
            assert box.value and "ON" in on and "off" in off and on != off
            assert str(box.render()).startswith("▐X▌")
            await pilot.click("#ctl-step")            # the checkbox itself says the same
            await pilot.pause()
            assert not box.value and str(box.label) == off
            assert str(box.render()).startswith("▐ ▌")   # a box drawn with its X when off read as on

            result = await turn(pilot, "bcdef")
            last_role = [e["role"] for e in result.events if e["t"] == "forward"][-1]
            metrics = str(app.screen.query_one("#metrics").render())
            assert f"·  {last_role}\n{FORWARD_ROLES[last_role][:20]}" in metrics   # the role, then what it does

            await pilot.press("f1")
            text = " ".join(plain(w.content) for w in app.screen.query("Static"))
            assert isinstance(app.screen, HelpScreen) and "forward roles" in text
            assert all(role in text for role in FORWARD_ROLES) and FORWARD_ROLES["cold"][:30] in text
            assert "panel" in text                     # f6, the run panel's toggle
    asyncio.run(go())


def test_the_piped_repl_echoes_each_line_and_separates_the_exchanges():
    import io

    from studio.tui.repl import chat_repl
    s = session("ar", n=6)
    transcript = io.StringIO()                      # stdout and stderr on one terminal, stdin a pipe
    chat_repl(s, stdin=io.StringIO("bcd\n/set seed 3\nefg\n"), stdout=transcript, stderr=transcript)
    exchanges = transcript.getvalue().strip("\n").split("\n\n")
    assert [e.splitlines()[0] for e in exchanges] == ["> bcd", "> /set seed 3", "> efg"]
    for exchange, answer in zip((exchanges[0], exchanges[2]), s.turns):
        lines = exchange.splitlines()
        assert lines[1] == answer.footer["text"] and lines[2].startswith("[ar] ")


@pytest.mark.usefixtures("fake_clock")
def test_snapshot_chat_at_80x24(snap_compare):
    app = StudioApp(session("isd", n=16))

    async def before(pilot):
        await turn(pilot, "bcdefg")
        pilot.app.screen.query_one("#prompt").cursor_blink = False   # a blinking cursor is on or off by the clock
        await pilot.pause()
    assert snap_compare(app, terminal_size=SMALL, run_before=before)


# -- 5. every screen's keys at 80x24 -------------------------------------------------------------
def footer_keys(app) -> list:
    from textual.widgets._footer import FooterKey
    return list(app.screen.query(FooterKey))


def expected_footer_actions(app) -> set[str]:
    """The screen's shown keys and the app's, less the key of the screen already shown."""
    shown = {b.action for b in [*app.screen.BINDINGS, *app.BINDINGS] if b.show}
    return shown - {f"show('{app.screen.id}')"} - {b.action for b in app.screen.BINDINGS if not app.screen.check_action(
        b.action.split("(")[0], ())}


def assert_footer_whole(app) -> None:
    from textual.widgets import Footer
    footer = app.screen.query_one(Footer)
    keys = footer_keys(app)
    assert {k.action for k in keys} == expected_footer_actions(app), app.screen.id
    for part in footer.children:
        assert part.region.right <= SMALL[0], (app.screen.id, part, part.region)


def test_at_80x24_every_screen_s_footer_shows_its_keys_and_the_compare_table_its_verdict(tmp_path):
    """The chat footer ended at "f3 c" (F4 replay cut off), compare's table lost "same as" past the right edge,
    and the strategies field showed "r-isd,canv"."""
    from studio.engine.strategies import make_strategy
    from studio.run.session import Settings, run_to_end
    from tests.support.tiny import tiny_engine
    from tests.ui.test_tui_compare import compare, open_compare
    trace = tmp_path / "isd.jsonl"
    run_to_end(tiny_engine("llama", vocab=20, seed=2), make_strategy("isd"), Settings(16), "bcd", [1, 2, 3],
               trace_path=str(trace))

    async def go():
        app = StudioApp(session("isd", n=10))
        async with app.run_test(size=SMALL) as pilot:
            await pilot.pause()
            assert_footer_whole(app)
            screen = await open_compare(pilot, "r-isd,canvas,jacobi-mr-cpu")
            await pilot.pause()
            specs = screen.query_one("#compare-specs")
            assert specs.content_region.width >= len("r-isd,canvas,jacobi-mr-cpu")
            screen.query_one("#compare-specs").value = "isd,jacobi"
            await compare(pilot, 3)
            await pilot.pause()
            assert_footer_whole(app)
            table = screen.query_one("#compare-table")
            same_as = next(i for i, c in enumerate(table.ordered_columns) if str(c.label) == "same as")
            right = sum(c.get_render_width(table) for c in table.ordered_columns[:same_as + 1])
            assert table.region.x + right <= SMALL[0]
            await pilot.press("f4")
            replay = app.screen
            replay.query_one("#replay-path").value = str(trace)
            await press_button(pilot, "#replay-open-button")
            await wait_until(pilot, lambda: replay.view is not None)
            await pilot.pause()
            assert {"play", "step(1)", "speed(1)"} <= {k.action for k in footer_keys(app)}
            assert_footer_whole(app)
    asyncio.run(go())


@pytest.mark.usefixtures("fake_clock")
def test_snapshot_compare_at_80x24(snap_compare):
    from tests.ui.test_tui_compare import compared_for_a_snapshot
    assert snap_compare(StudioApp(session("ar", n=12)), terminal_size=SMALL, run_before=compared_for_a_snapshot)


def test_snapshot_replay_at_80x24(snap_compare, monkeypatch, tmp_path):
    from tests.ui.test_tui import replay_of_the_fixture_trace
    app = replay_of_the_fixture_trace(monkeypatch, tmp_path)

    async def before(pilot):
        await pilot.press(*["full_stop"] * 8)
        await pilot.pause()
    assert snap_compare(app, terminal_size=SMALL, run_before=before)

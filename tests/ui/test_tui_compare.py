"""The compare screen (F3) driven by its pilot on tiny models: its own settings (greedy to start with, whatever
the chat uses), bad settings and lists refused with nothing run, a cancelled comparison read "so far", pane
headers that fit, and a snapshot."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textual")

from textual.content import Content  # noqa: E402
from textual.widgets import Input  # noqa: E402

from studio.tui.app import StudioApp  # noqa: E402
from studio.tui.screens import compare as compare_screen  # noqa: E402
from studio.tui.screens.compare import ComparePane, fit  # noqa: E402
from tests.ui.test_tui import SIZE, fake_clock, press_button, session, status, wait_until  # noqa: E402, F401

PROMPT = "bcdef"


async def open_compare(pilot, specs: str, **settings: str):
    """F3, then the prompt, the list and the given settings fields (`max_new_tokens="10"`) typed in."""
    await pilot.press("f3")
    screen = pilot.app.screen
    assert screen.id == "compare"
    screen.query_one("#compare-prompt", Input).value = PROMPT
    screen.query_one("#compare-specs", Input).value = specs
    for key, value in settings.items():
        screen.query_one(f"#compare-{key}", Input).value = value
    return screen


def table_rows(table, n_rows: int) -> list[dict[str, str]]:
    """The comparison table's rows as text, by column label."""
    labels = [str(c.label) for c in table.ordered_columns]
    return [dict(zip(labels, map(str, table.get_row_at(i)))) for i in range(n_rows)]


async def compare(pilot, n_rows: int):
    """Run and wait for the table of `n_rows` rows; returns them (`table_rows`)."""
    await press_button(pilot, "#compare-run")
    table = pilot.app.screen.query_one("#compare-table")
    await wait_until(pilot, lambda: table.display and table.row_count == n_rows)
    return table_rows(table, n_rows)


def used(screen) -> str:
    return str(screen.query_one("#compare-used").render())


def test_compare_runs_greedy_whatever_the_chat_samples_with():
    """The chat samples at T=0.8 with 10 tokens; compare starts greedy at the chat's answer length (`tui
    --max-new-tokens`), so lossless strategies match ar token for token, and the line under the panes says what the
    runs used."""
    async def go():
        app = StudioApp(session("ar", n=10, temperature=0.8))
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_compare(pilot, "isd,jacobi")
            assert screen.query_one("#compare-max_new_tokens", Input).value == "10"
            screen.query_one("#compare-max_new_tokens", Input).value = "12"
            assert screen.query_one("#compare-temperature", Input).value == "0.0"
            rows = await compare(pilot, 3)
            assert [row["strategy"] for row in rows] == ["ar", "isd", "jacobi"]
            assert [row["same as"] for row in rows] == ["yes (ar)"] * 3
            assert [row["tokens"] for row in rows] == ["12"] * 3
            assert [v.header["params"]["temperature"] for v in screen.views] == [0.0] * 3
            assert "these runs used: temperature 0 · top-k 0 · top-p 1 · seed 0 · max tokens 12" in used(screen)
            assert app.session.choice.temperature == 0.8   # the chat keeps its own
    asyncio.run(go())


def test_settings_typed_on_the_compare_screen_are_what_every_run_uses():
    async def go():
        app = StudioApp(session("ar", n=10))
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_compare(pilot, "isd", temperature="1.5", top_k="5", top_p="0.9", seed="3",
                                        max_new_tokens="8")
            await compare(pilot, 2)
            for view in screen.views:
                params = view.header["params"]
                assert (params["temperature"], params["top_k"], params["top_p"], params["max_new_tokens"],
                        view.header["seed"]) == (1.5, 5, 0.9, 8, 3)
            line = used(screen)
            assert "temperature 1.5 · top-k 5 · top-p 0.9 · seed 3 · max tokens 8" in line and "sampled" in line
    asyncio.run(go())


def test_two_strategies_in_lock_step_then_the_table_and_at_most_four_runs():
    async def go():
        app = StudioApp(session("ar", n=10))
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_compare(pilot, "isd", max_new_tokens="10")
            rows = await compare(pilot, 2)
            assert [row["strategy"] for row in rows] == ["ar", "isd"] and rows[1]["same as"] == "yes (ar)"   # greedy isd: lossless
            assert [len(v.grid.final) for v in screen.views] == [10, 10]
            screen.query_one("#compare-specs", Input).value = "isd,jacobi,blockdiff,s2d2"
            await press_button(pilot, "#compare-run")
            await wait_until(pilot, lambda: "at most 4 runs" in status(app))
    asyncio.run(go())


BAD_SETTINGS = [
    ("temperature", "warm", "temperature must be a finite number >= 0, got 'warm'"),
    ("temperature", "-1", "temperature must be a finite number >= 0, got -1"),
    ("max_new_tokens", "0", "max tokens must be a whole number >= 1, got '0'"),
    ("max_new_tokens", "1.5", "max tokens must be a whole number >= 1, got '1.5'"),
    ("seed", "-2", "seed must be a whole number >= 0, got '-2'"),
    ("top_p", "0", "top_p must be in (0, 1] (1 = off), got 0"),
]


def test_a_bad_setting_is_refused_marked_and_nothing_runs():
    async def go():
        app = StudioApp(session("ar", n=10))
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_compare(pilot, "isd", max_new_tokens="6")
            await compare(pilot, 2)
            for key, value, reason in BAD_SETTINGS:
                field = screen.query_one(f"#compare-{key}", Input)
                good, field.value = field.value, value
                await press_button(pilot, "#compare-run")
                await wait_until(pilot, lambda reason=reason: status(app) == reason)
                assert field.has_class("-invalid"), key
                assert screen.worker is None and not screen.query(ComparePane)   # the old result is gone too
                assert not screen.query_one("#compare-table").display and used(screen) == ""
                field.value = good
            await compare(pilot, 2)
            assert not screen.query("Input.-invalid")
    asyncio.run(go())


@pytest.mark.parametrize("specs", ["", " , ", "ar"])
def test_nothing_to_compare_with_ar_is_refused_and_the_old_panes_go(specs):
    async def go():
        app = StudioApp(session("ar", n=10))
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_compare(pilot, "isd", max_new_tokens="6")
            await compare(pilot, 2)
            screen.query_one("#compare-specs", Input).value = specs
            await press_button(pilot, "#compare-run")
            await wait_until(pilot, lambda: "nothing to compare with ar" in status(app))
            assert screen.worker is None and not screen.query(ComparePane)
            assert not screen.query_one("#compare-table").display
    asyncio.run(go())


def test_a_cancelled_comparison_reads_so_far(monkeypatch):
    """The runs advance only when the test allows (step mode), so Stop lands mid-way whatever the machine's
    speed: the strategies matched ar on every token both produced, which the table says as "so far"."""
    worker_class = compare_screen.Worker
    monkeypatch.setattr(compare_screen, "Worker", lambda runs: worker_class(runs, step_mode=True))

    async def go():
        app = StudioApp(session("ar", n=10))
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_compare(pilot, "isd,jacobi", max_new_tokens="40")
            await press_button(pilot, "#compare-run")
            await wait_until(pilot, lambda: screen.worker is not None)
            for _ in range(9):   # three prefills, then two steps of each run
                screen.worker.step()
            await wait_until(pilot, lambda: all(v.numbers.tally.n_tokens >= 2 for v in screen.views))
            await press_button(pilot, "#compare-stop")
            table = screen.query_one("#compare-table")
            await wait_until(pilot, lambda: table.display and table.row_count == 3)
            rows = table_rows(table, 3)
            assert [row["stop"] for row in rows] == ["cancelled"] * 3
            ar_tokens = int(rows[0]["tokens"])
            assert 0 < ar_tokens < 40
            for row in rows[1:]:
                assert row["same as"] == f"yes so far (ar, {min(ar_tokens, int(row['tokens']))} tokens)"
    asyncio.run(go())


def test_fit_wraps_between_parts_never_inside_one():
    parts = ["fwd 10", "tok 12", "TPF 1.20", "acc 17%"]
    assert fit(parts, 80) == "fwd 10  tok 12  TPF 1.20  acc 17%"
    assert fit(parts, 16) == "fwd 10  tok 12\nTPF 1.20\nacc 17%"
    assert fit(parts, 3) == "fwd 10\ntok 12\nTPF 1.20\nacc 17%"


def test_four_panes_at_150_columns_show_their_labels_and_numbers_whole():
    async def go():
        app = StudioApp(session("ar", n=10))
        async with app.run_test(size=(150, 45)) as pilot:
            screen = await open_compare(pilot, "jacobi-mr-cpu,isd,jacobi", max_new_tokens="10")
            await compare(pilot, 4)
            await pilot.pause()
            for pane in screen.query(ComparePane):
                title = Content.from_markup(pane.border_title).plain
                assert title == f"✓ {pane.label}" and len(title) <= pane.size.width - 4   # within the corners
                lines = str(pane.query_one(".pane-numbers").render()).splitlines()
                assert "".join(lines).replace(" ", "").startswith("fwd")
                assert all(len(line) <= pane.content_size.width for line in lines), (pane.label, lines)
    asyncio.run(go())


async def compared_for_a_snapshot(pilot) -> None:
    """isd and jacobi against ar, 12 tokens, until the table is shown, filled and laid out (on a loaded machine the
    screenshot once came a refresh before the layout)."""
    await open_compare(pilot, "isd,jacobi", max_new_tokens="12")
    table = pilot.app.screen.query_one("#compare-table")
    await press_button(pilot, "#compare-run")
    await wait_until(pilot, lambda: table.display and table.row_count == 3 and table.size.height > 0)
    await pilot.pause()


def test_snapshot_compare(snap_compare, fake_clock):   # noqa: F811 (the fixture imported above)
    app = StudioApp(session("ar", n=12, temperature=0.8))
    assert snap_compare(app, terminal_size=SIZE, run_before=compared_for_a_snapshot)

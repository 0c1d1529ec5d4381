"""The Textual studio driven by its pilot on tiny models: chat turns, every strategy, stop, step mode,
parameters, compare, replay, bad input, help; and snapshots of the chat, compare and replay screens."""
from __future__ import annotations

import asyncio
import functools
import io
import itertools
import pathlib
import time

import pytest

from studio.run.chat import ChatSession
from studio.run.config import RunConfig
from studio.engine.strategies import STRATEGIES
from studio.run.session import CANCELLED, Settings, run_to_end
from tests.support.tiny import tiny_dlm, tiny_engine

pytest.importorskip("textual")

from studio.tui.app import StudioApp  # noqa: E402
from studio.tui.screens.help import HelpScreen  # noqa: E402
from studio.tui.widgets import MetricsPanel, TokenGrid  # noqa: E402
from studio.tui.widgets.controls import Controls  # noqa: E402
from studio.tui.widgets.inspector import _num  # noqa: E402

SIZE = (130, 42)
BLOCK = ("blockdiff", "s2d2", "simsd", "canvas")


def session(name="ar", n=12, engine=None, **kw):
    return ChatSession(engine or tiny_engine("llama", vocab=20, seed=2), RunConfig(name, max_new_tokens=n, **kw))


async def wait_until(pilot, predicate, timeout=60.0):
    """Let the app run until `predicate()` holds (one pause is not enough when workers and timers run).
    The deadline is wall-clock and generous: on a loaded 2-core CI runner a tiny run can take 20 s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for the app; status: {status(pilot.app)}")
        await pilot.pause(0.02)


async def press_button(pilot, selector):
    """Click a button once it can be pressed: Textual ignores clicks for 0.2 s after the last press (its
    "-active" effect), and a tiny run can end sooner than that."""
    button = pilot.app.screen.query_one(selector)
    await wait_until(pilot, lambda: not button.has_class("-active"))
    await pilot.click(selector)


async def say(pilot, text):
    prompt = pilot.app.screen.query_one("#prompt")
    prompt.focus()
    prompt.value = text
    await pilot.press("enter")


async def turn(pilot, text):
    """Send a message and wait until its turn is in the conversation."""
    s = pilot.app.session
    before = len(s.turns)
    await say(pilot, text)
    await wait_until(pilot, lambda: len(s.turns) > before and pilot.app.screen.worker is None)
    return s.turns[-1]


def plain(renderable) -> str:
    """What a Rich renderable (a table, a text) shows, as plain text."""
    from rich.console import Console
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def status(app) -> str:
    return str(app.screen.query_one("#status").render())


def test_chat_two_turns_stream_into_the_grid_and_the_second_reuses_the_kv():
    async def go():
        app = StudioApp(session("isd", n=10))
        async with app.run_test(size=SIZE) as pilot:
            first = await turn(pilot, "bcdefg")
            second = await turn(pilot, "hij")
            screen = app.screen
            assert [m["role"] for m in app.session.conversation.messages] == ["user", "assistant"] * 2
            prefill = next(e for e in second.events if e["t"] == "forward" and e["role"] == "prefill")
            assert prefill["n_tokens"] < len(second.header["prompt"]["token_ids"])   # only the new tokens
            assert len(screen.query_one(TokenGrid).grid.final) == second.footer["n_tokens"]
            assert str(screen.answer.render()) == second.footer["text"]
            assert f"{second.footer['forwards']} forwards" in status(app)
            numbers = str(screen.query_one(MetricsPanel).render())
            assert f"forwards {second.footer['forwards']}" in numbers and f"tokens {second.footer['n_tokens']}" in numbers
            assert first.token_ids != second.token_ids
    asyncio.run(go())


def test_a_first_cost_aware_turn_measures_the_costs_off_the_ui_thread_and_says_so(monkeypatch):
    """The first turn of a cost-aware strategy on a model without a stored cost table measures one (20-30 s on a
    2-core CPU): the status says so, the UI keeps answering meanwhile, and the turn starts once the table is in."""
    import threading
    from studio.engine.cost_table import FLAT_COSTS
    release, stored, on_ui_thread = threading.Event(), {}, []

    def measure(engine):
        if "table" not in stored:
            on_ui_thread.append(threading.current_thread() is threading.main_thread())
            release.wait(30)
            stored["table"] = FLAT_COSTS
        return stored["table"]
    monkeypatch.setattr("studio.run.session.stored_table", lambda engine: stored.get("table"))
    monkeypatch.setattr("studio.run.session.cost_table", measure)

    async def go():
        app = StudioApp(session("isd", n=6))
        async with app.run_test(size=SIZE) as pilot:
            await say(pilot, "bcd")
            await wait_until(pilot, lambda: "measuring this machine's forward costs" in status(app))
            users = lambda: [str(m.render()) for m in app.screen.query(".user")]
            assert users() == ["bcd"] and app.screen.query_one("#prompt").value == ""   # shown as sent meanwhile
            await say(pilot, "efg")   # the UI answers while the table is measured; the new text waits in the input
            assert "the turn starts when they are in" in status(app)
            assert not app.session.turns and on_ui_thread == [False]
            release.set()
            await wait_until(pilot, lambda: len(app.session.turns) == 1 and app.screen.worker is None)
            assert app.session.conversation.messages[0]["content"] == "bcd" and users() == ["bcd"]   # once
            assert app.screen.query_one("#prompt").value == "efg"
            await turn(pilot, "efg")   # the table is stored: the next turn starts at once
            assert len(app.session.turns) == 2 and on_ui_thread == [False]
    asyncio.run(go())


def test_every_strategy_runs_in_the_chat():
    async def go():
        engines = {"ar": tiny_engine("llama", vocab=20, seed=2), "dlm": tiny_dlm("llama", shift=True, block=4, vocab=20)}
        for name in (n for n in STRATEGIES if n != "gemma-canvas"):   # it decodes DiffusionGemma only
            engine = engines["dlm" if name in BLOCK else "ar"]
            app = StudioApp(session("ar", n=8, engine=engine))
            async with app.run_test(size=SIZE) as pilot:
                await say(pilot, f"/strategy {name}")
                await wait_until(pilot, lambda: app.session.choice.label == name)
                if name == "jacobi-mr":   # its default blocks (64 × 6 rows) do not fit a 128-token tiny model
                    await say(pilot, "/set block_size 4")
                    await wait_until(pilot, lambda: app.session.choice.params == {"block_size": 4})
                result = await turn(pilot, "bcdef")
                assert result.header["strategy"] == name and result.footer["n_tokens"] > 0
                assert len(app.screen.query_one(TokenGrid).grid.final) == result.footer["n_tokens"], name
                alone = run_to_end(engine, *app.session.choice.build(), "", result.header["prompt"]["token_ids"])
                assert result.token_ids == alone.token_ids, name
    asyncio.run(go())


def test_step_mode_advances_one_step_per_key_and_stop_cancels_then_the_chat_goes_on():
    async def go():
        app = StudioApp(session("isd", n=40))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+t")
            assert app.screen.step_mode
            await say(pilot, "bcdef")
            screen = app.screen
            await pilot.pause(0.2)
            assert screen.view.points == []          # nothing runs before the first step is asked for
            for k in range(1, 4):
                await pilot.press("ctrl+n")
                await wait_until(pilot, lambda: len(screen.view.points) == k)
                await pilot.pause(0.1)
                assert len(screen.view.points) == k  # exactly one more step, no more
            await pilot.press("escape")
            await wait_until(pilot, lambda: screen.worker is None)
            cancelled = app.session.turns[-1]
            assert cancelled.footer["stop_reason"] == CANCELLED and cancelled.footer["forwards"] == 2
            await pilot.press("ctrl+t")
            assert not screen.step_mode
            again = await turn(pilot, "gh")
            assert again.footer["stop_reason"] != CANCELLED and again.footer["n_tokens"] > 0
    asyncio.run(go())


def test_stop_mid_run_without_step_mode():
    async def go():
        app = StudioApp(session("ar", n=100))
        async with app.run_test(size=SIZE) as pilot:
            app.session.choice = app.session.choice.set("max_new_tokens", 100)
            await say(pilot, "bcdef")
            await pilot.press("escape")
            await wait_until(pilot, lambda: app.screen.worker is None)
            r = app.session.turns[-1]
            assert r.footer["stop_reason"] in (CANCELLED, "max_new_tokens")
            assert "stop" in status(app)
    asyncio.run(go())


def test_parameters_from_the_controls_and_bad_values_stay_in_the_ui():
    async def go():
        app = StudioApp(session("isd"))
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            field = screen.query_one("#ctl-n")
            field.value = "3"
            field.focus()
            await pilot.press("enter")
            await pilot.pause()
            assert app.session.choice.params == {"stride": 3}
            result = await turn(pilot, "bcdef")
            assert result.header["params"]["stride"] == 3
            field.value = "0"
            field.focus()
            await pilot.press("enter")
            await pilot.pause()
            assert field.has_class("-invalid") and "stride must be >= 2" in status(app)
            assert app.session.choice.params == {"stride": 3}
            temperature = screen.query_one("#ctl-temperature")
            temperature.value = "0.7"
            temperature.focus()
            await pilot.press("enter")
            await pilot.pause()
            assert app.session.choice.build()[1].sampling.temperature == 0.7
            await say(pilot, "/set stride banana")
            await wait_until(pilot, lambda: "error" in status(app) and "stride" in status(app))
            await say(pilot, "/strategy nope")
            await wait_until(pilot, lambda: "unknown strategy or preset 'nope'" in status(app))
            assert app.is_running and app.session.choice.label == "isd"
            await say(pilot, "/set")   # wrong usage is an error, shown whole in the log, not "/set: ok"
            await wait_until(pilot, lambda: status(app).startswith("usage: /set KEY VALUE"))
            notes = [str(n.render()) for n in screen.query(".note")]
            assert any("presets: " in n and "simsd-cpu" in n for n in notes)   # the long error, whole
    asyncio.run(go())



def test_replay_a_trace_scrub_and_play(tmp_path):
    engine = tiny_engine("llama", vocab=20, seed=2)
    path = tmp_path / "isd.jsonl"
    from studio.engine.strategies import make_strategy
    run_to_end(engine, make_strategy("isd"), Settings(16), "bcd", [1, 2, 3], trace_path=str(path))

    async def go():
        app = StudioApp(session())
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f4")
            screen = app.screen
            screen.query_one("#replay-path").value = str(path)
            await press_button(pilot, "#replay-open-button")
            await wait_until(pilot, lambda: screen.view is not None)
            assert "replay isd" in str(screen.query_one("#replay-title").render())
            assert screen.index == 0
            await pilot.press("full_stop", "full_stop")
            assert screen.index == 2
            await pilot.press("comma")
            assert screen.index == 1
            grid = screen.query_one(TokenGrid)
            assert grid.step == screen.step
            await pilot.press("right")     # the grid cursor: the inspector follows it
            assert "position 0" in str(screen.query_one("#inspector").render())
            await pilot.press("plus", "plus", "plus", "space")
            await wait_until(pilot, lambda: not screen.playing)
            assert screen.index == len(screen.view.grid.steps) - 1
    asyncio.run(go())


def test_bad_trace_and_tui_trace_option_without_a_model(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "header", "schema": "dlm-studio.trace/9"}\n')

    async def go():
        app = StudioApp(session())
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f4")
            app.screen.query_one("#replay-path").value = str(bad)
            await press_button(pilot, "#replay-open-button")
            await wait_until(pilot, lambda: "unsupported trace schema" in status(app))
            assert app.is_running and app.screen.view is None
        app = StudioApp(None)
        async with app.run_test(size=SIZE) as pilot:
            assert app.screen.id == "replay"
            await pilot.press("f2")
            assert app.screen.id == "replay"    # no model: chat refuses with a notification
    asyncio.run(go())


def test_help_screen_lists_the_bindings():
    async def go():
        app = StudioApp(session())
        async with app.run_test(size=SIZE) as pilot:
            app.screen.query_one(TokenGrid).focus()
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            text = " ".join(plain(w.content) for w in app.screen.query("Static"))
            for words in ("step mode", "compare", "replay", "/strategy NAME|PRESET", "prev token"):
                assert words in text
            await pilot.press("escape")
            assert app.screen.id == "chat"
    asyncio.run(go())


def test_a_failing_model_load_is_a_message_not_a_crash(tmp_path):
    async def go():
        app = StudioApp(session())
        async with app.run_test(size=SIZE) as pilot:
            await say(pilot, f"/model {tmp_path / 'missing'}")
            await wait_until(pilot, lambda: "error" in status(app))
            assert app.is_running and app.session.engine.name == "tiny-llama"
    asyncio.run(go())


# -- snapshots ------------------------------------------------------------------------------------
class FakeClock:
    """A deterministic perf_counter for the decode loop: every call is 10 ms later."""
    def __init__(self):
        self._t = itertools.count()

    def perf_counter(self):
        return next(self._t) * 0.01


def test_the_inspector_gives_a_resampled_token_the_rejected_drafts_p_and_q_not_its_own():
    async def go():
        app = StudioApp(session("isd", n=16))
        async with app.run_test(size=SIZE) as pilot:
            await turn(pilot, "bcdefg")
            reject = next(e for e in app.session.turns[-1].events if e["t"] == "reject")
            grid = app.screen.query_one(TokenGrid)
            grid.focus()
            grid.cursor = reject["pos"]
            await pilot.pause()
            text = str(app.screen.query_one("#inspector").render())
            line = next(x for x in text.splitlines() if "resampled" in x and f"step {reject['step']:>4}" in x)
            own, draft = line.split("replaced rejected draft")
            assert "p=" not in own and "q=" not in own      # nothing was computed for the correction itself
            assert f"p={_num(reject['p'])}" in draft and f"q={_num(reject['q'])}" in draft
    asyncio.run(go())


@pytest.fixture
def fake_clock(monkeypatch):
    import studio.engine.strategies.base as base
    import studio.run.session as sess
    clock = FakeClock()
    monkeypatch.setattr(base, "time", clock)
    monkeypatch.setattr(sess, "time", clock)
    return clock


def test_snapshot_chat(snap_compare, fake_clock):
    app = StudioApp(session("isd", n=16))

    async def before(pilot):
        await turn(pilot, "bcdefg")
        app.screen.query_one(TokenGrid).focus()
        await pilot.press("right", "right")
        await pilot.pause()
    assert snap_compare(app, terminal_size=SIZE, run_before=before)



def replay_of_the_fixture_trace(monkeypatch, tmp_path) -> StudioApp:
    """The app replaying tests/support/fixtures' isd_smollm2.jsonl, drawn the same on every machine."""
    from studio.engine import model_cache
    from studio.events import read_trace
    from tests.support.fixtures import traces
    monkeypatch.chdir(pathlib.Path(traces.__file__).parent)   # the path field shows the path as given
    # the same picture whether or not this machine has the trace's tokenizer (it names proposals)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(model_cache, "_find_tokenizer", functools.lru_cache(model_cache._find_tokenizer.__wrapped__))
    return StudioApp(None, trace=read_trace("isd_smollm2.jsonl"))


def test_snapshot_replay(snap_compare, monkeypatch, tmp_path):
    app = replay_of_the_fixture_trace(monkeypatch, tmp_path)

    async def before(pilot):
        await pilot.press(*["full_stop"] * 8, "right", "right", "right")
        await pilot.pause()
    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_snapshot_canvas_replay_of_a_newer_minor_trace(snap_compare, monkeypatch, tmp_path):
    """The synthetic canvas (tests/support/fixtures) as a trace of schema 1.4 with one event of a kind this build
    does not know: the title warns of it; at step 7 the grid shows the filled output, a guess, the EOS and the
    padding after it, the metrics panel a KV refresh, the inspector the padded cell under the cursor."""
    from studio.events import read_trace
    from tests.support.fixtures import traces
    traces.newer_minor(pathlib.Path(traces.__file__).parent / "canvas_synthetic.jsonl", tmp_path / "canvas-1.4.jsonl")
    monkeypatch.chdir(tmp_path)   # the path field shows the path as given
    app = StudioApp(None, trace=read_trace("canvas-1.4.jsonl"))

    async def before(pilot):
        title = str(app.screen.query_one("#replay-title").render())
        assert "1 event(s) of a newer schema skipped" in title and "1 event(s) of kinds" in status(app)
        await pilot.press(*["full_stop"] * 7, "end", "left")
        await pilot.pause()
    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_metrics_panel_widget_counts_from_the_runs_tally():
    from studio.viz.view import RunView
    engine = tiny_engine("llama", vocab=20, seed=2)
    from studio.engine.strategies import make_strategy
    r = run_to_end(engine, make_strategy("isd"), Settings(12), "", [1, 2, 3])
    view = RunView()
    view.feed(r.events)
    accept = view.tally.acceptance

    async def go():
        app = StudioApp(None)
        async with app.run_test(size=SIZE):
            panel = app.screen.query_one(MetricsPanel)
            panel.show(view.numbers, "isd")
            text = str(panel.render())
            assert f"forwards {r.footer['forwards']}" in text and f"TPF      {r.footer['tpf']:.2f}" in text
            assert f"tok/s    {view.tally.decode_rate():.1f}" in text     # live: the events' decode rate
            assert f"({accept.accepted}/{accept.verified})" in text
            slots = [line for line in text.splitlines() if line.startswith("slot ")]
            assert len(slots) == len(accept.by_pos)
            view.footer = r.footer
            panel.show(view.numbers, "isd")
            assert f"tok/s    {r.footer['tok_s']:.1f}" in str(panel.render())   # finished: the run's own
    asyncio.run(go())


# -- the run panel's N and τ --------------------------------------------------------------------------
async def submit(pilot, selector, value):
    field = pilot.app.screen.query_one(selector)
    field.value = value
    field.focus()
    await pilot.press("enter")
    await pilot.pause()


def test_n_and_tau_set_the_parameter_with_that_role_in_each_strategy():
    # (N, τ) of each strategy; None: the field is disabled
    roles = {"ar": (None, None), "isd": ("stride", "tau"), "r-isd": ("stride", "tau"), "jacobi": ("block_size", None),
             "jacobi-mr": ("block_size", None), "lookup-tree": ("depth", None), "dflash": ("block", None),
             "blockdiff": ("block_size", "threshold"),
             "s2d2": ("block_size", "threshold"), "simsd": ("block_size", "threshold"),
             "canvas": ("block_size", "threshold"), "gemma-canvas": ("canvas_length", "entropy_bound")}
    assert set(roles) == set(STRATEGIES)

    async def go():
        app = StudioApp(session())
        async with app.run_test(size=SIZE) as pilot:
            for name, (n, tau) in roles.items():
                app.session.choice = RunConfig(name)
                app.screen.query_one(Controls).sync(app.session.choice, app.session.engine)
                for selector, param, value in (("#ctl-n", n, "3"), ("#ctl-tau", tau, "0.5")):
                    field = app.screen.query_one(selector)
                    assert field.disabled == (param is None), (name, selector)
                    if param is not None:
                        await submit(pilot, selector, value)
                        assert app.session.choice.params.get(param) == float(value), (name, selector)
                        assert field.value == value   # the panel shows what was set
    asyncio.run(go())


def test_the_run_panel_shows_the_block_size_a_run_would_use(tmp_path):
    from tests.support.lora import random_adapter
    plain = tiny_engine("llama", vocab=20, seed=2)
    random_adapter(tmp_path, plain.model, block_size=8)
    adapted = plain.with_adapter(str(tmp_path))   # a block adapter trained at B = 8

    async def shown(engine, name):
        app = StudioApp(session(name, engine=engine))
        async with app.run_test(size=SIZE) as pilot:
            value = app.screen.query_one("#ctl-n").value
            await submit(pilot, "#ctl-n", value)   # Enter on what is shown changes nothing
            assert app.session.choice.params == {} and "error" not in status(app)
            result = await turn(pilot, "bcdef")
            # blocks after the first lie wholly in the output (the first one may start in the prompt)
            return value, {e["end"] - e["start"] for e in result.events if e["t"] == "block" and e["start"] > 0}

    assert asyncio.run(shown(adapted, "s2d2")) == ("8 (adapter)", {8})
    assert asyncio.run(shown(tiny_dlm("llama", shift=True, block=4, vocab=20), "simsd")) == ("4 (model)", {4})
    assert asyncio.run(shown(plain, "blockdiff")) == ("4 (default)", {4})
    assert asyncio.run(shown(tiny_engine("llama"), "dflash")) == ("3 (drafter)", set())   # its drafter's block is 4

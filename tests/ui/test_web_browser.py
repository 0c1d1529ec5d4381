"""`dlm-studio web` in a real browser: Debian's chromium, headless, driven by Playwright (nothing downloaded).

Types a prompt, watches the trajectory grow while the run decodes (slow motion, so growth is observable
on any machine), stops it, runs a compare, replays an uploaded trace. Screenshots go to a temp folder and
the last ones are copied to /tmp/web-shots/ to be looked at.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("no /usr/bin/chromium (apt-get install chromium) for the browser test", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

from studio.run.config import RunConfig  # noqa: E402
from studio.run.session import encode_prompt, run_to_end  # noqa: E402
from tests.ui.test_web import XSS, served, web_engine  # noqa: E402
from tests.ui.test_web import pytestmark as _same_warning_filters  # noqa: E402

pytestmark = _same_warning_filters

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
SHOTS = Path("/tmp/web-shots")
CANVAS = Path(__file__).parents[1] / "support" / "fixtures" / "canvas_synthetic.jsonl"


@pytest.fixture(scope="module")
def site():
    engine = web_engine()
    with served(engine) as (app, url):
        yield engine, url


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, site):
    """A fresh page on the app; fails the test if the page asks anything off this machine or pops a dialog."""
    _, url = site
    context = browser.new_context(viewport={"width": 1500, "height": 1100})
    pg = context.new_page()
    outside, dialogs = [], []
    pg.on("request", lambda r: outside.append(r.url) if not r.url.startswith((url, "data:", "blob:")) else None)
    pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    pg.goto(url)
    pg.wait_for_selector("#chat-message textarea")
    yield pg
    context.close()
    assert not outside, f"requests off this machine: {outside[:3]}"
    assert not dialogs, f"the page opened a dialog: {dialogs}"


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("web-shots")
    yield folder
    SHOTS.mkdir(exist_ok=True)
    for png in folder.glob("*.png"):
        shutil.copy(png, SHOTS / png.name)


def pick(pg, dropdown: str, option: str) -> None:
    pg.locator(f"{dropdown} input").click()
    pg.get_by_role("option", name=option, exact=True).click()


def rows(pg, trajectory: str) -> int:
    return pg.locator(f"{trajectory} .r").count()


def test_chat_trajectory_grows_while_decoding_and_stop_ends_it(page, shots):
    pg = page
    pick(pg, "#chat-pick", "isd")
    pg.wait_for_selector("#chat-isd_stride")   # the form now shows isd (and has set its defaults)
    pg.fill("#chat-max_new_tokens input", "80")
    pg.fill("#chat-pace input[type=number]", "60")
    pg.fill("#chat-message textarea", XSS)
    pg.click("#chat-send")
    pg.wait_for_selector("#chat-trajectory .r")
    first = rows(pg, "#chat-trajectory")
    pg.wait_for_timeout(800)
    later = rows(pg, "#chat-trajectory")
    assert later > first                                   # it grows while the run is in progress
    assert "stop" not in pg.inner_text("#chat-status")     # ... and the run has not finished
    pg.screenshot(path=str(shots / "chat-live.png"), full_page=True)
    pg.click("#chat-stop")
    pg.wait_for_function("document.querySelector('#chat-status').innerText.includes('stop cancelled')")
    stopped = rows(pg, "#chat-trajectory")
    pg.wait_for_timeout(400)
    assert rows(pg, "#chat-trajectory") == stopped < 80
    # the prompt is text: shown as typed, no element made of it
    assert pg.locator("#chat-log").get_by_text(XSS).count() == 1 and pg.locator("img[src='x']").count() == 0
    pg.locator("#chat-trajectory .r").nth(2).locator(".c").first.click()
    pg.wait_for_function("document.querySelector('#chat-inspector').innerText.includes('position')")
    pg.screenshot(path=str(shots / "chat-stopped.png"), full_page=True)


def test_compare_draws_runs_side_by_side_then_the_table(page, shots):
    pg = page
    pg.click("#tab-compare-button")
    pg.fill("#cmp-prompt textarea", "bcdef")
    pick(pg, "#cmp-names", "jacobi")
    pg.fill("#cmp-pace input[type=number]", "20")
    pg.fill("#cmp-max_new_tokens input", "80")   # the tiny model's context is 128 tokens
    pg.click("#cmp-run")
    pg.wait_for_selector("#cmp-table table", timeout=60_000)
    counts = [rows(pg, f"#cmp-trajectory-{i}") for i in range(3)]
    assert all(n > 2 for n in counts) and pg.locator("#cmp-trajectory-3").is_hidden()
    assert pg.locator("#cmp-table td", has_text="jacobi").count() == 1
    # finished, every pane starts level at its first step and the start of its rows (they followed runs of other
    # lengths down and sideways), each row's label whole
    panes = [f"#cmp-trajectory-{i} .rows" for i in range(3)]
    assert max(pg.eval_on_selector(p, "e => e.scrollHeight - e.clientHeight") for p in panes) > 0   # they scrolled
    pg.wait_for_function("sel => sel.every(s => { const e = document.querySelector(s); "
                         "return e.scrollTop === 0 && e.scrollLeft === 0; })", arg=panes, timeout=10_000)
    for i in range(3):
        clipped = pg.eval_on_selector_all(f"#cmp-trajectory-{i} .h", "hs => hs.filter(h => h.scrollWidth > h.clientWidth)"
                                          ".map(h => h.innerText)")
        assert clipped == [], clipped
    pg.screenshot(path=str(shots / "compare.png"), full_page=True)


def test_an_uploaded_trace_replays_with_play_and_pause(page, site, shots, tmp_path):
    engine, _ = site
    pg = page
    trace = tmp_path / "isd-run.jsonl"
    strat, settings = RunConfig("isd", max_new_tokens=60).build()
    result = run_to_end(engine, strat, settings, "bcdefg", encode_prompt(engine, "bcdefg"), trace_path=str(trace))
    n_steps = len({e["step"] for e in result.events})
    pg.click("#tab-traces-button")
    bad = tmp_path / "broken.jsonl"
    bad.write_text("not a trace\n")
    pg.set_input_files("#trace-upload input[type=file]", str(bad))
    pg.wait_for_function("document.querySelector('#trace-status').innerText.includes('broken.jsonl')")
    assert "line 1" in pg.inner_text("#trace-status")
    pg.set_input_files("#trace-upload input[type=file]", str(trace))
    pg.wait_for_function(f"document.querySelectorAll('#trace-trajectory .r').length === {n_steps}")
    pg.click("#trace-play")                                 # at the end: plays from the start
    pg.wait_for_function(f"document.querySelectorAll('#trace-trajectory .r').length < {n_steps}")
    a = rows(pg, "#trace-trajectory")
    pg.wait_for_timeout(700)
    b = rows(pg, "#trace-trajectory")
    assert a < b < n_steps
    pg.click("#trace-pause")
    pg.wait_for_timeout(400)
    paused = rows(pg, "#trace-trajectory")
    pg.wait_for_timeout(500)
    assert rows(pg, "#trace-trajectory") == paused
    pg.fill("#trace-step input[type=number]", "3")          # a number typed into "Steps shown", then Enter
    pg.press("#trace-step input[type=number]", "Enter")
    pg.wait_for_function("document.querySelectorAll('#trace-trajectory .r').length === 3")
    pg.screenshot(path=str(shots / "replay.png"), full_page=True)


def test_a_canvas_trace_shows_the_whole_canvas_and_the_inspector_explains_its_cells(page, shots):
    pg = page
    pg.click("#tab-traces-button")
    pg.set_input_files("#trace-upload input[type=file]", str(CANVAS))
    pg.wait_for_function("document.querySelectorAll('#trace-trajectory .r').length === 10")
    traj = pg.locator("#trace-trajectory")
    assert traj.locator(".c.s-noise").count() == 3 and traj.locator(".kvr").count() == 2
    # the canvas past the open block is one bar: a click on its left end is its first position
    traj.locator(".r").nth(0).locator(".cb.s-masked").click(position={"x": 3, "y": 5})
    status_has(pg, "#trace-inspector", "position 4:")
    traj.locator(".r").nth(8).locator(".c[data-pos='10']").click()
    status_has(pg, "#trace-inspector", "padding after the EOS at position 9: never output")
    pg.screenshot(path=str(shots / "canvas-replay.png"), full_page=True)


# -- issue 22: input, queue, stale panels, markdown ---------------------------------------------------
def send_with_enter(pg, text: str) -> None:
    pg.fill("#chat-message textarea", text)
    pg.press("#chat-message textarea", "Enter")


def status_has(pg, elem: str, text: str, timeout: float = 30_000) -> None:
    pg.wait_for_function(f"document.querySelector('{elem}').innerText.includes({text!r})", timeout=timeout)


def test_enter_sends_shift_enter_adds_a_line_and_markdown_is_rendered_but_markup_is_text(page, shots):
    pg = page
    pg.fill("#chat-max_new_tokens input", "6")
    box = pg.locator("#chat-message textarea")
    box.fill("**bold** and")
    box.press("Shift+Enter")
    box.type(XSS)
    assert rows(pg, "#chat-trajectory") == 0 and "\n" in box.input_value()   # a new line, nothing sent
    box.press("Enter")
    status_has(pg, "#chat-status", "stop max_new_tokens")
    user = pg.locator("#chat-log [data-testid=user]").first
    assert user.locator("strong").inner_text() == "bold"              # markdown rendered ...
    assert XSS in user.inner_text() and pg.locator("#chat-log img[src='x']").count() == 0   # ... markup as text
    assert box.input_value() == ""


def test_max_tokens_zero_or_empty_is_refused_and_the_message_kept(page):
    pg = page
    for value, message in (("0", "max new tokens must be >= 1"), ("", "max new tokens: enter a number")):
        pg.fill("#chat-max_new_tokens input", value)
        send_with_enter(pg, "bcd")
        status_has(pg, "#chat-form-message", message)
        status_has(pg, "#chat-status", f"not sent: {message}")    # next to Send, where the eye is
        send, said = pg.locator("#chat-send").bounding_box(), pg.locator("#chat-status").bounding_box()
        form = pg.locator("#chat-form-message").bounding_box()
        assert send["y"] + send["height"] <= said["y"] < min(form["y"], send["y"] + 120)   # under Send, above the form
        assert pg.locator("#chat-message textarea").input_value() == "bcd" and rows(pg, "#chat-trajectory") == 0
    pick(pg, "#chat-pick", "r-isd")                              # picking a strategy keeps the settings
    pg.wait_for_selector("#chat-r_isd_stride")
    pg.fill("#chat-max_new_tokens input", "16")
    pick(pg, "#chat-pick", "isd")
    pg.wait_for_selector("#chat-isd_stride")
    assert pg.locator("#chat-max_new_tokens input").input_value() == "16"


def test_a_queued_second_user_sees_its_place_and_a_second_send_is_answered(browser, site, shots):
    _, url = site
    pages = []
    for _ in range(2):
        pg = browser.new_context(viewport={"width": 1100, "height": 900}).new_page()
        pg.goto(url)
        pg.wait_for_selector("#chat-message textarea")
        pg.fill("#chat-max_new_tokens input", "60")
        pages.append(pg)
    first, second = pages
    first.fill("#chat-pace input[type=number]", "80")
    send_with_enter(first, "bcd")
    first.wait_for_selector("#chat-trajectory .r")
    send_with_enter(second, "efg")
    status_has(second, "#chat-status", "queue")
    place = second.inner_text("#chat-status")
    send_with_enter(first, "more")                           # during its own run: told why nothing starts
    status_has(first, "#chat-status", "a turn is being decoded")
    assert first.locator("#chat-message textarea").input_value() == "more"
    both = [shots / f"user-{i}.png" for i in (1, 2)]
    for pg, path in zip(pages, both):
        pg.screenshot(path=str(path), full_page=True)
    _side_by_side(both, shots / "two-users.png")
    first.click("#chat-stop")
    status_has(second, "#chat-status", "stop max_new_tokens", timeout=60_000)
    assert "queue" in place, place
    for pg in pages:
        pg.context.close()


def prefill(pg) -> str:
    """What the last turn's summary says it prefilled: more tokens (or some reused) when history came along."""
    return re.search(r"prefill [^s]*s", pg.inner_text("#chat-status")).group(0)


def _side_by_side(parts, out) -> None:
    from PIL import Image
    images = [Image.open(p) for p in parts]
    canvas = Image.new("RGB", (sum(i.width for i in images) + 10 * (len(images) - 1), max(i.height for i in images)),
                       "white")
    x = 0
    for im in images:
        canvas.paste(im, (x, 0))
        x += im.width + 10
    canvas.save(out)


def test_a_new_turn_clears_the_inspector_and_download_new_conversation_and_clear_reset(page, shots):
    pg = page
    pg.fill("#chat-max_new_tokens input", "8")
    send_with_enter(pg, "bcd")
    status_has(pg, "#chat-status", "stop max_new_tokens")
    pg.locator("#chat-trajectory .r").nth(2).locator(".c").first.click()
    status_has(pg, "#chat-inspector", "position")
    pg.click("#chat-download")
    pg.wait_for_selector("#chat-file", state="visible")
    send_with_enter(pg, "efg")
    status_has(pg, "#chat-status", "stop max_new_tokens")
    assert "Click a cell" in pg.inner_text("#chat-inspector") and pg.locator("#chat-file").is_hidden()
    assert pg.locator("#chat-log [data-testid=user]").count() == 2
    # New conversation during a run: the run stops and its trajectory does not come back
    pg.fill("#chat-max_new_tokens input", "80")
    pg.fill("#chat-pace input[type=number]", "60")
    send_with_enter(pg, "hij")
    status_has(pg, "#chat-log", "hij")   # its turn on the page: the rows below are its own, not the last turn's
    pg.wait_for_function("document.querySelectorAll('#chat-trajectory .r').length > 3")
    pg.click("#chat-reset")
    status_has(pg, "#chat-status", "new conversation")
    # the reset's page at once, and the cancelled turn's handler ends on the same page (a frame it had already
    # given gradio may show in between: on a loaded machine for over a second)
    pg.wait_for_function("document.querySelectorAll('#chat-trajectory .r').length === 0 && "
                         "document.querySelectorAll('#chat-log [data-testid=user]').length === 0 && "
                         "document.querySelector('#chat-status').innerText.includes('new conversation')")
    # the chatbot's own Clear: the next turn sees no history (its summary counts only this turn's prompt)
    pg.fill("#chat-pace input[type=number]", "0")
    pg.fill("#chat-max_new_tokens input", "4")
    send_with_enter(pg, "bcd")   # queued behind the cancelled turn's handler: after its last frame
    status_has(pg, "#chat-status", "stop max_new_tokens")
    assert pg.locator("#chat-log [data-testid=user]").count() == 1 and "hij" not in pg.inner_text("#chat-log")
    alone = prefill(pg)
    send_with_enter(pg, "bcd")
    status_has(pg, "#chat-log", "bcd")
    pg.wait_for_function("document.querySelectorAll('#chat-log [data-testid=user]').length === 2")
    status_has(pg, "#chat-status", "stop max_new_tokens")
    pg.locator("#chat-log button[aria-label='Clear']").click()
    status_has(pg, "#chat-status", "new conversation")
    send_with_enter(pg, "bcd")
    status_has(pg, "#chat-status", "stop max_new_tokens")
    assert pg.locator("#chat-log [data-testid=user]").count() == 1 and prefill(pg) == alone
    pg.screenshot(path=str(shots / "chat-after-clear.png"), full_page=True)


def test_the_html_report_shows_a_long_trajectory_whole(browser, tmp_path):
    """A trajectory of 120 steps is drawn in the page, not in a box cut at ~48 rows (it had max-height: 80vh):
    only a horizontal scroll for a wide one."""
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    from studio.events import read_trace
    from studio.run.session import Settings
    from studio.traces.export import html_report
    from tests.support.tiny import tiny_engine
    trace = tmp_path / "long.jsonl"
    run_to_end(tiny_engine("llama", vocab=24, seed=3), make_strategy("ar"),
               Settings(max_new_tokens=120, sampling=SamplingParams(0.0)), "", [1, 2, 3], trace_path=str(trace))
    report = html_report(read_trace(trace), tmp_path / "long.html")
    context = browser.new_context(viewport={"width": 1500, "height": 900})
    pg = context.new_page()
    pg.goto(report.as_uri())
    box = pg.locator(".fig.wide").first
    scroll, client, svg = box.evaluate("e => [e.scrollHeight, e.clientHeight, e.querySelector('svg').getBBox().height]")
    context.close()
    assert svg > 900 and scroll <= client + 1, (scroll, client, svg)   # taller than the window, none of it hidden


def test_the_analysis_tab_draws_every_figure_for_uploaded_traces(page, site, shots, tmp_path):
    engine, _ = site
    pg = page
    traces = []
    for name in ("jacobi", "ar"):
        path = tmp_path / f"{name}-run.jsonl"
        strat, settings = RunConfig(name, max_new_tokens=40).build()
        run_to_end(engine, strat, settings, "bcdefg", encode_prompt(engine, "bcdefg"), trace_path=str(path))
        traces.append(str(path))
    pg.click("#tab-analysis-button")
    pg.set_input_files("#analysis-upload input[type=file]", traces)
    pg.wait_for_function("document.querySelectorAll('#analysis-report svg').length === 8")
    report = pg.inner_text("#analysis-report")
    for title in ("Acceptance by draft slot", "Acceptance by the target's entropy", "Where the decode time went",
                  "jacobi-run", "ar-run"):
        assert title in report, title
    assert "analysed 2 trace(s)" in pg.inner_text("#analysis-status")
    pg.screenshot(path=str(shots / "analysis.png"), full_page=True)


def test_the_analysis_tab_draws_a_swept_bench_report_s_curves(page, tmp_path):
    from studio.run.sweep import add_aup
    report = {"task": {"name": "quick", "answers": []}, "strategies": [
        {"label": "ar", "tpf": {"median": 1.0}, "accuracy": 0.5},
        {"label": "canvas · threshold=0.5", "tpf": {"median": 2.0}, "accuracy": 0.3},
        {"label": "canvas · threshold=0.9", "tpf": {"median": 1.2}, "accuracy": 0.45}]}
    add_aup(report, {"ar": "ar", "canvas · threshold=0.5": "canvas", "canvas · threshold=0.9": "canvas"})
    good, bad = tmp_path / "sweep.json", tmp_path / "other.json"
    good.write_text(json.dumps(report))
    bad.write_text(json.dumps({"strategies": []}))
    pg = page
    pg.click("#tab-analysis-button")
    pg.set_input_files("#analysis-bench input[type=file]", str(good))
    pg.wait_for_function("document.querySelector('#analysis-curves .js-plotly-plot') !== null")
    legend = pg.inner_text("#analysis-curves")
    assert "canvas (AUP" in legend and "ar (AUP" in legend
    pg.reload()                              # (a loaded file replaces the upload box: a fresh page for the next)
    pg.click("#tab-analysis-button")
    pg.set_input_files("#analysis-bench input[type=file]", str(bad))
    pg.wait_for_function("document.querySelector('#analysis-bench-status').innerText.includes('no accuracy curves')")

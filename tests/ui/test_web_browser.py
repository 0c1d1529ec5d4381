"""`dlm-studio web` in a real browser: Debian's chromium, headless, driven by Playwright (nothing downloaded).

Types a prompt, watches the trajectory grow while the run decodes (slow motion, so growth is observable
on any machine), stops it, runs a compare, replays an uploaded trace. Screenshots go to a temp folder and
the last ones are copied to /tmp/web-shots/ to be looked at.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("no /usr/bin/chromium (apt-get install chromium) for the browser test", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

from studio.run.config import RunConfig  # noqa: E402
from studio.run.session import Session, encode_prompt  # noqa: E402
from tests.ui.test_web import XSS, served, web_engine  # noqa: E402
from tests.ui.test_web import pytestmark as _same_warning_filters  # noqa: E402

pytestmark = _same_warning_filters

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
SHOTS = Path("/tmp/web-shots")


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
    pg.click("#cmp-run")
    pg.wait_for_selector("#cmp-table table", timeout=60_000)
    counts = [rows(pg, f"#cmp-trajectory-{i}") for i in range(3)]
    assert all(n > 2 for n in counts) and pg.locator("#cmp-trajectory-3").is_hidden()
    assert pg.locator("#cmp-table td", has_text="jacobi").count() == 1
    pg.screenshot(path=str(shots / "compare.png"), full_page=True)


def test_an_uploaded_trace_replays_with_play_and_pause(page, site, shots, tmp_path):
    engine, _ = site
    pg = page
    trace = tmp_path / "isd-run.jsonl"
    strat, settings = RunConfig("isd", max_new_tokens=60).build()
    result = Session(engine, strat, settings).run("bcdefg", encode_prompt(engine, "bcdefg"), trace_path=str(trace))
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
    pg.screenshot(path=str(shots / "replay.png"), full_page=True)

"""`dlm-studio web` through its HTTP API: the app is served on a free local port with a tiny model and
driven with gradio_client, as a browser would drive it (no mocks: real runs, real queue, real uploads).

The tiny model's tokenizer spells tokens with characters that matter to HTML (< > & " ' =), so every
view is also checked for escaping. The browser test (test_web_browser.py) reuses `web_engine`/`served`.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
import socket
import threading
from contextlib import contextmanager

import pytest

pytest.importorskip("gradio")
from gradio_client import Client, handle_file  # noqa: E402

from studio.run.config import RunConfig  # noqa: E402
from studio.run.compare import compare_configs, make_runs  # noqa: E402
from studio.traces import projection  # noqa: E402
from studio.engine.strategies import STRATEGIES, make_strategy  # noqa: E402
from studio.engine.strategies.params import N, TAU  # noqa: E402
from studio.errors import BadInput  # noqa: E402
from studio.events import read_trace  # noqa: E402
from studio.run.session import drive, encode_prompt, run_to_end  # noqa: E402
from studio.web import render  # noqa: E402
from studio.web.app import build_app, serve  # noqa: E402
from studio.web.files import read_upload  # noqa: E402
from studio.web.form import form_values, read_choice  # noqa: E402
from studio.web.paramspec import param_fields  # noqa: E402
from tests.support.tiny import TinyTokenizer, tiny_engine  # noqa: E402

# gradio's queue statistics use pandas options that pandas 3 deprecates: noise, not ours
pytestmark = [pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting':DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:The copy keyword is deprecated")]

XSS = "<img src=x onerror=alert(1)>"
ALPHABET = "abcdefghijklmnopqrstuvwxyz<>=()1 &\"'/"   # the last vocab id is the MASK


class HtmlTokenizer(TinyTokenizer):
    """Token i <-> ALPHABET[i]: prompts like XSS are encodable and generated text is full of < > & " '."""

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) for c in text if c in ALPHABET]

    def decode(self, ids) -> str:
        return "".join(ALPHABET[i] if i < len(ALPHABET) else "?" for i in ids)

    def token_text(self, i: int) -> str:
        return self.decode([i])


def web_engine():
    engine = tiny_engine("llama", vocab=len(ALPHABET) + 1, seed=3)
    engine.tokenizer = HtmlTokenizer(engine.config.vocab_size)
    return engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(engine):
    """The app on a free local port: yields (app, url)."""
    app = build_app(engine, costs=projection.load("h200"))    # what `dlm-studio web` projects onto by default
    _, url, share_url = serve(app, port=free_port(), block=False)
    assert share_url is None and url.startswith("http://127.0.0.1:")
    try:
        yield app, url
    finally:
        app.close()


class ForwardProbe:
    """Counts model forwards running at the same time (the real model still computes every one)."""

    def __init__(self, model):
        self.inner, self.active, self.most = model.forward, 0, 0
        self.lock = threading.Lock()
        model.forward = self

    def __call__(self, *args, **kw):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            return self.inner(*args, **kw)
        finally:
            with self.lock:
                self.active -= 1


@pytest.fixture(scope="module")
def engine():
    return web_engine()


@pytest.fixture(scope="module")
def server(engine):
    probe = ForwardProbe(engine.model)
    with served(engine) as (app, url):
        yield app, url, probe


def client(url) -> Client:
    return Client(url, verbose=False, download_files=False)


def named(app, api_name: str, values) -> dict:
    """An endpoint's outputs by elem_id (gradio_client returns them in order, without state and layouts)."""
    dep = next(d for d in app.fns.values() if d.api_name == api_name)
    comps = [c for c in dep.outputs if not c.skip_api]
    return {c.elem_id: v for c, v in zip(comps, values)}


def file_path(value) -> str:
    """The server-side path of a file output (a path, file data, or an update carrying file data)."""
    if isinstance(value, dict):
        return file_path(value["value"] if "value" in value else value["path"])
    return value


def chat_text(messages) -> list[str]:
    return [m["content"][0]["text"] if isinstance(m["content"], list) else m["content"] for m in messages]


def solo(engine, prompt: str, strategy: str, n: int, **params):
    """The same request run directly, without the web app."""
    strat, settings = RunConfig(strategy, params=params, max_new_tokens=n).build()
    return run_to_end(engine, strat, settings, prompt, encode_prompt(engine, prompt))


# -- forms ------------------------------------------------------------------------------------------
def test_forms_come_from_each_strategys_params_and_read_back_to_the_same_run():
    for name, cls in STRATEGIES.items():
        fields = param_fields(name)
        defaults = vars(cls.Params())
        assert {f.name: f.default for f in fields} == defaults
        choice = RunConfig(name)
        values = dict(form_values(choice), strategy=name)
        strategy, settings = read_choice(values).build()
        assert strategy.header_params() == make_strategy(name).header_params()
    # a preset fills its strategy's fields with its values
    shown = form_values(RunConfig(None, "isd-n3"))
    assert shown["isd_stride"] == 3 and shown["temperature"] == 1.0
    with pytest.raises(BadInput, match=r"^isd stride \(N\) must be >= 2"):
        read_choice(dict(shown, strategy="isd-n3", isd_stride=1))
    with pytest.raises(BadInput, match="route must be a table"):
        read_choice(dict(form_values(RunConfig("s2d2")), strategy="s2d2", s2d2_route="7"))


def test_every_parameter_has_help_and_its_choices_are_what_the_strategy_accepts():
    for name in STRATEGIES:
        fields = param_fields(name)
        for f in fields:
            assert f.help, (name, f.name)
            if f.kind is str and not f.choices:   # free text (dflash's drafter directory): a textbox, checked later
                make_strategy(name, {f.name: "some/directory"})
            elif f.kind is str:   # a text parameter that takes one of a few values: the form offers them
                assert f.default in f.choices, (name, f.name)
                for value in f.choices:
                    make_strategy(name, {f.name: value})
                with pytest.raises(BadInput):
                    make_strategy(name, {f.name: "not-" + f.choices[0]})
            else:
                assert f.choices is None, (name, f.name)
        assert [f.role for f in fields if f.role] in ([], [N], [N, TAU]), name
    labels = {f.name: f.label for f in param_fields("s2d2")}
    assert (labels["block_size"], labels["threshold"], labels["steps"]) == ("block_size (N)", "threshold (τ)", "steps")


def test_a_new_parameter_appears_in_the_form_with_its_metadata(monkeypatch):
    from dataclasses import dataclass
    import gradio as gr
    from studio.engine.strategies.isd import ISD
    from studio.engine.strategies.params import param
    from studio.web.form import RunForm

    class SaltedISD(ISD):
        name = "salted-isd"

        @dataclass
        class Params(ISD.Params):
            salt: str = param("fine", "how coarse the salt is", choices=("fine", "coarse"))

    monkeypatch.setitem(STRATEGIES, SaltedISD.name, SaltedISD)
    salt = next(f for f in param_fields("salted-isd") if f.name == "salt")
    assert (salt.key, salt.kind, salt.default, salt.help, salt.choices, salt.role) == \
        ("salted_isd_salt", str, "fine", "how coarse the salt is", ("fine", "coarse"), None)
    shown = form_values(RunConfig("salted-isd"))
    assert shown["salted_isd_salt"] == "fine" and shown["salted_isd_stride"] == 4
    chosen = read_choice(dict(shown, strategy="salted-isd", salted_isd_salt="coarse"))
    assert chosen.build()[0].params.salt == "coarse"
    with gr.Blocks():
        form = RunForm(RunConfig("salted-isd"), "test")
    field = form.fields["salted_isd_salt"]
    assert isinstance(field, gr.Dropdown) and [value for _, value in field.choices] == ["fine", "coarse"]
    assert (field.label, field.info) == ("salt", "how coarse the salt is")
    assert form.fields["salted_isd_stride"].label == "stride (N)"


def test_a_field_s_help_is_a_line_or_two_and_the_whole_text_is_one_click_away():
    """The form showed every help in full under its field: walls of text (the drafting and lookup helps run to 200-336
    characters). A field shows `brief`; the group's "What these parameters do" holds each help whole, escaped."""
    import gradio as gr
    from studio.web.form import RunForm, help_table
    from studio.web.paramspec import BRIEF_CHARS
    long = [f for name in STRATEGIES for f in param_fields(name) if len(f.help) > BRIEF_CHARS]
    assert long   # the case exists
    with gr.Blocks():
        form = RunForm(RunConfig("isd"), "test")
    for name in STRATEGIES:
        for f in param_fields(name):
            info = form.fields[f.key].info
            assert info and len(info) <= BRIEF_CHARS + 2 and f.help.startswith(info.removesuffix(" …")), f.key
    drafting = next(f for f in param_fields("isd") if f.name == "drafting")
    assert drafting in long and drafting.help in help_table(param_fields("isd")).replace("&#x27;", "'")
    assert "<b>" not in help_table([dataclasses.replace(drafting, help="<b>bold</b>")])


# -- chat -------------------------------------------------------------------------------------------
def test_chat_streams_a_growing_trajectory_and_matches_the_run_alone(server, engine):
    app, url, _ = server
    c = client(url)
    job = c.submit(text="bcdefg", strategy="isd", max_new_tokens=30, pace_ms=15, api_name="/chat")
    frames = [named(app, "chat", out) for out in job]
    grids = [f["chat-trajectory"] for f in frames if isinstance(f.get("chat-trajectory"), dict)]
    sizes = [len(g["rows"]) for g in grids]
    assert len(sizes) >= 4 and sizes == sorted(sizes) and sizes[0] < sizes[-1]   # it grew while decoding
    assert len({g["run"] for g in grids}) == 1                                    # one trajectory, extended
    for g in grids:                        # every frame extends the last one: rows are never redrawn
        assert g["rows"] == grids[-1]["rows"][:len(g["rows"])]
    alone = solo(engine, "bcdefg", "isd", 30)
    final = named(app, "chat", job.outputs()[-1])
    assert len(final["chat-trajectory"]["rows"]) == len({e["step"] for e in alone.events})
    assert chat_text(final["chat-log"]) == [render.markdown_text("bcdefg"), render.markdown_text(alone.footer["text"])]
    assert "stop max_new_tokens" in final["chat-status"] and "Traceback" not in str(final)
    # the turn downloaded, then uploaded again, replays exactly as it was drawn live (proposals included)
    out = named(app, "download_chat", c.predict(label="JSONL trace", api_name="/download_chat"))
    saved = read_trace(file_path(out["chat-file"]))
    assert saved.header["prompt"]["text"] == "bcdefg" and saved.footer["text"] == alone.footer["text"]
    replay = named(app, "load_traces", c.predict(paths=[handle_file(file_path(out["chat-file"]))],
                                                 api_name="/load_traces"))
    assert replay["trace-trajectory"]["rows"] == final["chat-trajectory"]["rows"]
    # later turns continue the conversation; an ar turn after an ar turn reuses its KV (the summary says how much)
    c.predict(text="hij", strategy="ar", max_new_tokens=8, api_name="/chat")
    third = named(app, "chat", c.predict(text="klm", strategy="ar", max_new_tokens=8, api_name="/chat"))
    assert len(third["chat-log"]) == 6 and re.search(r"\+ \d+ reused", third["chat-status"])
    inspected = c.predict(pos=2, api_name="/inspect_chat")
    assert "position 2: final token" in inspected


@pytest.mark.parametrize("endpoint, request_, panes", [
    ("chat", dict(text="bcd", strategy="isd", max_new_tokens=6), ("chat-status", "chat-trajectory")),
    ("compare", dict(text="bcd", run_names=["isd"], max_new_tokens=6), ("cmp-status", "cmp-trajectory-1"))])
def test_a_first_cost_aware_run_says_it_measures_the_forward_costs_before_it_starts(server, monkeypatch, endpoint,
                                                                                   request_, panes):
    """The first cost-aware run on a model without a stored cost table waits seconds for it: the status line says
    so before the first frame of the run, the table is measured once, and the next run starts at once."""
    from studio.engine.cost_table import FLAT_COSTS
    app, url, _ = server
    status, trajectory = panes
    measured = []
    monkeypatch.setattr("studio.run.session.stored_table", lambda engine: FLAT_COSTS if measured else None)

    def planning_costs(engine):   # measures only where no table is stored, as the real one does
        if not measured:
            measured.append(engine)
        return FLAT_COSTS
    monkeypatch.setattr("studio.run.session.planning_costs", planning_costs)
    c = client(url)
    for turn in range(2):
        frames = [named(app, endpoint, out) for out in c.submit(**request_, api_name=f"/{endpoint}")]
        said = [i for i, f in enumerate(frames) if "forward costs for tiny-llama" in str(f.get(status))]
        drawn = [i for i, f in enumerate(frames) if isinstance(f.get(trajectory), dict) and f[trajectory].get("rows")]
        assert len(measured) == 1 and drawn and "Traceback" not in str(frames)
        assert (len(said) == 1 and said[0] < drawn[0]) if turn == 0 else not said
        if endpoint == "chat" and turn == 0:   # while it measures, the message already shows as sent
            waiting = frames[said[0]]
            assert request_["text"] in str(waiting["chat-log"]) and waiting["chat-message"] == ""


def test_stop_ends_the_turn_cleanly_and_keeps_the_partial_answer(server):
    app, url, _ = server
    c = client(url)
    job = c.submit(text="bcd", strategy="ar", max_new_tokens=80, pace_ms=40, api_name="/chat")
    for i, _ in enumerate(job):
        if i == 3:
            c.predict(api_name="/stop_chat")
    final = named(app, "chat", job.outputs()[-1])
    assert "stop cancelled" in final["chat-status"]
    n = len(final["chat-trajectory"]["rows"])
    assert 2 < n < 80 and len(final["chat-log"]) == 2          # the partial answer joined the conversation
    after = named(app, "chat", c.predict(text="e", strategy="ar", max_new_tokens=4, api_name="/chat"))
    assert "stop max_new_tokens" in after["chat-status"]      # the engine is free and the chat goes on


def test_an_invalid_or_empty_field_is_a_message_in_the_forms_words_and_nothing_runs(server):
    app, url, _ = server
    c = client(url)
    for bad, message in (({"isd_stride": 1}, "isd stride (N) must be >= 2"),
                         ({"strategy": "r-isd", "r_isd_stride": 1}, "r-isd stride (N) must be >= 2"),
                         ({"temperature": -1}, "temperature must be"),
                         ({"max_new_tokens": 0}, "max new tokens must be >= 1, got 0"),
                         ({"max_new_tokens": None}, "max new tokens: enter a number"),
                         ({"isd_proposal": "guess"}, "proposal must be 'sample' or 'argmax'")):
        out = named(app, "chat", c.predict(text="bcd", api_name="/chat", **{"strategy": "isd", **bad}))
        assert render.esc(message) in out["chat-form-message"] and 'class="note error"' in out["chat-form-message"]
        assert "not sent: " in out["chat-status"] and render.esc(message) in out["chat-status"]   # beside Send too
        assert "--" not in out["chat-form-message"]                            # no CLI flag names in the page
        assert not isinstance(out["chat-log"], list) or not out["chat-log"]   # no turn was started
    out = named(app, "chat", c.predict(text="bcd", strategy="isd", max_new_tokens=500, api_name="/chat"))
    assert render.esc("max new tokens (500) exceeds the model's context") in out["chat-status"]
    for blank in ("", "  \n "):
        out = named(app, "chat", c.predict(text=blank, strategy="isd", api_name="/chat"))
        assert "type a message first" in out["chat-status"] and not isinstance(out["chat-log"], list)


def test_picking_a_strategy_keeps_the_settings_and_a_preset_sets_only_its_own():
    import gradio as gr
    from studio.web.form import RunForm
    with gr.Blocks():
        form = RunForm(RunConfig("ar", max_new_tokens=16), "test")
    picked = form._on_pick("isd")
    assert not any(picked.get(c) is not None for c in form.settings.values())   # max tokens 16 stays 16
    assert picked[form.fields["isd_stride"]] == 4 and picked[form.groups["isd"]].visible
    preset = form._on_pick("isd-n3")    # sets temperature 1.0 and stride 3, not max_new_tokens
    assert preset[form.settings["temperature"]] == 1.0 and preset[form.fields["isd_stride"]] == 3
    assert form.settings["max_new_tokens"] not in preset


def test_two_clients_decode_one_at_a_time_and_get_their_own_results(server, engine):
    app, url, probe = server
    requests = {"bcdef": ("isd", {"isd_stride": 3}), "ghijk": ("jacobi", {"jacobi_block_size": 4})}
    finals: dict[str, dict] = {}

    def talk(prompt):
        strategy, params = requests[prompt]
        out = client(url).predict(text=prompt, strategy=strategy, max_new_tokens=24, pace_ms=5, api_name="/chat",
                                  **params)
        finals[prompt] = named(app, "chat", out)

    threads = [threading.Thread(target=talk, args=(p,)) for p in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert probe.most == 1   # the shared model never ran two forwards at once
    for prompt, (strategy, params) in requests.items():
        own = {k.split("_", 1)[1]: v for k, v in params.items()}
        alone = solo(engine, prompt, strategy, 24, **own)
        assert chat_text(finals[prompt]["chat-log"]) == [prompt, render.markdown_text(alone.footer["text"])]


# -- compare ----------------------------------------------------------------------------------------
def test_compare_advances_runs_in_lock_step_then_reports(server, engine, tmp_path):
    app, url, _ = server
    job = client(url).submit(text="bcdef", run_names=["isd", "jacobi"], max_new_tokens=24, temperature=0, seed=0,
                             pace_ms=10, api_name="/compare")
    frames = [named(app, "compare", out) for out in job]
    final = named(app, "compare", job.outputs()[-1])
    ends = [len(final[f"cmp-trajectory-{i}"]["rows"]) for i in range(3)]
    configs = compare_configs("isd,jacobi", RunConfig(max_new_tokens=24, temperature=0.0))
    runs = list(make_runs(engine, "bcdef", encode_prompt(engine, "bcdef"), configs).values())
    drive(runs)
    assert ends == [len({e["step"] for e in r.result.events}) for r in runs]
    seen = 0
    for f in frames:
        grids = [f.get(f"cmp-trajectory-{i}") for i in range(3)]
        sizes = [len(g["rows"]) for g in grids if isinstance(g, dict)]
        live = [n for n, end in zip(sizes, ends) if n < end]
        if len(sizes) == 3 and len(live) > 1:
            seen += 1
            assert max(live) - min(live) <= 1   # one forward per step here: lock-step by forward count
    assert seen >= 2
    table = final["cmp-table"]
    for label, r in zip(["ar", "isd", "jacobi"], runs):
        assert f"<td>{label}</td>" in table and render.esc(r.result.footer["text"]) in table
    assert "<td>jacobi</td><td>24</td>" in table and table.count("<td>yes (ar)</td>") >= 2   # greedy jacobi == ar
    h200 = projection.load("h200")
    projected = projection.project(runs[2].result.events, h200).vs(projection.project(runs[0].result.events, h200))
    assert "<th>× ar on h200 (projected)</th>" in table and f"<td>{projected:.2f}×</td>" in table
    assert "priced by the h200 table (one NVIDIA H200, 2026-11-26" in table
    slots = len(runs[2].result.footer["accept_by_pos"])   # jacobi's acceptance chart names each of its slots
    assert slots > 1 and all(f'text-anchor="middle">{i}</text>' in final["cmp-metrics-2"] for i in range(1, slots + 1))
    assert final["cmp-trajectory-0"].get("rewind") and final["cmp-trajectory-2"].get("rewind")   # panes start level
    report = file_path(final["cmp-report"])
    text = open(report, encoding="utf-8").read()
    assert text.startswith("<!DOCTYPE html>") and "jacobi" in text


def test_compare_refuses_too_many_runs_with_a_message(server):
    app, url, _ = server
    out = named(app, "compare", client(url).predict(text="bcd", run_names=["isd", "r-isd", "jacobi", "jacobi-mr"],
                                                     api_name="/compare"))
    assert "at most 4 runs" in out["cmp-status"] and "ar, isd, r-isd, jacobi, jacobi-mr" in out["cmp-status"]
    out = named(app, "compare", client(url).predict(text="bcd", run_names=["ar"], api_name="/compare"))
    assert "nothing to compare" in out["cmp-status"]


def test_a_refused_compare_clears_the_last_ones_panes(server):
    app, url, _ = server
    c = client(url)
    done = named(app, "compare", c.predict(text="bcd", run_names=["isd"], max_new_tokens=8, api_name="/compare"))
    assert done["cmp-trajectory-1"]["rows"] and "<table" in done["cmp-table"]
    for bad, message in (({"text": " "}, "type a prompt first"), ({"max_new_tokens": None}, "max new tokens: enter"),
                         ({"max_new_tokens": 0}, "max new tokens must be >= 1")):
        out = named(app, "compare", c.predict(api_name="/compare", **{"text": "bcd", "run_names": ["isd"], **bad}))
        assert render.esc(message) in out["cmp-status"] and "--" not in out["cmp-status"]
        assert out["cmp-table"] == "" and all(out[f"cmp-trajectory-{i}"]["rows"] == [] for i in range(4))
        assert out["cmp-report"]["visible"] is False


# -- traces -----------------------------------------------------------------------------------------
def test_an_uploaded_trace_replays_and_downloads_in_every_format(server, engine, tmp_path):
    app, url, _ = server
    src = tmp_path / "run.jsonl"
    strat, settings = RunConfig("isd", max_new_tokens=20).build()
    result = run_to_end(engine, strat, settings, XSS, encode_prompt(engine, XSS), trace_path=str(src))
    n_steps = len({e["step"] for e in result.events})
    c = client(url)
    loaded = named(app, "load_traces", c.predict(paths=[handle_file(str(src))], api_name="/load_traces"))
    assert "loaded 1 trace(s)" in loaded["trace-status"]
    assert len(loaded["trace-trajectory"]["rows"]) == n_steps
    assert render.esc(XSS) in loaded["trace-info"] and XSS not in loaded["trace-info"]
    seek = named(app, "replay_seek", c.predict(shown=3, api_name="/replay_seek"))
    assert len(seek["trace-trajectory"]["rows"]) == 3
    assert seek["trace-trajectory"]["rows"] == loaded["trace-trajectory"]["rows"][:3]
    played = [named(app, "play", out) for out in c.submit(shown=3, steps_per_s=60, api_name="/play")]
    shown = [f["trace-step"] for f in played if isinstance(f.get("trace-step"), (int, float))]
    assert shown == sorted(shown) and shown[0] > 3 and shown[-1] == n_steps
    for label, check in (("JSONL trace", lambda p: read_trace(p).events == result.events),
                         ("Parquet", lambda p: open(p, "rb").read(4) == b"PAR1"),
                         ("Perfetto", lambda p: "traceEvents" in json.load(open(p))),
                         ("HTML report", lambda p: "<img src=x" not in open(p, encoding="utf-8").read())):
        out = named(app, "download_trace", c.predict(label=label, api_name="/download_trace"))
        assert check(file_path(out["trace-file"])), label
    again = named(app, "load_traces", c.predict(paths=[handle_file(str(src))], api_name="/load_traces"))
    assert again["trace-file"]["visible"] is False   # the last download was of the trace loaded before


def test_a_canvas_trace_of_a_newer_minor_shows_its_canvas_and_says_what_it_skipped(server, tmp_path):
    from tests.support.fixtures.traces import newer_minor
    app, url, _ = server
    src = newer_minor(Path(__file__).parents[1] / "support" / "fixtures" / "canvas_synthetic.jsonl",
                      tmp_path / "canvas.jsonl")
    loaded = named(app, "load_traces", client(url).predict(paths=[handle_file(str(src))], api_name="/load_traces"))
    rows = loaded["trace-trajectory"]["rows"]
    assert len(rows) == 10 and "s-noise" in rows[4] and "s-edited" in rows[3] and "s-padding" in rows[9]
    assert "refresh [4,16)" in rows[4] and "12 positions, filled in blocks of 4" in loaded["trace-info"]
    assert "1 event(s) of kinds dlm-studio.trace/1.4 added skipped" in loaded["trace-info"]
    assert "<b>10</b> tokens" in loaded["trace-metrics"]   # the padding after the EOS is no output


def test_a_bad_trace_is_a_one_line_message(server, tmp_path):
    app, url, _ = server
    bad = tmp_path / "bad.jsonl"
    good_header = json.dumps({"kind": "header", "schema": "dlm-studio.trace/1"})
    bad.write_text(good_header + "\n{not json\n")
    out = named(app, "load_traces", client(url).predict(paths=[handle_file(str(bad))], api_name="/load_traces"))
    status = out["trace-status"]
    assert 'class="note error"' in status and "bad.jsonl" in status and "/tmp" not in status
    assert "Traceback" not in status and "\n" not in status
    with pytest.raises(BadInput, match="bad.jsonl: .* over the .* upload limit"):
        read_upload(bad, limit=10)


def test_a_new_turn_clears_the_last_turns_inspector_download_and_error(server):
    app, url, _ = server
    c = client(url)
    c.predict(text="bcd", strategy="ar", max_new_tokens=4, api_name="/chat")
    assert "position 1: final token" in c.predict(pos=1, api_name="/inspect_chat")
    c.predict(label="JSONL trace", api_name="/download_chat")
    first = named(app, "chat", next(iter(c.submit(text="efg", strategy="ar", max_new_tokens=4, api_name="/chat"))))
    assert "Click a cell" in first["chat-inspector"] and first["chat-position"] is None
    assert first["chat-file"]["visible"] is False and first["chat-status"] == "" and first["chat-form-message"] == ""


def test_a_new_conversation_forgets_the_history_even_mid_turn(server):
    app, url, _ = server
    c = client(url)
    c.predict(text="bcd", strategy="ar", max_new_tokens=4, api_name="/chat")
    job = c.submit(text="efg", strategy="ar", max_new_tokens=80, pace_ms=40, api_name="/chat")
    for i, _ in enumerate(job):
        if i == 3:
            reset = named(app, "reset_chat", c.predict(api_name="/reset_chat"))
    assert reset["chat-log"] == [] and reset["chat-trajectory"]["rows"] == []
    frames = [named(app, "chat", out) for out in job.outputs()]
    assert not any("stop" in str(f.get("chat-status")) for f in frames), "the cancelled turn's end was shown"
    assert frames[-1]["chat-trajectory"]["rows"] == [] and frames[-1]["chat-log"] == []   # the page shows the last
    fresh = named(app, "chat", c.predict(text="hij", strategy="ar", max_new_tokens=4, api_name="/chat"))
    assert len(fresh["chat-log"]) == 2   # the next turn sees no old history


def test_a_send_the_server_took_before_a_new_conversation_starts_no_turn_after_it(engine):
    """The browser's Send and New conversation in quick succession: the reset may run before the Send's handler
    starts its turn. That turn must not start on the history the reset forgot (it used to: it ran on, unseen, and
    its end put the old history back)."""
    from studio.run.chat import ChatSession
    from studio.web.chat_tab import ChatTab
    tab = ChatTab(ChatSession(engine, RunConfig("ar", max_new_tokens=4), chat=False))
    turn = tab.start_turn("bcd", step_mode=False, resets=tab.resets)
    turn.worker.join()
    assert turn.run.done and len(tab.session.conversation.messages) == 2 and turn.history[-1]["content"] == "bcd"
    sent_at = tab.resets   # a Send's handler begins
    tab.reset()            # New conversation, before that handler starts its turn
    assert tab.start_turn("efg", step_mode=False, resets=sent_at) is None
    assert tab.trajectory is None and tab.session.conversation.messages == []
    turn = tab.start_turn("hij", step_mode=True, resets=tab.resets)   # a Send after the reset
    assert turn.history == [{"role": "user", "content": "hij"}] and tab.trajectory is turn.trajectory
    tab.reset()            # mid-turn: the cancelled turn does not join the new history
    assert turn.run.done and tab.session.conversation.messages == [] and tab.trajectory is None


def test_chat_markdown_renders_but_markup_stays_text():
    assert render.markdown_text("**1. Earth** & <b>x</b>") == "**1. Earth** &amp; &lt;b&gt;x&lt;/b&gt;"
    # inside code the renderer escapes by itself: escaping here too would show "&lt;"
    assert render.markdown_text("use `a<b` or\n```\n<script>\n```") == "use `a<b` or\n```\n<script>\n```"
    assert render.markdown_text("![x](http://elsewhere/p.png)") == "!\\[x](http://elsewhere/p.png)"   # never loaded


# -- safety -----------------------------------------------------------------------------------------
def test_a_markup_prompt_is_text_in_every_view(server, engine, tmp_path):
    app, url, _ = server
    c = client(url)
    chat = named(app, "chat", c.predict(text=XSS, strategy="isd", max_new_tokens=12, api_name="/chat"))
    cmp = named(app, "compare", c.predict(text=XSS, run_names=["isd"], max_new_tokens=12, api_name="/compare"))
    report = file_path(cmp["cmp-report"])
    views = [json.dumps(chat), json.dumps({k: v for k, v in cmp.items() if k != "cmp-figure"}),
             open(report, encoding="utf-8").read()]
    assert chat_text(chat["chat-log"])[0] == render.markdown_text(XSS) == "&lt;img src=x onerror=alert(1)&gt;"
    for view in views:
        assert "<img" not in view
    rows = "".join(chat["chat-trajectory"]["rows"])
    # token texts (hover, emitted text) are full of < > & " ': in the HTML every < opens one of our tags and
    # every & starts an entity
    assert set(re.findall(r"<(/?[a-z]+)", rows)) <= {"div", "/div", "span", "/span", "i", "/i", "b", "/b"}
    assert not re.search(r"&(?!(lt|gt|amp|quot|#x27);)", rows)


def test_the_engine_queue_serves_one_decoding_request_at_a_time(server):
    app, _, _ = server
    for api_name in ("chat", "compare"):
        dep = next(d for d in app.fns.values() if d.api_name == api_name)
        assert dep.concurrency_id == "engine" and dep.concurrency_limit == 1


def test_names_shown_are_the_models_own_and_never_a_server_path():
    from studio.viz.figures import tpf_figure
    engine = dataclasses.replace(web_engine(), name="default")
    engine.config = dataclasses.replace(engine.config, name="SmolLM2-135M")
    assert dataclasses.replace(engine, adapter="/srv/x/isd-lora").title == "SmolLM2-135M (default) + isd-lora"
    assert dataclasses.replace(engine, adapter=None).title == "SmolLM2-135M (default)"
    header = {"strategy": "isd", "model": {"name": "SmolLM2-135M", "adapter": "/srv/x/isd-lora"}}
    title = tpf_figure(header, []).layout.title.text
    assert "isd-lora" in title and "/srv" not in title

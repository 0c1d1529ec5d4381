"""`dlm-studio serve` over real HTTP on a tiny model: the `openai` client for what works, raw HTTP for what must not."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from studio.events import read_trace
from studio.events.schema import footer_problem, header_problem, validate_event
from studio.run.config import RunConfig
from studio.run.session import encode_messages, run_to_end
from studio.serve.app import build_app
from studio.serve.app import serving_in_thread as serving
from studio.serve.protocol import Limits
from tests.support.tiny import tiny_engine

openai = pytest.importorskip("openai")

PROMPTS = ["abcab", "bcd", "aaab", "dcba", "abab", "cab", "bbbc", "acad"]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", vocab=20, seed=2, max_seq_len=512)


@pytest.fixture(scope="module")
def url(engine):
    with serving(build_app(engine, RunConfig("ar", max_new_tokens=12), limits=Limits(max_tokens=64))) as base:
        yield base


def client(url: str, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def solo(engine, strategy: str, text: str, n: int, chat: bool = False) -> str:
    """The text a batch-1 run of `strategy` gives (greedy), outside the server."""
    ids = encode_messages(engine, [{"role": "user", "content": text}]) if chat else engine.tokenizer.encode(text)
    s, settings = RunConfig(strategy, max_new_tokens=n).build()
    return run_to_end(engine, s, settings, text, ids).footer["text"]


def test_chat_and_completions_through_the_openai_client_are_the_solo_runs(engine, url):
    c = client(url)
    assert {"default", "default:ar", "default:r-isd", "default:jacobi-mr-cpu"} <= {m.id for m in c.models.list().data}
    chat = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "abcab"}], max_tokens=10)
    assert chat.choices[0].message.content == solo(engine, "ar", "abcab", 10, chat=True)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 10
    assert chat.usage.prompt_tokens == 5 and chat.usage.model_extra["decoding"]["strategy"] == "ar"

    by_name = c.completions.create(model="default:isd", prompt="bcd", max_tokens=9)
    by_body = c.completions.create(model="default", prompt="bcd", max_tokens=9, extra_body={"strategy": "isd"})
    assert by_name.choices[0].text == by_body.choices[0].text == solo(engine, "isd", "bcd", 9)
    decoding = by_body.usage.model_extra["decoding"]
    assert decoding["strategy"] == "isd" and decoding["forwards"] >= 1
    assert decoding["tpf"] == pytest.approx(9 / decoding["forwards"])

    stream = c.chat.completions.create(model="default:jacobi", messages=[{"role": "user", "content": "dcba"}],
                                       max_tokens=11, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == solo(engine, "jacobi", "dcba", 11, chat=True)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11

    pieces = [ch.choices[0].text for ch in c.completions.create(model="default", prompt="aaab", max_tokens=8,
                                                                extra_body={"strategy": "r-isd"}, stream=True)]
    assert "".join(pieces) == solo(engine, "r-isd", "aaab", 8)


def test_per_step_events_in_the_stream_follow_the_schema_and_are_the_trace(url, monkeypatch):
    """Of a batch that drafts: under flat costs drafts pay at any batch size (a GPU's case)."""
    from studio.engine.cost_table import FLAT_COSTS
    monkeypatch.setattr("studio.run.session.planning_costs", lambda engine: FLAT_COSTS)
    chunks = list(client(url).completions.create(model="default:isd", prompt="abab", max_tokens=10, stream=True,
                                                 stream_options={"include_events": True}))
    traces = [ch.model_extra["dlm_trace"] for ch in chunks]
    header, footer = traces[0]["header"], traces[-1]["footer"]
    events = [e for t in traces[1:-1] for e in t["events"]]
    assert header_problem(header) is None and header["strategy"] == "isd"
    for e in events:
        validate_event(e)
    assert footer_problem({"kind": "footer", **footer}) is None and footer["n_tokens"] == 10
    kinds = {e["t"] for e in events}
    assert {"forward", "propose", "emit", "kv"} <= kinds and kinds & {"accept", "reject"}
    assert "".join(e["text"] for e in events if e["t"] == "emit") == "".join(ch.choices[0].text for ch in chunks)

    got = httpx.get(f"{url}/v1/traces/{chunks[0].id}")
    assert got.status_code == 200
    lines = got.text.splitlines()
    assert json.loads(lines[0])["run_id"] == header["run_id"] and len(lines) == len(events) + 2


def test_a_batch_runs_ar_rounds_where_drafts_do_not_pay_and_answers_what_each_strategy_answers(engine, monkeypatch):
    """A forward's cost in proportion to its rows (a 2-core CPU's case): a full ISD round of 8 sequences is 56 rows
    for ~1.5 tokens each, so isd and r-isd batches run AR rounds of the model they decode (header batch_stride 1,
    'extend' forwards, nothing proposed) and still answer their solo runs' tokens; under flat costs they draft."""
    from studio.engine.cost_table import FLAT_COSTS, CostTable
    linear = CostTable({"test": "linear"}, 0, tuple(float(n) for n in range(1, 17)))
    for costs, stride in ((linear, 1), (FLAT_COSTS, 4)):
        monkeypatch.setattr("studio.run.session.planning_costs", lambda engine, costs=costs: costs)
        with serving(build_app(engine, RunConfig("ar"), limits=Limits(max_tokens=64, max_running=8))) as base:
            for strategy in ("isd", "r-isd"):
                body = {"prompt": "abcab", "max_tokens": 10, "strategy": strategy, "stream": True,
                        "stream_options": {"include_events": True}}
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                    traces = [json.loads(line[6:])["dlm_trace"] for line in r.iter_lines()
                              if line.startswith("data: {")]
                header = traces[0]["header"]
                events = [e for t in traces[1:-1] for e in t["events"]]
                assert header["batched"] and header["batch_stride"] == stride, (strategy, stride)
                roles = {e["role"] for e in events if e["t"] == "forward"}
                assert roles == {"prefill", "extend"} if stride == 1 else "verify" in roles, (strategy, roles)
                assert any(e["t"] == "propose" for e in events) == (stride > 1)
                text = "".join(e["text"] for e in events if e["t"] == "emit")
                assert text == solo(engine, strategy, "abcab", 10), (strategy, stride)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "ab", "strategy": "nope"}, 400, "strategy"),
    ({"prompt": "ab", "model": "default:nope"}, 400, "model"),
    ({"prompt": "ab", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "ab", "temperature": -1}, 400, "temperature"),
    ({"prompt": "ab", "top_p": 0}, 400, "top_p"),
    ({"prompt": "ab", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 65}, 400, "max_tokens"),
    ({"prompt": "ab", "n": 2}, 400, "n"),
    ({"prompt": "ab", "seed": "x"}, 400, "seed"),
    ({"prompt": "ab", "stop": [1]}, 400, "stop"),
    ({"prompt": "ab", "strategy": "isd", "params": {"stride": 0}}, 400, None),
    ({"prompt": "ab", "strategy": "isd", "params": {"bogus": 1}}, 400, None),
    ({"prompt": "ab", "frobnicate": True}, 400, "frobnicate"),
    ({"prompt": "ab", "logprobs": 5}, 400, "logprobs"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [0, 99]}, 400, "prompt"),
    ({"prompt": "ab", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "a" * 600, "max_tokens": 10}, 400, None),          # longer than the model's context
    ({"prompt": "ab", "stream": True, "max_tokens": 60, "model": "default:isd"}, 200, None),
])
def test_bad_requests_get_an_error_object_and_the_server_goes_on(url, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status != 200:
        error = r.json()["error"]
        assert error["message"] and "Traceback" not in error["message"] and error["param"] == param
    assert client(url).completions.create(model="default", prompt="ab", max_tokens=3).choices[0].text


def test_bad_routes_and_bodies_by_raw_http(url):
    assert httpx.get(f"{url}/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{url}/v1/chat/completions").status_code == 405
    assert httpx.get(f"{url}/v1/traces/chatcmpl-0").status_code == 404
    for messages in ([], [{"role": "robot", "content": "ab"}], [{"role": "user", "content": 3}]):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(f"{url}/v1/completions", content=b"x" * (Limits().max_body_bytes + 1))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_an_api_key_is_required_and_checked(engine):
    with serving(build_app(engine, RunConfig("ar", max_new_tokens=4), api_key="s3cret")) as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "ab"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert client(base, "s3cret").completions.create(model="default", prompt="ab").choices[0].text


class Gate:
    """Holds the decode thread: each run step waits for a permit (tests pace the scheduler deterministically)."""

    def __init__(self, monkeypatch):
        from studio.run.session import Run
        self.permits, self.steps = threading.Semaphore(0), 0
        advance = Run.advance

        def gated(run):
            self.permits.acquire()
            self.steps += 1
            return advance(run)
        monkeypatch.setattr(Run, "advance", gated)

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()


def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_slot(engine, monkeypatch):
    gate = Gate(monkeypatch)
    app = build_app(engine, RunConfig("ar", max_new_tokens=50), limits=Limits(max_running=1, max_queued=0))
    with serving(app) as base, httpx.Client(timeout=30) as http:
        scheduler = app.state.scheduler
        with http.stream("POST", f"{base}/v1/completions", json={"prompt": "abc", "stream": True}) as first:
            gate.allow(3)
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))   # it runs
            busy = http.post(f"{base}/v1/completions", json={"prompt": "ab"})
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "rate_limit_exceeded"
        # the first client has gone: its run stops at the next step boundary, without decoding the rest
        before = gate.steps
        gate.allow(200)
        for _ in range(200):
            if scheduler.load == (0, 0):
                break
            threading.Event().wait(0.02)
        assert scheduler.load == (0, 0) and gate.steps - before <= 2
        done = http.post(f"{base}/v1/completions", json={"prompt": "ab", "max_tokens": 3})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3


def test_eight_concurrent_greedy_clients_get_their_solo_outputs(engine, url):
    strategies = ["ar", "isd", "r-isd", "jacobi", "ar", "isd", "r-isd", "jacobi-mr"]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        out = client(url).completions.create(model=f"default:{strategies[i]}", prompt=PROMPTS[i], max_tokens=16)
        results[i] = out.choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: solo(engine, strategies[i], PROMPTS[i], 16) for i in range(8)} == results


def test_the_served_trace_reads_as_a_trace_file(url, tmp_path):
    out = client(url).completions.create(model="default:jacobi", prompt="cab", max_tokens=6)
    path = tmp_path / "t.jsonl"
    path.write_bytes(httpx.get(f"{url}/v1/traces/{out.id}").content)
    trace = read_trace(path)
    assert trace.footer["text"] == out.choices[0].text and trace.header["strategy"] == "jacobi"


@pytest.mark.parametrize("args, needle", [
    (["--max-running", "0"], "--max-running must be >= 1"),
    (["--port", "{taken}"], "cannot serve on 127.0.0.1:{taken}"),
])
def test_serve_refuses_bad_options_in_one_line_before_loading_the_model(args, needle):
    import socket

    from tests.support.cli import assert_one_line_error, cli
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        fill = [a.replace("{taken}", port) for a in args]
        assert_one_line_error(cli("serve", "--model", "random:smollm2-135m", *fill), needle.replace("{taken}", port))


def test_bench_clients_measures_the_server_concurrent_against_one_at_a_time(engine, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from studio.cli import app
    from studio.engine.engine import Engine
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS[:4]) + "\n")
    res = CliRunner().invoke(app, ["bench", "clients", "3", "-s", "isd,jacobi", "--prompts", str(prompts),
                                   "--max-new-tokens", "6", "--repeats", "2", "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(res.stdout)
    assert rep["clients"] == 3 and rep["repeats"] == 2
    assert [(s["label"], s["batched"]) for s in rep["strategies"]] == [("ar", True), ("isd", True), ("jacobi", False)]
    for s in rep["strategies"]:
        assert s["identical"] == 1.0 and s["speedup"]["n"] == 2 and s["tok_s_concurrent"]["min"] > 0
    # one load of ar, isd and r-isd at once: each strategy in a batch of its own, every answer its solo run's
    res = CliRunner().invoke(app, ["bench", "clients", "3", "-s", "isd,r-isd", "--mixed", "--prompts", str(prompts),
                                   "--max-new-tokens", "6", "--repeats", "1", "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(res.stdout)
    assert rep["mixed"] and [(s["label"], s["batched"], s["identical"]) for s in rep["strategies"]] == [
        ("ar+isd+r-isd", True, 1.0)]
    bad = CliRunner().invoke(app, ["bench", "--clients", "3", "--task", "quick"])   # the old spelling
    assert "--clients measures the server alone: drop --task" in str(bad.exception)
    bad = CliRunner().invoke(app, ["bench", "clients", "0"])
    assert "bench clients: N must be >= 1, got 0" in str(bad.exception)
    bad = CliRunner().invoke(app, ["bench", "--repeats", "2", "clients", "3"])   # bench's options, not its own
    assert "bench clients: give --repeats after its name" in str(bad.exception)


def test_a_request_without_max_tokens_stays_within_the_server_limit(engine):
    """The default length (128 here) is cut to --max-tokens-limit, not refused and not exceeded."""
    with serving(build_app(engine, RunConfig("ar"), limits=Limits(max_tokens=5))) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "abc"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5

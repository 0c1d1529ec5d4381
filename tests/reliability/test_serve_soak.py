"""Soak the server: 200 requests from four concurrent clients, every strategy with random parameters, streamed or
not, some abandoned mid-stream -- every answer a 200 with a whole completion, resident memory flat after warm-up,
nothing of a finished request kept."""
from __future__ import annotations

import dataclasses
import json
import random
import threading

import httpx

from studio.engine.strategies import STRATEGIES
from studio.run.config import RunConfig
from studio.run.session import Run
from studio.serve.app import build_app
from studio.serve.app import serving_in_thread as serving
from studio.serve.protocol import Limits
from tests.reliability.test_soak import live, random_params, resident_bytes
from tests.support.tiny import tiny_engine

CLIENTS, WARMUP, TOTAL = 4, 40, 200


def random_body(engine, rng: random.Random) -> dict:
    strategy = rng.choice([name for name, cls in STRATEGIES.items() if cls.decodes_ar_models])
    body = {"prompt": "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 12))), "strategy": strategy,
            "params": random_params(strategy, rng, engine.config), "max_tokens": rng.randint(1, 24),
            "seed": rng.randrange(10**6), "stream": rng.random() < 0.5}
    for key, value in (("temperature", rng.choice([0.0, rng.uniform(0.3, 1.5)])), ("top_p", rng.uniform(0.5, 1.0)),
                       ("top_k", rng.randint(0, 40)), ("stop", rng.choice("abcdefgh"))):
        if rng.random() < 0.5:
            body[key] = value
    if body["stream"]:
        body["stream_options"] = {"include_usage": rng.random() < 0.5, "include_events": rng.random() < 0.5}
    return body


def ask(http: httpx.Client, url: str, body: dict, rng: random.Random) -> None:
    """One request, checked; a streamed one is abandoned after its first chunk a tenth of the time."""
    if not body["stream"]:
        r = http.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= body["max_tokens"]
        return
    leave = rng.random() < 0.1
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        data = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
                if leave:
                    return
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "error" not in chunks[-1], chunks[-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] in ("stop", "length")


def test_two_hundred_random_requests_from_concurrent_clients():
    engine = tiny_engine("qwen3", vocab=64, eos_ids=(5,))
    engine.config = engine.model.config = dataclasses.replace(engine.config, max_seq_len=1024)  # jacobi-mr headroom
    app = build_app(engine, RunConfig("ar"), limits=Limits(max_tokens=24, max_queued=CLIENTS))
    rngs = [random.Random(seed) for seed in range(CLIENTS)]
    errors: list[BaseException] = []

    def client(rng: random.Random, n: int, url: str) -> None:
        try:
            with httpx.Client(timeout=120) as http:
                for _ in range(n):
                    ask(http, url, random_body(engine, rng), rng)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    def phase(n: int, url: str) -> None:
        threads = [threading.Thread(target=client, args=(rng, n // CLIENTS, url)) for rng in rngs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors[0]

    with serving(app) as url:
        phase(WARMUP, url)
        before = resident_bytes()
        phase(TOTAL - WARMUP, url)
        after = resident_bytes()
        assert app.state.scheduler.load == (0, 0)
    assert after < before * 1.05, f"resident memory grew from {before / 2**20:.1f} to {after / 2**20:.1f} MiB"
    assert live(Run) == 0

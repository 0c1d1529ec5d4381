"""`dlm-studio bench clients N`: what the server's batching gains, measured over HTTP in one process.

The server runs in a thread on a loopback port; after one untimed request per strategy, for every repeat and strategy,
the prompts go out from N concurrent clients, then one at a time, interleaved, so drifts of the machine hit both alike. Throughput is the new tokens over
the wall time of all the requests; the speedup a per-repeat ratio. Greedy outputs must not depend on who else was
decoding: `identical` is the share of prompts whose concurrent output equals its one-at-a-time output.

`mixed=True` measures one load of every strategy at once: prompt i goes out under strategy i mod k, so the server
decodes its batches side by side (one per strategy) while the clients wait on all of them.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Mapping

from studio.run.bench import spread
from studio.run.config import RunConfig
from studio.serve.app import build_app, serving_in_thread
from studio.serve.protocol import Limits


def _complete(http, url: str, strategy: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    r = http.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                        "strategy": strategy, "max_tokens": max_tokens})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def _send(url: str, requests: list[tuple[str, str]], max_tokens: int, clients: int) -> tuple[list[str], float]:
    """Every (strategy, prompt) request, from `clients` threads taking the next unsent one; (outputs in request
    order, tokens/s)."""
    import httpx
    outputs, tokens, lock, queue = [""] * len(requests), [0], threading.Lock(), list(range(len(requests)))

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop(0)
                outputs[i], n = _complete(http, url, *requests[i], max_tokens)
                with lock:
                    tokens[0] += n
    t = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return outputs, tokens[0] / (time.perf_counter() - t)


def loads(labels: list[str], prompts: list[str], mixed: bool) -> dict[str, list[tuple[str, str]]]:
    """The loads to measure, by row label: every prompt under each strategy, or (mixed) one load of them all,
    prompt i under strategy i mod k (`ar+isd+r-isd`)."""
    if mixed:
        return {"+".join(labels): [(labels[i % len(labels)], p) for i, p in enumerate(prompts)]}
    return {label: [(label, p) for p in prompts] for label in labels}


def measure_clients(engine, labels: Mapping[str, RunConfig], prompts: list[str], clients: int, max_tokens: int,
                    repeats: int = 1, chat_template: bool = True, mixed: bool = False,
                    progress: Callable[[str, str], None] | None = None) -> dict:
    """The `bench clients N` report: `clients, prompts, repeats, max_tokens, mixed` and per load (a strategy, or the
    mixed load) `label, batched` (whether the server batches every request of it), spreads of `tok_s_concurrent`,
    `tok_s_one_at_a_time` and `speedup` (per repeat), and `identical` (share of request x repeat whose outputs
    agree)."""
    from studio.engine.batch import unbatchable
    app = build_app(engine, RunConfig("ar"), chat_template=chat_template,
                    limits=Limits(max_tokens=max_tokens, max_running=clients, max_queued=clients))
    batched = {}
    for label, config in labels.items():
        strategy, settings = config.build()
        batched[label] = unbatchable(strategy, settings.sampling) is None
    work = loads(list(labels), prompts, mixed)
    rows = {label: {"concurrent": [], "alone": [], "same": []} for label in work}
    with serving_in_thread(app) as url:
        for label in labels:   # untimed: a first run of a strategy may measure the machine's forward costs
            _send(url, [(label, prompts[0])], max_tokens, 1)
        for rep in range(repeats):
            for label, requests in work.items():
                many, tok_s = _send(url, requests, max_tokens, clients)
                one, alone_tok_s = _send(url, requests, max_tokens, 1)
                rows[label]["concurrent"].append(tok_s)
                rows[label]["alone"].append(alone_tok_s)
                rows[label]["same"] += [a == b for a, b in zip(many, one)]
                if progress:
                    progress(f"repeat {rep + 1}/{repeats}", label)
    out = []
    for label, requests in work.items():
        r = rows[label]
        out.append({"label": label, "batched": all(batched[s] for s, _ in requests),
                    "tok_s_concurrent": spread(r["concurrent"]), "tok_s_one_at_a_time": spread(r["alone"]),
                    "speedup": spread([c / a for c, a in zip(r["concurrent"], r["alone"])]),
                    "identical": sum(r["same"]) / len(r["same"])})
    return {"model": engine.model_meta(), "clients": clients, "prompts": prompts, "repeats": repeats,
            "max_tokens": max_tokens, "mixed": mixed, "strategies": out}

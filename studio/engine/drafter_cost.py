"""What a drafter's forward costs on this machine, as a share of its target's 1-token step: the price cost-aware
drafting adds to every forward that verifies a DFlash drafter's block (strategies/dflash.py).

A count of weights misjudges it: a 2-layer drafter's small products, its attention over the whole context and its
head's rows cost a 135M target ~0.2 of a step on a CPU, where its weights say 0.1, and a planner that believes the
lower price drafts at a loss. So it is measured: the drafter's forward (a run's, from the strategy) and the target's
1-token step after `CONTEXT` tokens, interleaved so that a busy moment slows both, the median of each. It is measured
once per machine, target and drafter (its weights' size and time), and cached beside the cost table, so a seeded run
plans the same from one run to the next; a model of random weights (tests) is measured once per process.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from typing import Callable

import torch

from studio.engine.cost_table import costs_dir, table_key
from studio.engine.device import synchronize
from studio.engine.random_models import RANDOM_SOURCE

CONTEXT = 128
ROUNDS, WARMUP = 15, 3
_measured: dict[str, float] = {}   # this process's, by key


def drafter_share(engine, drafter_key: dict, make_draft: Callable[[], Callable[[], None]]) -> float:
    """The drafter's forward against `engine`'s 1-token step (cached by the engine's table key and `drafter_key`);
    `make_draft()`, called only to measure, gives a function that runs one drafter forward as a run makes it."""
    key = {**table_key(engine), "drafter": drafter_key}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    if name in _measured:
        return _measured[name]
    path = costs_dir() / f"drafter-{name}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("key") == key:
            return _measured.setdefault(name, float(stored["share"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    share = measure(engine, make_draft())
    _measured[name] = share
    if engine.source != RANDOM_SOURCE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "share": share}, indent=1) + "\n", encoding="utf-8")
    return share


def measure(engine, draft: Callable[[], None]) -> float:
    """The median drafter forward over the median eager 1-token step of the target, interleaved."""
    model, device = engine.model, engine.model.lm_head.weight.device
    kv = model.new_cache(CONTEXT + 1)
    with torch.inference_mode():
        model(torch.zeros(CONTEXT, dtype=torch.long, device=device), torch.arange(CONTEXT, device=device), kv,
              logits_rows=[CONTEXT - 1])
        kv.commit(CONTEXT)
        token, position = torch.zeros(1, dtype=torch.long, device=device), torch.tensor([CONTEXT], device=device)
        steps, drafts = [], []
        for i in range(WARMUP + ROUNDS):
            for fn, times in ((lambda: model(token, position, kv), steps), (draft, drafts)):
                synchronize(device)
                t0 = time.perf_counter()
                fn()
                synchronize(device)
                if i >= WARMUP:
                    times.append(time.perf_counter() - t0)
    return statistics.median(drafts) / statistics.median(steps)

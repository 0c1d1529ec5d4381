"""What a drafter's forward costs on this machine, as a share of its target's 1-token step: the price cost-aware
drafting adds to every forward that verifies a DFlash drafter's block (strategies/dflash.py).

A count of weights misjudges it: a 2-layer drafter's small products, its attention over the whole context and its head's
rows cost a 135M target ~0.2 of a step on a CPU in fp32 (~0.1 in int8), where its weights say 0.1, and a planner that
believes the lower price drafts at a loss. So it is measured: the drafter's forward (a run's, from the strategy) and the
target's 1-token step after `CONTEXT` tokens, interleaved so that a busy moment slows both, the median of each. A
drafter forward runs only the rows of the drafts a plan verifies, so it is measured at a few draft counts (`sizes`) and
priced between them by straight lines (`DrafterPrice`). It is measured once per machine, target and drafter (its
weights' size and time, and its quantisation), and cached beside the cost table, so a seeded run plans the same from one
run to the next; a model of random weights (tests) is measured once per process.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from studio.engine.cost_table import costs_dir, table_key
from studio.engine.device import synchronize
from studio.engine.random_models import RANDOM_SOURCE

CONTEXT = 128
ROUNDS, WARMUP = 15, 3
_measured: dict[str, "DrafterPrice"] = {}   # this process's, by key


@dataclass(frozen=True)
class DrafterPrice:
    """A drafter forward's share of a target step by the drafts it makes: measured at `drafts` (ascending), straight
    lines between them, flat past the ends."""
    drafts: tuple[int, ...]
    shares: tuple[float, ...]

    def __call__(self, k: int) -> float:
        i = bisect.bisect_left(self.drafts, k)
        if i == 0:
            return self.shares[0]
        if i == len(self.drafts):
            return self.shares[-1]
        (k0, k1), (s0, s1) = self.drafts[i - 1:i + 1], self.shares[i - 1:i + 1]
        return s0 + (s1 - s0) * (k - k0) / (k1 - k0)


def sizes(whole: int) -> list[int]:
    """The draft counts a drafter of `whole` drafts is measured at: 1, 2, 4, ... and the whole block."""
    out = [1]
    while out[-1] * 2 < whole:
        out.append(out[-1] * 2)
    return out + [whole] if whole > 1 else out


def drafter_share(engine, drafter_key: dict, whole: int,
                  make_draft: Callable[[int], Callable[[], None]]) -> DrafterPrice:
    """The drafter's forward against `engine`'s 1-token step, by drafts up to `whole` (cached by the engine's table
    key and `drafter_key`); `make_draft(k)`, called only to measure, gives a function that runs one drafter forward
    of k drafts as a run makes it."""
    key = {**table_key(engine), "drafter": drafter_key, "drafts": sizes(whole)}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    if name in _measured:
        return _measured[name]
    path = costs_dir() / f"drafter-{name}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("key") == key:
            shares = [float(s) for s in stored["shares"]]
            if len(shares) == len(key["drafts"]):
                return _measured.setdefault(name, DrafterPrice(tuple(key["drafts"]), tuple(shares)))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    measured = measure(engine, {k: make_draft(k) for k in key["drafts"]})
    price = _measured[name] = DrafterPrice(tuple(key["drafts"]), tuple(measured[k] for k in key["drafts"]))
    if engine.source != RANDOM_SOURCE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "shares": list(price.shares)}, indent=1) + "\n", encoding="utf-8")
    return price


def measure(engine, drafts: dict[int, Callable[[], None]]) -> dict[int, float]:
    """Each drafter forward's median over the median eager 1-token step of the target, all interleaved."""
    model, device = engine.model, engine.model.lm_head.weight.device
    kv = model.new_cache(CONTEXT + 1)
    with torch.inference_mode():
        model(torch.zeros(CONTEXT, dtype=torch.long, device=device), torch.arange(CONTEXT, device=device), kv,
              logits_rows=[CONTEXT - 1])
        kv.commit(CONTEXT)
        token, position = torch.zeros(1, dtype=torch.long, device=device), torch.tensor([CONTEXT], device=device)
        runs = [(lambda: model(token, position, kv), [])] + [(fn, []) for fn in drafts.values()]
        for i in range(WARMUP + ROUNDS):
            for fn, times in runs:
                synchronize(device)
                t0 = time.perf_counter()
                fn()
                synchronize(device)
                if i >= WARMUP:
                    times.append(time.perf_counter() - t0)
    step = statistics.median(runs[0][1])
    return {k: statistics.median(times) / step for k, (_, times) in zip(drafts, runs[1:])}

"""Measuring what a forward of n rows costs on this machine: the table cost-aware drafting plans with
(studio.engine.cost_table).

A strategy that verifies k draft rows pays for a (1 + k)-row forward whether or not the drafts are accepted,
so whether drafting pays depends on how that cost grows with the rows on the loaded model, device and dtype
(on a CPU a 7-row forward costs ~1.3x a 1-row step; on a GPU nearly nothing more). `calibrate` measures it:
the median time of a forward of 1..`max_rows` rows after a fixed context, plain and with the LoRA on every row
(when an adapter is attached), round-robin as `forward_cost.measure_forwards` does, again (up to `ATTEMPTS` times,
within `BUDGET_S`) while the machine is too busy for steady times, keeping the steadiest table. `cost_table` reads the
cached table, measuring (and caching) it at first use (10-30 s) and again on `refresh`.
"""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

import torch

from studio.engine.cost_table import MAX_ROWS, CostTable, lora_rank, store, stored_table, table_key
from studio.engine.forward_cost import Shape, measure_forwards
from studio.engine.random_models import RANDOM_SOURCE

CONTEXT = 128        # KV length the forwards attend over: a short chat turn's
ATTEMPTS = 3
# A busy machine is measured again only while the measurement stays within this (the steadiest table so far is kept,
# and `unsteady_line` says so): the first cost-aware run on a model waits for it, ~10 s on a quiet 2-core CPU, where
# three attempts on a loaded one took ~100 s
BUDGET_S = 30.0


def calibrate(engine, max_rows: int = MAX_ROWS, repeats: int = 5, warmup: int = 1,
              context: int = CONTEXT) -> CostTable:
    """Measure the table on `engine` now (every row count plain, and gated where an adapter is attached), again
    while its times are not steady (`STEADY`), at most `ATTEMPTS` times; the steadiest table."""
    shapes = [Shape(f"{n} rows", n) for n in range(1, max_rows + 1)]
    if engine.lora is not None:
        shapes += [Shape(f"{n} rows, all gated", n, gated=n) for n in range(1, max_rows + 1)]
    best, start = None, time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        costs = measure_forwards(engine, repeats=repeats, warmup=warmup, context=context, shapes=shapes)
        plain = [c for c in costs if not c.shape.gated]
        table = CostTable(table_key(engine), context, _never_cheaper([c.ms for c in plain]),
                          _never_cheaper([c.ms for c in costs if c.shape.gated]) or None,
                          statistics.median(c.spread for c in plain), torch.get_num_threads(), lora_rank(engine))
        if best is None or table.noise < best.noise:
            best = table
        spent = time.monotonic() - start
        if best.steady or spent + spent / attempt > BUDGET_S:   # steady, or another attempt would pass the budget
            break
    return best


def _never_cheaper(ms: list[float]) -> tuple[float, ...]:
    """Each row count's time at least the one before it: a forward of more rows does not cost less, and a
    median of a few noisy samples that says so would have a planner draft more than pays."""
    return tuple(itertools.accumulate(ms, max))


# Told (with one line) before a table is measured, which pauses the first cost-aware run for 10-30 s, and after,
# when the table is not steady: the CLI says so on stderr (studio.run.options.say_when_measuring_costs)
on_measure: Callable[[str], None] | None = None


def cost_table(engine, refresh: bool = False) -> CostTable:
    """The cached table for `engine`'s key, measured (and cached) when there is none, it does not read back, or
    `refresh` asks. A model of random weights (tests, `random:NAME`) is measured once per process, never written."""
    if not refresh:
        table = stored_table(engine)
        if table is not None:
            return table
    random_weights = engine.source == RANDOM_SOURCE
    if on_measure is not None and not random_weights:
        on_measure(measuring_line(engine))
    table = calibrate(engine)
    store(engine, table)
    if on_measure is not None and not random_weights and not table.steady:
        on_measure(unsteady_line(table))
    return table


def measuring_line(engine) -> str:
    """What a front end says while a table is measured (the first cost-aware run on a model waits for it): the model
    by its own name (the embedded one's spec is `default`)."""
    model = engine.config.name or engine.name
    return (f"measuring this machine's forward costs for {model} (10-30 s, once per model, device and dtype): "
            "cost-aware drafting plans with them …")


def unsteady_line(table: CostTable) -> str | None:
    """What a front end says of a table measured while the machine was busy (None for a steady one)."""
    if table.steady:
        return None
    return (f"the machine was busy while these forwards were timed (their times spread {100 * table.noise:.0f}% after "
            f"{ATTEMPTS} tries): drafting plans may be off until `dlm-studio models costs --refresh` on a quiet machine")



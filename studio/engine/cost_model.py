"""What a forward of n rows costs on this machine: the table cost-aware drafting plans with.

A strategy that verifies k draft rows pays for a (1 + k)-row forward whether or not the drafts are accepted,
so whether drafting pays depends on how that cost grows with the rows on the loaded model, device and dtype
(on a CPU a 7-row forward costs ~1.3x a 1-row step; on a GPU nearly nothing more). `calibrate` measures it:
the median time of a forward of 1..`max_rows` rows after a fixed context, plain and with the LoRA on every row
(when an adapter is attached), round-robin as `forward_cost.measure_forwards` does, again (up to `ATTEMPTS` times,
within `BUDGET_S`) while the machine is too busy for steady times, keeping the steadiest table. `cost_table` keeps one
table per model, device, dtype, thread count and LoRA rank in the user cache (`costs/`), measured at first use
(10-30 s) and again on `refresh`.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from studio.engine.forward_cost import Shape, measure_forwards
from studio.engine.random_models import RANDOM_SOURCE

# Part of every table's key: bump it when the engine changes what a forward of n rows costs (2: the CPU's W @ x.T
# projections, model.linear; 3: oneDNN for 3-16 rows; 4: our kernels for 1-4 rows and gated LoRA rows)
TABLE_VERSION = 4
MAX_ROWS = 16        # ISD stride 8 (2N - 1 = 15 rows + 1), Jacobi's default block of 16
CONTEXT = 128        # KV length the forwards attend over: a short chat turn's
# Steady enough to plan with: the row counts' median spread (interquartile range / median of a shape's times) at
# most this. Measured while another job loads the machine, the times swing by more and the rows' differences drown
# in them: a table that prices a 16-row forward like a 1-row one would have drafts look free for every later run.
STEADY = 0.10
ATTEMPTS = 3
# A busy machine is measured again only while the measurement stays within this (the steadiest table so far is kept,
# and `unsteady_line` says so): the first cost-aware run on a model waits for it, ~10 s on a quiet 2-core CPU, where
# three attempts on a loaded one took ~100 s
BUDGET_S = 30.0


@dataclass(frozen=True)
class CostTable:
    """Median milliseconds of one forward by its row count: `plain_ms[n - 1]` for n rows without the LoRA,
    `gated_ms[n - 1]` for n rows all with it (None: no adapter was attached when it was measured); `noise` the
    median spread of the plain forwards' times (None: not recorded)."""
    key: dict
    context: int
    plain_ms: tuple[float, ...]
    gated_ms: tuple[float, ...] | None = None
    noise: float | None = None

    @property
    def steady(self) -> bool:
        return self.noise is None or self.noise <= STEADY

    @property
    def max_rows(self) -> int:
        return len(self.plain_ms)

    def forward_ms(self, rows: int, gated: int = 0) -> float:
        """A forward of `rows` rows, `gated` of them with the LoRA on: the plain forward plus what the LoRA added
        to a forward of `gated` rows. Past the measured rows, in proportion to the rows."""
        if rows < 1 or not 0 <= gated <= rows:
            raise ValueError(f"a forward has rows >= 1 and 0 <= gated <= rows, got rows={rows}, gated={gated}")
        ms = _at(self.plain_ms, rows)
        if gated and self.gated_ms is not None:
            ms += _at(self.gated_ms, gated) - _at(self.plain_ms, gated)
        return ms

    def relative(self, rows: int, gated: int = 0) -> float:
        """The forward's cost in 1-row steps: what a draft of rows - 1 tokens must beat."""
        return self.forward_ms(rows, gated) / self.plain_ms[0]

    def to_dict(self) -> dict:
        return {**asdict(self), "plain_ms": list(self.plain_ms),
                "gated_ms": None if self.gated_ms is None else list(self.gated_ms)}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        gated = d.get("gated_ms")
        noise = d.get("noise")
        return cls(dict(d["key"]), int(d["context"]), tuple(float(x) for x in d["plain_ms"]),
                   None if gated is None else tuple(float(x) for x in gated), None if noise is None else float(noise))


# Every forward of up to 16 rows costs what one row does (as on a GPU well below its compute): what a decode context
# built without a measured table plans with.
FLAT_COSTS = CostTable({"flat": True}, 0, (1.0,) * MAX_ROWS)


def _at(ms: tuple[float, ...], rows: int) -> float:
    """The measured time of `rows` rows; past the table, the last one's time per row times `rows` (a forward that
    wide is compute-bound, and a difference of noisy neighbours could even be negative)."""
    if rows <= len(ms):
        return ms[rows - 1]
    return ms[-1] * rows / len(ms)


def table_key(engine) -> dict:
    """What a table depends on: the model (name, shape), device, dtype, CPU threads, torch, the LoRA's rank."""
    cfg, p = engine.config, engine.model.lm_head.weight
    rank = None
    if engine.lora is not None:
        a, _ = next(iter(engine.lora.modules.values()))
        rank = int(a.shape[0])
    return {"version": TABLE_VERSION, "model": engine.name, "arch": cfg.arch, "dim": cfg.dim, "layers": cfg.n_layers, "vocab": cfg.vocab_size,
            "device": str(p.device), "dtype": str(p.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "lora_rank": rank, **_parallel_key(engine)}


def _parallel_key(engine) -> dict:
    """A tensor-parallel shard's forwards cost what its rank count makes them (one process: nothing, so the tables
    cached before tensor parallelism still read back)."""
    plan = getattr(engine.model, "parallel", None)
    return {} if plan is None else {"tp": plan.world, **({"ep": True} if plan.place_experts else {})}


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
                          statistics.median(c.spread for c in plain))
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


def costs_dir() -> Path:
    """`$XDG_CACHE_HOME/dlm-studio/costs`, beside the converted models."""
    from studio.engine.model_cache import cache_dir
    return cache_dir().parent / "costs"


def table_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return costs_dir() / f"{digest}.json"


_random_tables: dict[str, CostTable] = {}   # this process's tables of random-weight models, by file name


def cached_at(engine) -> Path | None:
    """Where `engine`'s table is cached; None for a model of random weights (measured per process)."""
    return None if engine.source == RANDOM_SOURCE else table_path(table_key(engine))


# Told (with one line) before a table is measured, which pauses the first cost-aware run for 10-30 s, and after,
# when the table is not steady: the CLI says so on stderr (studio.run.options.say_when_measuring_costs)
on_measure: Callable[[str], None] | None = None


def cost_table(engine, refresh: bool = False) -> CostTable:
    """The cached table for `engine`'s key, measured (and cached) when there is none, it does not read back, or
    `refresh` asks. A model of random weights (tests, `random:NAME`) is measured once per process, never written."""
    key = table_key(engine)
    path = table_path(key)
    random_weights = engine.source == RANDOM_SOURCE
    if not refresh:
        table = stored_table(engine)
        if table is not None:
            return table
    if on_measure is not None and not random_weights:
        on_measure(measuring_line(key["model"]))
    table = calibrate(engine)
    if random_weights:
        _random_tables[path.name] = table
    else:
        from studio.files import atomic_write
        os.makedirs(path.parent, exist_ok=True)
        with atomic_write(path) as f:
            json.dump(table.to_dict(), f, indent=1)
        if on_measure is not None and not table.steady:
            on_measure(unsteady_line(table))
    return table


def measuring_line(model: str) -> str:
    """What a front end says while a table is measured (the first cost-aware run on a model waits for it)."""
    return (f"measuring this machine's forward costs for {model} (10-30 s, once per model, device and dtype): "
            "cost-aware drafting plans with them …")


def unsteady_line(table: CostTable) -> str | None:
    """What a front end says of a table measured while the machine was busy (None for a steady one)."""
    if table.steady:
        return None
    return (f"the machine was busy while these forwards were timed (their times spread {100 * table.noise:.0f}% after "
            f"{ATTEMPTS} tries): drafting plans may be off until `dlm-studio models costs --refresh` on a quiet machine")


def stored_table(engine) -> CostTable | None:
    """`engine`'s table if one is cached (or, for random weights, measured in this process), else None."""
    key = table_key(engine)
    path = table_path(key)
    return _random_tables.get(path.name) if engine.source == RANDOM_SOURCE else _read(path, key)


def _read(path: Path, key: dict) -> CostTable | None:
    """The table cached at `path` for `key`; None when it is absent, unreadable or another key's."""
    try:
        table = CostTable.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return table if table.key == key else None

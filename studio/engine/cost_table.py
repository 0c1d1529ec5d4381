"""What a forward of n rows costs on this machine, as cost-aware drafting reads it: the table, its key and its cache.

One table per model, device, dtype and torch, cached in the user cache (`costs/`); a model of random weights keeps its
table in this process only. The thread count and the LoRA's rank it was measured with are recorded, not keyed: what
drafting reads is the cost of n rows against one, which a process with a core kept for its UI (the TUI, the web) or
another adapter changes little, and a plan only changes speed, never the output. A view with an adapter needs a
table with the LoRA's costs (`gated_ms`); one without is measured again. Measuring one is studio.engine.cost_model's.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from studio.engine.compiled import is_compiled
from studio.engine.model_cache import cache_dir
from studio.engine.random_models import RANDOM_SOURCE
from studio.files import atomic_write

# Part of every table's key: bump it when the engine changes what a forward of n rows costs (2: the CPU's W @ x.T
# projections, kernels/projection.py; 3: oneDNN for 3-16 rows; 4: our kernels for 1-4 rows and gated LoRA rows)
TABLE_VERSION = 4
MAX_ROWS = 16        # ISD stride 8 (2N - 1 = 15 rows + 1), Jacobi's default block of 16
# Steady enough to plan with: the row counts' median spread (interquartile range / median of a shape's times) at
# most this. Measured while another job loads the machine, the times swing by more and the rows' differences drown
# in them: a table that prices a 16-row forward like a 1-row one would have drafts look free for every later run.
STEADY = 0.10
@dataclass(frozen=True)
class CostTable:
    """Median milliseconds of one forward by its row count: `plain_ms[n - 1]` for n rows without the LoRA,
    `gated_ms[n - 1]` for n rows all with it (None: no adapter was attached when it was measured); `noise` the
    median spread of the plain forwards' times (None: not recorded); `threads` and `lora_rank` what it was measured
    with (None: not recorded, or no adapter)."""
    key: dict
    context: int
    plain_ms: tuple[float, ...]
    gated_ms: tuple[float, ...] | None = None
    noise: float | None = None
    threads: int | None = None
    lora_rank: int | None = None

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
        gated, noise, threads, rank = d.get("gated_ms"), d.get("noise"), d.get("threads"), d.get("lora_rank")
        return cls(dict(d["key"]), int(d["context"]), tuple(float(x) for x in d["plain_ms"]),
                   None if gated is None else tuple(float(x) for x in gated), None if noise is None else float(noise),
                   None if threads is None else int(threads), None if rank is None else int(rank))


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
    """What a table depends on: the model (name, shape), device, dtype, torch (and the ranks it is split across, the
    quantisation, and whether forwards replay CUDA graphs or run compiled)."""
    cfg, p = engine.config, engine.model.lm_head.weight
    return {"version": TABLE_VERSION, "model": engine.name, "arch": cfg.arch, "dim": cfg.dim, "layers": cfg.n_layers,
            "vocab": cfg.vocab_size, "device": str(p.device), "dtype": str(p.dtype).removeprefix("torch."),
            "torch": torch.__version__, **_parallel_key(engine), **_quant_key(engine),
            **({"graphs": True} if getattr(engine, "graphs", False) else {}),   # forwards replaying CUDA graphs
            **({"compiled": True} if is_compiled(engine.model) else {})}   # the step through torch.compile


def _quant_key(engine) -> dict:
    """An int8 model's forwards cost what its own weights cost (a float model's key stays what it was)."""
    quant = getattr(engine, "quant", "none")
    return {} if quant == "none" else {"quant": quant}


def lora_rank(engine) -> int | None:
    """The rank of the adapter `engine`'s view has attached (None: none)."""
    if engine.lora is None:
        return None
    a, _ = next(iter(engine.lora.modules.values()))
    return int(a.shape[0])


def _parallel_key(engine) -> dict:
    """A tensor-parallel shard's forwards cost what its rank count makes them (one process: nothing, so the tables
    cached before tensor parallelism still read back)."""
    plan = getattr(engine.model, "parallel", None)
    return {} if plan is None else {"tp": plan.world, **({"ep": True} if plan.place_experts else {})}


def costs_dir() -> Path:
    """`$XDG_CACHE_HOME/dlm-studio/costs`, beside the converted models."""
    return cache_dir().parent / "costs"


def table_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return costs_dir() / f"{digest}.json"


_random_tables: dict[str, CostTable] = {}   # this process's tables of random-weight models, by file name


def cached_at(engine) -> Path | None:
    """Where `engine`'s table is cached; None for a model of random weights (measured per process)."""
    return None if engine.source == RANDOM_SOURCE else table_path(table_key(engine))


def store(engine, table: CostTable) -> None:
    """Keep `table` as `engine`'s: in the cache, or in this process for random weights."""
    path = table_path(table.key)
    if engine.source == RANDOM_SOURCE:
        _random_tables[path.name] = table
        return
    os.makedirs(path.parent, exist_ok=True)
    with atomic_write(path) as f:
        json.dump(table.to_dict(), f, indent=1)


def stored_table(engine) -> CostTable | None:
    """`engine`'s table if one is cached (or, for random weights, measured in this process), else None."""
    key = table_key(engine)
    path = table_path(key)
    table = _random_tables.get(path.name) if engine.source == RANDOM_SOURCE else _read(path, key)
    if table is not None and engine.lora is not None and table.gated_ms is None:
        return None   # measured without an adapter: it has no LoRA costs to plan a gated forward with
    return table


def _read(path: Path, key: dict) -> CostTable | None:
    """The table cached at `path` for `key`; None when it is absent, unreadable or another key's."""
    try:
        table = CostTable.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return table if table.key == key else None

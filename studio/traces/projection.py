"""Device projections: what a run would cost on another device, from its trace and that device's forward costs.

A trace records every forward's shape (rows, LoRA rows), so its decode time elsewhere is the sum of what those
forwards cost there: a device's `CostTable` (studio.engine.cost_table) prices each one. The projection is of the
forwards alone (host work, sampling and drawing are not in a table) and is always shown as one, with the table's
origin. Like the measured decode rate (docs/metrics.md) it counts the tokens emitted after the prefill step and the
forwards that made them; one-token steps of AR make one token each, so `ideal_ar_ms` is what AR would pay.

Tables: shipped ones in studio/presets/costs/NAME.json, saved ones (`models costs --save NAME`) in the user cache's
`devices/`, or a file of the same format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Iterable, Mapping

from studio.engine.cost_table import CostTable, costs_dir
from studio.errors import BadInput
from studio.files import atomic_write

FORMAT = "dlm-studio.device-costs/1"
SHIPPED = Path(__file__).parents[1] / "presets" / "costs"


@dataclass(frozen=True)
class DeviceCosts:
    """A device's forward costs: `name` (what `--costs` takes), `origin` (one line: the device, date, model, dtype,
    mode, which rows were measured and which derived), the table itself."""
    name: str
    origin: str
    table: CostTable

    def to_dict(self) -> dict:
        return {"format": FORMAT, "name": self.name, "origin": self.origin, "table": self.table.to_dict()}


@dataclass(frozen=True)
class Projection:
    """A run's decode on a device: `tokens` emitted after the prefill step by `forwards` forwards that would take
    `forward_ms` there; `ideal_ar_ms` is `tokens` one-row steps."""
    tokens: int
    forwards: int
    forward_ms: float
    ideal_ar_ms: float

    @property
    def vs_steps(self) -> float | None:
        """The speed-up over one-token steps (None for a run that decoded nothing)."""
        return self.ideal_ar_ms / self.forward_ms if self.forward_ms > 0 else None

    def vs(self, baseline: "Projection") -> float | None:
        """The speed-up over another projected run (tokens per projected ms, both): `× ar on DEVICE`."""
        if not (self.tokens and self.forward_ms and baseline.tokens and baseline.forward_ms):
            return None
        return (self.tokens / self.forward_ms) / (baseline.tokens / baseline.forward_ms)


def project(events: Iterable[Mapping], costs: DeviceCosts) -> Projection:
    """Price the decode forwards of `events` (every step after the prefill step) by `costs`. A forward wider than
    the table is priced in proportion to its rows (`CostTable.forward_ms`); LoRA rows cost what plain rows do on a
    table measured without an adapter."""
    tokens = forwards = 0
    ms = 0.0
    for e in events:
        if e["step"] == 0:
            continue
        if e["t"] == "emit":
            tokens += len(e["tok"])
        elif e["t"] == "forward":
            forwards += 1
            ms += costs.table.forward_ms(e["n_tokens"], min(e["lora_rows"], e["n_tokens"]))
    return Projection(tokens, forwards, ms, tokens * costs.table.forward_ms(1))


def label(costs: DeviceCosts) -> str:
    """The column head every surface uses: it always says projection."""
    return f"× ar on {costs.name} (projected)"


def caption(name: str, origin: str) -> str:
    """What a projected column's table says under it: whose costs, and that they are a projection."""
    return f"projected: each run's decode forwards priced by the {name} table ({origin}); forwards only, not measured"


def names() -> list[str]:
    """The tables `--costs` finds by name: shipped ones, then those saved on this machine."""
    found = {p.stem for p in SHIPPED.glob("*.json")} | {p.stem for p in saved_dir().glob("*.json")}
    return sorted(found)


def saved_dir() -> Path:
    return costs_dir().parent / "devices"


def load(spec: str) -> DeviceCosts:
    """A table by name (saved on this machine first, then shipped) or a file; BadInput for anything else."""
    path = Path(spec)
    if not path.suffix:
        saved, shipped = saved_dir() / f"{spec}.json", SHIPPED / f"{spec}.json"
        path = saved if saved.is_file() else shipped
        if not path.is_file():
            raise BadInput(f"no device cost table named {spec!r}: one of {', '.join(names()) or 'none'}, or a file "
                           "written by `dlm-studio models costs --save NAME`")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        table = CostTable.from_dict(d["table"])
        if not table.plain_ms or min(table.plain_ms) <= 0:
            raise ValueError("a table's times must be positive")
        return DeviceCosts(str(d["name"]), str(d["origin"]), table)
    except OSError as err:
        raise BadInput(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise BadInput(f"{path} is not a device cost table: {err}") from None


def check_name(name: str) -> None:
    if not name or Path(name).name != name or name.startswith(".") or Path(name).suffix:
        raise BadInput(f"--save takes a plain name (no path or suffix), got {name!r}")


def save(name: str, table: CostTable) -> Path:
    """This machine's `table` as the device table `name` (in `saved_dir()`), its origin read from the table."""
    check_name(name)
    k = table.key
    rank = f", LoRA rank {table.lora_rank} on gated rows" if table.lora_rank else ", no LoRA rows measured"
    origin = (f"{k.get('device', '?')} measured {date.today().isoformat()}: {k.get('model', '?')}, "
              f"{k.get('dtype', '?')}, torch {k.get('torch', '?')}, {table.threads or '?'} threads, rows 1-"
              f"{table.max_rows} measured{rank}")
    path = saved_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        json.dump(DeviceCosts(name, origin, table).to_dict(), f, indent=1)
    return path

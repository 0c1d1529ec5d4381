"""`dlm-studio train jacobi`: Jacobi Forcing's rounds (docs/training.md#jacobi-forcing).

Round 1 records the model's Jacobi trajectories of the data's answers at block n and trains a LoRA on every row
(studio.train.jacobi_forcing). Each further round is the paper's progressive distillation: the model the last
round made answers the same prompts again (its own greedy answers: the new model's fixed points), its trajectories
are recorded at twice the block, and the LoRA trains on from the last round's weights.

An output directory holds the last round's adapter; with --rounds > 1 the earlier rounds live in round1/, round2/,
..., each round's regenerated data in roundK-data/, and every round's trajectories in its directory
(trajectories.jsonl). Every stage continues where it stopped under --resume, and a time budget covers them all.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from studio.errors import BadInput
from studio.train import data, trajectories
from studio.train.jacobi_forcing import JacobiForcing
from studio.train.trainer import STATE_JSON, TrainConfig, train

TRAJECTORIES = "trajectories.jsonl"


@dataclass
class Round:
    index: int          # 1-based
    block: int          # n of this round's trajectories
    dir: Path           # its adapter (and trajectories)
    data: Path          # the sequences it records: the user's data, or the last round's model's answers


def plan(data_dir: Path, out: Path, block: int, n_rounds: int) -> list[Round]:
    return [Round(k, block * 2 ** (k - 1), out if k == n_rounds else out / f"round{k}",
                  data_dir if k == 1 else out / f"round{k}-data") for k in range(1, n_rounds + 1)]


def finished(path: Path) -> bool:
    try:
        return json.loads((path / STATE_JSON).read_text(encoding="utf-8")).get("stopped") == "done"
    except (OSError, ValueError):
        return False


def check_out(out: Path, resume: bool) -> None:
    """BadInput unless `out` can take this run: fresh without --resume, a run's directory with it."""
    started = out.is_dir() and any(out.iterdir())
    if resume and not (out / TRAJECTORIES).is_file() and not (out / "round1").is_dir():
        raise BadInput(f"nothing to resume in {out} (no {TRAJECTORIES} and no round1/)")
    if not resume and started:
        raise BadInput(f"{out} exists and is not empty: --resume to continue its run, or another --out")


def run(load_engine: Callable[[str | None], object], data_dir: Path, out: Path, cfg: TrainConfig, n_rounds: int,
        record_batch: int, budget_s: float | None, progress: Callable[..., None], on_step=None) -> dict:
    """Every round in turn; returns the last state reached ({"stopped": ...}). `load_engine(adapter)`: a fresh
    engine of the model, with that adapter attached (None: the base model). `progress(stage, done, total, info)`."""
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    rounds = plan(data_dir, out, cfg.block_size, n_rounds)
    state: dict = {}
    for r in rounds:
        if finished(r.dir):
            continue
        previous = None if r.index == 1 else str(rounds[r.index - 2].dir)
        engine = load_engine(previous)
        adapted = previous is not None
        if adapted and not _answered(r.data, data_dir):
            _answer(engine, data_dir, r.data, progress)
        seqs = data.load_sequences(r.data)
        r.dir.mkdir(parents=True, exist_ok=True)
        trajs = trajectories.record(
            engine.model, seqs, r.block, r.dir / TRAJECTORIES, seed=cfg.seed, batch_size=record_batch,
            adapted=adapted, deadline=deadline,
            progress=lambda done, total, share: progress(f"record n={r.block}", done, total,
                                                         f"fixed point = answer {share:.1%}"))
        if len(trajs) < len([s for s in seqs if len(s.tokens) - s.prompt_len >= r.block]):
            return {"stopped": "time budget", "stage": f"round {r.index}: recording", "dir": str(r.dir)}
        engine = load_engine(None)           # the LoRA trains on the base weights (from the last round's)
        round_cfg = dataclasses.replace(cfg, block_size=r.block, init=previous)
        objective = JacobiForcing(r.block, cfg.window, cfg.schedule, cfg.ar_weight, cfg.distill_temperature,
                                  eos_ids=engine.eos_ids())
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        state = train(engine.model, trajs, objective, round_cfg, r.dir, resume=(r.dir / STATE_JSON).is_file(),
                      time_budget_s=left, on_step=on_step)
        state = {**state, "dir": str(r.dir), "stage": f"round {r.index}: training"}
        if state["stopped"] != "done":
            return state
    return state or {"stopped": "done", "dir": str(out), "stage": "all rounds were done"}


def _answered(path: Path, data_dir: Path) -> bool:
    try:
        return sum(data.read_manifest(path)["shard_sizes"]) == sum(data.read_manifest(data_dir)["shard_sizes"])
    except BadInput:
        return False


def _answer(engine, data_dir: Path, out: Path, progress) -> None:
    """The adapted model's greedy answers to the prompts of `data_dir`, with its token limit, into `out`."""
    m = data.read_manifest(data_dir)
    prompts = data.read_prompts(data_dir)[:sum(m["shard_sizes"])]
    data.generate(engine, prompts, out, m["max_new_tokens"], resume=(out / data.MANIFEST).is_file(),
                  gate_clean_rows=True, meta={"prompts": f"{data_dir} answered by {engine.adapter}"},
                  progress=lambda done, total, n_tokens: progress("answer", done, total, f"{n_tokens} tokens"))

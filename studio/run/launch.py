"""Starting a tensor-parallel engine: ranks spawned on this machine (`--tp N`) or started by `torchrun`.

`start` returns rank 0's shard of the engine to the command that asked for it; every other rank builds its own
shard of the same engine and follows rank 0 (studio.run.mirror) until rank 0 ends, then exits. A rank builds
with `build(shard=planner)`: a model read from files is read only as far as the rank keeps it; an engine that comes
back whole (random weights, the tests' tiny models) is split here.
"""
from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import os
import sys
from typing import Callable

from studio.engine.cost_model import calibrate
from studio.engine.graphs import CachePool
from studio.engine.lora import attach_adapter
from studio.engine.strategies import make_strategy
from studio.engine.tensor_parallel import TensorParallel, check_splittable, shard_model
from studio.errors import BadInput, RankLost
from studio.presets.shipped import adapter_path
from studio.run import group as groups
from studio.run import mirror
from studio.run.session import Run, prepare

_workers: list = []


def shard_engine(engine, group: groups.Group, place_experts: bool = False):
    """This rank's shard of `engine` (no adapter attached yet: adapters are split as they load); `place_experts`:
    an MoE model's experts placed whole across the ranks (--ep)."""
    check_splittable(engine.config, group.world, place_experts)
    if engine.lora is not None:
        raise ValueError("shard the engine before attaching an adapter")
    plan = TensorParallel(group.rank, group.world, group.pg, engine.config, place_experts)
    model = shard_model(engine.model, plan)
    return dataclasses.replace(engine, model=model, config=model.config, graphs=False, _views={}, caches=CachePool())


def start(world: int, build: Callable[[], object], device: str = "cpu", adapter: str | None = None,
          timeout_s: float = groups.TIMEOUT_S, place_experts: bool = False):
    """Rank 0's shard of the engine `build(shard=...)` makes (a picklable callable, run on every rank), split across `world`
    ranks: under torchrun (RANK and WORLD_SIZE set) this process's rank, a rank > 0 following rank 0 and exiting when
    it is done; otherwise ranks 1.. are spawned here. `adapter` attaches to every rank's shard; `place_experts`:
    expert parallelism for an MoE model."""
    split = (adapter, place_experts)
    if groups.torchrun_world() > 1:
        rank, launched = int(os.environ["RANK"]), groups.torchrun_world()
        if world not in (1, launched):
            raise BadInput(f"--tp {world}, but torchrun started {launched} ranks")
        world = launched
        if rank:
            _serve(rank, world, None, build, device, split, timeout_s)
            sys.exit(0)
        group = groups.join(0, world, device=device, timeout_s=timeout_s)
    else:
        port = groups.free_port()
        spawn = multiprocessing.get_context("spawn")
        for rank in range(1, world):
            p = spawn.Process(target=_serve, args=(rank, world, port, build, device, split, timeout_s), daemon=True)
            p.start()
            _workers.append(p)
        groups.set_threads(world)
        group = groups.join(0, world, port=port, device=device, timeout_s=timeout_s)
    engine = _shard(build, group, *split)
    mirror.lead(group)
    atexit.register(finish)
    return engine


def finish() -> None:
    """Tell the other ranks to stop, wait for the ones spawned here, leave the group (rank 0, at exit)."""
    try:
        if mirror.leader() is not None:
            mirror.stop_leading()
    except RankLost:
        pass
    for p in _workers:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    _workers.clear()
    groups.leave()


def _shard(build, group: groups.Group, adapter: str | None, place_experts: bool):
    """This rank's shard of what `build` makes, with `adapter` attached."""
    def planner(cfg):
        check_splittable(cfg, group.world, place_experts)
        return TensorParallel(group.rank, group.world, group.pg, cfg, place_experts)
    engine = build(shard=planner)
    if engine.model.parallel is None:
        engine = shard_engine(engine, group, place_experts)
    if adapter and adapter != "none":
        attach_adapter(engine, adapter_path(adapter))
    elif adapter == "none":
        engine.adapter_choice = "none"
    return engine


def _serve(rank: int, world: int, port: int | None, build, device: str, split: tuple, timeout_s: float):
    """A rank > 0: join, build the same engine, keep its shard, follow rank 0 until it stops (or is lost)."""
    groups.set_threads(world)
    group = groups.join(rank, world, port=port, device=device, timeout_s=timeout_s)
    try:
        follow(_shard(build, group, *split), group)
    except BadInput:   # the model or the options: rank 0 meets the same and says it, once
        pass
    except Exception as e:   # rank 0 ended without a stop (it failed or was killed), or this rank failed
        print(f"dlm-studio: rank {rank}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}",
              file=sys.stderr)
    finally:
        groups.leave()


def follow(engine, group: groups.Group) -> None:
    """A rank > 0's loop: build and advance what rank 0 announces, until it says stop."""
    runs, caches = {}, {}
    while True:
        gone, message = mirror.receive(group)
        for run_id in gone:
            caches.pop(run_id, None)
        kind = message[0]
        if kind == "stop":
            return
        if kind == "calibrate":
            calibrate(_view(engine, message[1]))
        elif kind == "score":   # a text scored by one forward (mirror.score_logits)
            _, adapter, ids, rows, gated = message
            _view(engine, adapter).forward_rows(ids, rows, gated)
        elif kind == "run":
            _, run_id, spec = message
            run = _build(engine, spec, caches)
            runs[run_id], caches[run_id] = run, run.ctx.kv
        elif kind == "advance":
            _, run_id, cancelled = message
            run = runs[run_id]
            if cancelled:
                run.cancel()
            run.advance()
            if run.done:
                del runs[run_id]


def _view(engine, adapter: str | None):
    """The engine view rank 0's run decodes with: `adapter`'s, or the plain model's."""
    view = engine.with_adapter(adapter)
    return view if adapter else dataclasses.replace(view, adapter_choice="none")


def _build(engine, spec: mirror.RunSpec, caches: dict):
    kv = caches[spec.kv_from] if spec.kv_from is not None else None
    if kv is not None:   # as rank 0 left it: its run's commits past the answer and the unshared turns dropped
        kv.rollback(spec.kv_length)
    strategy = make_strategy(spec.strategy, spec.params)
    prepared = dataclasses.replace(prepare(engine, strategy, view=_view(engine, spec.adapter)), costs=spec.costs)
    return Run(prepared, spec.settings, spec.prompt_text, list(spec.prompt_ids), kv=kv)

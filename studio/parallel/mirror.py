"""Every rank's runs in step with rank 0's.

Rank 0 decides: the user's commands, the UIs and the server build and advance `Run`s there. Each Run it builds is
announced to the other ranks with everything that makes one (the adapter, the strategy and its parameters, the
settings, the prompt, the KV cache of the earlier run it continues, the cost table it plans with), and each advance
(with whether it was cancelled) follows. Every rank then runs the same strategy code on the same logits -- the
vocabulary is gathered whole on every rank and the sampler is seeded alike -- so acceptance, sampling and cache
commits come out the same everywhere without being sent. Only rank 0 writes traces and hands out events.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref

import torch.distributed as dist

from studio.parallel.group import Group, current, lost

_leader: "Leader | None" = None


def leader() -> "Leader | None":
    """Rank 0's Leader while this process leads a tensor-parallel group, else None."""
    return _leader


def following() -> bool:
    """Whether this process repeats rank 0's runs (a rank > 0)."""
    group = current()
    return group is not None and not group.main


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What a rank needs to build the Run rank 0 built."""
    adapter: str | None          # the run's engine's adapter path (None: the base model)
    strategy: str
    params: dict
    settings: object             # studio.run.session.Settings
    prompt_text: str
    prompt_ids: tuple[int, ...]
    kv_from: int | None          # the run whose KV cache this one continues (a chat's next turn)
    kv_length: int               # how much of that cache it keeps (rank 0 rolled it back to the shared prefix)
    costs: object                # the CostTable rank 0 plans with, or None


class Leader:
    """Rank 0's end: sends each message to every other rank (one broadcast), with the runs rank 0 has let go of."""

    def __init__(self, group: Group):
        self.group = group
        self._ids = itertools.count(1)
        self._gone: list[int] = []   # runs whose KV cache rank 0 dropped since the last message
        # held from a message through the collectives it starts (a step's forwards): a UI thread announcing a run
        # while a decode thread steps another must not interleave its broadcast with that step's all-reduces
        self.lock = threading.RLock()

    def send(self, *message) -> None:
        with self.lock:
            gone, self._gone = self._gone, []
            try:
                dist.broadcast_object_list([(gone, message)], src=0, group=self.group.pg)
            except Exception as e:   # gloo/NCCL raise RuntimeError subclasses, or DistError on a timeout
                raise lost(e) from None

    def announce(self, run, prompt_text: str, kv_from: int | None, costs) -> int:
        """Tell the other ranks to build `run`; its id, which its advances carry."""
        run_id = next(self._ids)
        spec = RunSpec(run.engine.adapter, run.strategy.name, dataclasses.asdict(run.strategy.params), run.settings,
                       prompt_text, tuple(run.prompt_ids), kv_from, run.ctx.kv.length, costs)
        self.send("run", run_id, spec)
        run.ctx.kv.mirror_id = run_id
        weakref.finalize(run.ctx.kv, self._gone.append, run_id)
        return run_id

    def stop(self) -> None:
        self.send("stop")


def lead(group: Group) -> Leader:
    global _leader
    _leader = Leader(group)
    return _leader


def stop_leading() -> None:
    global _leader
    if _leader is not None:
        try:
            _leader.stop()
        finally:
            _leader = None


def receive(group: Group) -> tuple[list[int], tuple]:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group.pg)
    return box[0]


def follow(engine, group: Group) -> None:
    """A rank > 0's loop: build and advance what rank 0 announces, until it says stop."""
    from studio.engine.cost_model import calibrate
    runs, caches = {}, {}
    while True:
        gone, message = receive(group)
        for run_id in gone:
            caches.pop(run_id, None)
        kind = message[0]
        if kind == "stop":
            return
        if kind == "calibrate":
            calibrate(_view(engine, message[1]))
        elif kind == "score":   # a text scored by one forward (Engine.score_logits)
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


def _build(engine, spec: RunSpec, caches: dict):
    from studio.engine.strategies import make_strategy
    from studio.run.session import Run
    kv = caches[spec.kv_from] if spec.kv_from is not None else None
    if kv is not None:   # as rank 0 left it: its run's commits past the answer and the unshared turns dropped
        kv.rollback(spec.kv_length)
    run = Run(_view(engine, spec.adapter), make_strategy(spec.strategy, spec.params), spec.settings,
              spec.prompt_text, list(spec.prompt_ids), kv=kv)
    run.ctx.costs = spec.costs or run.ctx.costs
    return run

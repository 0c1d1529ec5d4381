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

from studio.run.group import Group, current, lost

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


def score_logits(engine, ids: list[int], rows: list[int], gated: bool):
    """`engine.forward_rows`: float logits of one forward over `ids` (lm-eval's log-likelihoods). Under tensor
    parallelism rank 0 has every rank run the same forward."""
    lead_ = leader()
    if lead_ is None:
        return engine.forward_rows(ids, rows, gated)
    with lead_.lock:   # the message and the forward's collectives together
        lead_.send("score", engine.adapter, list(ids), list(rows), gated)
        return engine.forward_rows(ids, rows, gated)

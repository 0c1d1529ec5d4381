"""The process group: one per process, made by `join` (a rank of a `launch`, or of `torchrun`).

Rank 0 is the process the user started: it decides what runs and shows everything. The others (`launch` spawns
them on this machine; `torchrun` starts them anywhere) build the same engine, keep their shard of it and follow
rank 0 (studio.run.mirror). Every collective has `timeout_s`: a rank that dies ends the others with an error
instead of a hang.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from studio.errors import BadInput, RankLost

TIMEOUT_S = 60.0   # a collective waits this long for a rank that has stopped answering


@dataclass(frozen=True)
class Group:
    rank: int
    world: int
    pg: object   # the torch.distributed process group

    @property
    def main(self) -> bool:
        return self.rank == 0


_current: Group | None = None


def current() -> Group | None:
    """This process's group, None when it decodes alone."""
    return _current


def join(rank: int, world: int, address: str = "127.0.0.1", port: int | None = None, device: str = "cpu",
         timeout_s: float = TIMEOUT_S) -> Group:
    """Join the group of `world` ranks as `rank` (the rendezvous at address:port; None: MASTER_ADDR/MASTER_PORT as
    torchrun sets them). gloo on the CPU, NCCL on CUDA."""
    global _current
    if _current is not None:
        raise RuntimeError("this process is already in a process group")
    if port is not None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":   # one GPU per rank on each machine
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    _current = Group(rank, world, dist.group.WORLD)
    return _current


def leave() -> None:
    global _current
    if _current is not None:
        try:
            dist.destroy_process_group()
        finally:
            _current = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_world(tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise BadInput(f"--tp must be a whole number >= 1, got {tp!r}")
    if tp > 1 and not dist.is_available():
        raise BadInput("--tp needs torch.distributed, which this torch build lacks")


def torchrun_world() -> int:
    """The world size torchrun launched this process in (RANK and WORLD_SIZE set), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def threads_per_rank(world: int) -> int:
    """Each of `world` ranks on this machine gets its share of the cores: oversubscribed threads spin against
    each other."""
    from studio.engine.device import available_cores
    return max(1, available_cores() // world)


def lost(error: BaseException) -> RankLost:
    """The one-line error a failed collective becomes on rank 0."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return RankLost(f"a rank of the tensor-parallel group stopped answering ({first[:160]})")


def set_threads(world: int) -> None:
    torch.set_num_threads(threads_per_rank(world))

"""Where a model runs and in what precision: the `--device` / `--dtype` choices of every generation command."""
from __future__ import annotations

import os

import torch

from studio.errors import BadInput

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` = CUDA when available, else the CPU. BadInput for `cuda` on a machine without it."""
    if name not in DEVICES:
        raise BadInput(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is available (torch sees none); use --device cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` = bf16 on CUDA, fp32 on the CPU (docs/architecture.md#devices-graphs-kernels)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise BadInput(f"--dtype must be one of auto, {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`, so a wall-clock reading covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_threads() -> int:
    """OMP_NUM_THREADS when the user set it, else the cores this process may run on (taskset), not all of the
    machine's: threads beyond the cores free to run them spin against each other (on a 2-core machine with one core
    busy, two threads made a forward ~5x slower than one)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return available_cores()


def available_cores() -> int:
    """The cores this process may run on (taskset), not all of the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

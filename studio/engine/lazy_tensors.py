"""Checkpoint tensors read when needed, and only the part needed.

A tensor- or expert-parallel rank keeps a slice of most weights (studio.engine.tensor_parallel): reading every safetensors
file whole on every rank would take the whole model's memory on each. `open_safetensors` gives each tensor of a file
as a `Lazy`: its shape, and slicing (all that a family's renaming and a shard plan do to a tensor: the rows of a fused
QKV, a rank's heads, columns, vocabulary or experts) narrows a window without reading anything. `read()` reads that
window alone (safetensors' `get_slice` on a memory map of the file). `stack` stacks per-expert tensors the same way,
so a rank that holds some of the experts reads only theirs.
"""
from __future__ import annotations

from pathlib import Path

import torch

from studio.errors import BadInput, one_line
from studio.interrupts import uninterruptible


def _corrupt(path: Path, e: BaseException) -> BadInput:
    return BadInput(f"corrupt safetensors file {path}: {one_line(e)}")


def _errors():
    from safetensors import SafetensorError
    return SafetensorError, OSError, ValueError, RuntimeError, TypeError


@uninterruptible   # safetensors turns an interrupt in the torch calls it makes into a ValueError ("corrupt")
def open_safetensors(path: Path) -> dict[str, "Lazy"]:
    """Every tensor of the file at `path`, unread."""
    from safetensors import safe_open
    try:
        handle = safe_open(str(path), "pt")
        return {name: Lazy(handle, path, name, tuple(handle.get_slice(name).get_shape())) for name in handle.keys()}
    except _errors() as e:
        raise _corrupt(path, e) from None


class Lazy:
    """A window (one slice per dimension) of tensor `name` in a safetensors file, unread."""

    def __init__(self, handle, path: Path, name: str, shape: tuple[int, ...], window: tuple[slice, ...] | None = None):
        self.handle, self.path, self.name = handle, path, name
        self.window = window if window is not None else tuple(slice(0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(w.stop - w.start for w in self.window)

    def dim(self) -> int:
        return len(self.window)

    def __getitem__(self, key) -> "Lazy":
        return Lazy(self.handle, self.path, self.name, (), _narrow(self.window, key))

    def chunk(self, n: int, dim: int = 0) -> list["Lazy"]:
        """torch.chunk's parts along `dim` (each ceil(size / n) long, the last what is left)."""
        size = self.shape[dim]
        step = -(-size // n)
        lead = (slice(None),) * dim
        return [self[lead + (slice(i, min(i + step, size)),)] for i in range(0, size, step)]

    @uninterruptible   # as open_safetensors
    def read(self) -> torch.Tensor:
        try:
            if self.shape == tuple(self.handle.get_slice(self.name).get_shape()):
                return self.handle.get_tensor(self.name)
            return self.handle.get_slice(self.name)[self.window]
        except _errors() as e:
            raise _corrupt(self.path, e) from None


class LazyStack:
    """Tensors of one shape stacked along a new first dimension, unread: slicing that dimension picks tensors, the
    others slice each of them."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.parts), *self.parts[0].shape))

    def dim(self) -> int:
        return 1 + self.parts[0].dim()

    def __getitem__(self, key) -> "LazyStack":
        key = key if isinstance(key, tuple) else (key,)
        picked = self.parts[_narrow((slice(0, len(self.parts)),), key[:1])[0]]
        return LazyStack([p[key[1:]] if key[1:] else p for p in picked])

    def read(self) -> torch.Tensor:
        return torch.stack([read(p) for p in self.parts])


def stack(tensors: list):
    """torch.stack, deferred when the tensors are unread."""
    if all(isinstance(t, (Lazy, LazyStack)) for t in tensors):
        return LazyStack(list(tensors))
    return torch.stack([read(t) for t in tensors])


def read(t) -> torch.Tensor:
    """The tensor, read if it is not yet."""
    return t.read() if isinstance(t, (Lazy, LazyStack)) else t


def _narrow(window: tuple[slice, ...], key) -> tuple[slice, ...]:
    """`window` narrowed by `key` (a slice, or a tuple of slices for the first dimensions; steps of 1 only)."""
    key = key if isinstance(key, tuple) else (key,)
    if len(key) > len(window) or not all(isinstance(k, slice) for k in key):
        raise TypeError(f"a lazy tensor takes at most {len(window)} slices, got {key!r}")
    out = list(window)
    for i, k in enumerate(key):
        start, stop, step = k.indices(window[i].stop - window[i].start)
        if step != 1:
            raise TypeError("a lazy tensor takes slices with a step of 1")
        out[i] = slice(window[i].start + start, window[i].start + max(start, stop))
    return tuple(out)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, read whole (adapters, datasets, optimizer state: small files)."""
    return {name: tensor.read() for name, tensor in open_safetensors(path).items()}

"""The decode step through `torch.compile` (inductor), the plain step its oracle (docs/architecture.md#cpu-projections).

`compile_step` compiles a model's forward proper, `Transformer.run` (what `graphs.GraphRunner` captures): the new
rows T and the KV length become symbols once they change, so a run compiles a few graphs (one per layout it meets:
one row, several rows with a mask, a gate, a prefill), not one per step. `plain_step` lends the eager forward for a
while.

The CPU projections call our C kernels through ctypes and read oneDNN's packed weights, which dynamo cannot trace:
under compile their callers run as torch custom ops (`opaque_to_compile`), one node each in the graph. With
`torch.compiler.disable` around them instead, the graph broke at every projection (~120 breaks a step) and the
embedded model's 1-token step took ~1.7x the eager one's time; with the ops, 0.8-0.97x (docs/architecture.md).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

from studio.engine.kv_cache import KVCache

# Graphs one compiled step may hold before dynamo runs further layouts eagerly: each layout a run meets compiles with
# the sizes it first met, then once or twice more as its row count and KV length become symbols; dynamo's default 8
# is spent by a comparison of a few strategies
RECOMPILE_LIMIT = 64


def compile_step(model: torch.nn.Module) -> None:
    """Compile `model.run` in place (an instance attribute over the class's method). The first forward of each
    new layout compiles (seconds to tens of seconds on a small CPU); nothing is printed here."""
    if "run" not in model.__dict__:   # compiled already
        model.run = functools.partial(_run, torch.compile(model.run, backend="inductor",
                                                          recompile_limit=RECOMPILE_LIMIT))


def _run(compiled, tokens, positions, kv, *rest):
    """`Transformer.run`'s signature; a KVCache's stores through `_StoresInPlace`."""
    return compiled(tokens, positions, _StoresInPlace(kv) if type(kv) is KVCache else kv, *rest)


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether `model`'s step is compiled (`compile_step`)."""
    return "run" in model.__dict__


@contextlib.contextmanager
def plain_step(model: torch.nn.Module):
    """The model with its eager forward for a while: the compiled step's oracle, and what `bench forwards` times
    it against."""
    compiled = model.__dict__.pop("run", None)
    try:
        yield model
    finally:
        if compiled is not None:
            model.run = compiled


class _StoresInPlace:
    """A KVCache as the compiled step sees it: `KVCache.write`, each store one op, which inductor does in place.
    Traced as written, a store into the stacked [layers, ...] cache that the layer then reads was functionalised into
    a copy of the whole cache per layer: the embedded model's step ran 3x slower than eager. (The other caches --
    a layered one, a window, a graph's slot view -- are traced as they are written: correct, not as fast.)"""

    def __init__(self, kv: KVCache):
        self.kv = kv

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv, end = self.kv, self.kv.length + k.shape[2]
        _store(kv.k, layer, kv.length, k)
        _store(kv.v, layer, kv.length, v)
        return kv.k[layer, :, :, :end], kv.v[layer, :, :, :end]


def opaque_to_compile(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()):
    """Decorate `fn` (fully annotated: its schema is read from them) so that under torch.compile it runs as the custom
    op `studio::<name>` -- one node in the graph, `fake` giving its output's shape -- and eagerly as itself: the
    op's dispatch costs microseconds, hundreds of times a step."""
    def wrap(fn):
        op = torch.library.custom_op(f"studio::{name}", fn, mutates_args=mutates_args)
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)
        return call
    return wrap


@opaque_to_compile("kv_store", fake=lambda cache, layer, start, new: None, mutates_args=("cache",))
def _store(cache: torch.Tensor, layer: int, start: int, new: torch.Tensor) -> None:
    cache[layer, :, :, start:start + new.shape[2]] = new

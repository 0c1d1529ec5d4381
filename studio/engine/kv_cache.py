"""Static KV cache: one allocation, explicit slots, commit/rollback move a length (gpt-fast style).

A forward writes its T new keys/values at slots [length, length + T). Nothing is kept until the
strategy commits: `commit(n)` keeps the first n written slots, `keep(rows)` keeps an arbitrary
subset (copied to be contiguous), `rollback(to_len)` forgets committed tokens. Stale slots past
`length` are masked out by every later forward and then overwritten, so no zeroing ever happens.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype=torch.float32, device="cpu", batch: int = 1):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0    # committed slots [0, length)
        self.written = 0   # slots the last forward wrote past `length`
        self.runner = None  # the GraphRunner whose graphs read this storage (it stays with the cache)

    def grown(self, max_len: int) -> "KVCache":
        """A cache of `max_len` slots holding the same committed prefix (a chat outgrowing its cache)."""
        n_layers, batch, n_kv, _, head_dim = self.k.shape
        new = KVCache(n_layers, n_kv, head_dim, max_len, self.k.dtype, self.k.device, batch)
        new.k[:, :, :, :self.length] = self.k[:, :, :, :self.length]
        new.v[:, :, :, :self.length] = self.v[:, :, :, :self.length]
        new.length = self.length
        return new

    @classmethod
    def stacked(cls, caches: list["KVCache"], max_len: int) -> "KVCache":
        """One cache of `max_len` slots holding the batch rows of `caches` in order (a sequence joins a batch)."""
        n_layers, _, n_kv, _, head_dim = caches[0].k.shape
        new = cls(n_layers, n_kv, head_dim, max_len, caches[0].k.dtype, caches[0].k.device,
                  sum(c.k.shape[1] for c in caches))
        at = 0
        for c in caches:
            rows, n = slice(at, at + c.k.shape[1]), min(c.max_len, max_len)
            new.k[:, rows, :, :n] = c.k[:, :, :, :n]
            new.v[:, rows, :, :n] = c.v[:, :, :, :n]
            at = rows.stop
        return new

    def select_batch(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (finished sequences leave a stationary batch)."""
        self.k = self.k[:, rows].contiguous()
        self.v = self.v[:, rows].contiguous()

    def begin(self, n_new: int) -> None:
        """Reserve slots [length, length + n_new) for the forward about to run."""
        if self.length + n_new > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {n_new} > {self.max_len}")
        self.written = n_new

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, H_kv, T, D] for `layer`; return the keys/values visible to this forward."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def commit(self, n: int) -> tuple[int, int]:
        """Keep the first n slots written by the last forward. Returns (from_len, to_len)."""
        if not 0 <= n <= self.written:
            raise ValueError(f"cannot commit {n} of {self.written} written slots")
        old = self.length
        self.length += n
        self.written = 0
        return old, self.length

    def keep(self, rows: list[int]) -> tuple[int, int]:
        """Keep written slots at offsets `rows` (ascending), moved to be contiguous after `length`."""
        if any(not 0 <= r < self.written for r in rows) or rows != sorted(set(rows)):
            raise ValueError(f"bad rows to keep: {rows} of {self.written}")
        if rows != list(range(len(rows))):
            src = torch.tensor(rows, device=self.k.device) + self.length
            dst = slice(self.length, self.length + len(rows))
            self.k[:, :, :, dst] = self.k[:, :, :, src]
            self.v[:, :, :, dst] = self.v[:, :, :, src]
        self.written = len(rows)
        return self.commit(len(rows))

    def rollback(self, to_len: int) -> tuple[int, int]:
        """Forget committed slots past `to_len`."""
        if not 0 <= to_len <= self.length:
            raise ValueError(f"cannot roll back from {self.length} to {to_len}")
        old = self.length
        self.length = to_len
        self.written = 0
        return old, to_len


class WindowWrite:
    """The committed cache with its slots [start, start + T) rewritten by a forward that attends over every committed
    slot: Fast-dLLM's dual cache, the open block's K/V fresh and the prefix and the suffix as cached. The caller's
    mask is [T, kv.length]."""

    def __init__(self, kv: KVCache, start: int):
        self.kv, self.start, self.length = kv, start, kv.length

    def begin(self, n_new: int) -> None:
        if self.start + n_new > self.kv.length:
            raise ValueError(f"window [{self.start}, {self.start + n_new}) past the committed {self.kv.length} slots")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.start + k.shape[2]
        self.kv.k[layer, :, :, self.start:end] = k
        self.kv.v[layer, :, :, self.start:end] = v
        return self.kv.k[layer, :, :, :self.kv.length], self.kv.v[layer, :, :, :self.kv.length]


class SlotView:
    """A KVCache seen through fixed shapes, as a CUDA graph needs them: a forward writes its new K/V at
    the slots held in the device tensor `slots` and attends over the first `n_visible` slots (a fixed
    bucket, whose stale and unwritten slots the caller's mask hides). `slots` [T]: the same slots for
    every batch row (the cache's own lengths are the caller's business: it still calls `begin` and
    `commit`); [B, T]: each sequence of a batch writes at its own slots (studio.engine.batch, which
    keeps one length per sequence itself)."""

    def __init__(self, kv: KVCache, slots: torch.Tensor, n_visible: int):
        self.kv, self.slots, self.n_visible = kv, slots, n_visible

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kv.k[layer], self.kv.v[layer]
        if self.slots.dim() == 1:
            keys.index_copy_(2, self.slots, k)
            values.index_copy_(2, self.slots, v)
        else:
            at = self.slots[:, None, :, None].expand_as(k)   # [B, H_kv, T, D]: sequence b, row t -> slots[b, t]
            keys.scatter_(2, at, k)
            values.scatter_(2, at, v)
        return keys[:, :, :self.n_visible], values[:, :, :self.n_visible]


class LayeredKVCache:
    """Layers whose K/V differ in shape (Gemma's sliding layers: 8 heads of 256; its full layers: 2 of 512): one
    KVCache per geometry, whose lengths move together -- the same begin/write/commit/keep/rollback as a KVCache."""

    def __init__(self, geometry: list[tuple[int, int]], max_len: int, dtype=torch.float32, device="cpu",
                 batch: int = 1):
        kinds = sorted(set(geometry))
        self.at = [(kinds.index(g), geometry[:i].count(g)) for i, g in enumerate(geometry)]   # layer -> (group, index)
        self.groups = [KVCache(geometry.count(g), g[0], g[1], max_len, dtype, device, batch) for g in kinds]
        self.geometry = geometry
        self.runner = None

    max_len = property(lambda self: self.groups[0].max_len)
    length = property(lambda self: self.groups[0].length)
    written = property(lambda self: self.groups[0].written)

    def grown(self, max_len: int) -> "LayeredKVCache":
        new = LayeredKVCache.__new__(LayeredKVCache)
        new.at, new.geometry, new.runner = self.at, self.geometry, None
        new.groups = [g.grown(max_len) for g in self.groups]
        return new

    @classmethod
    def stacked(cls, caches: list["LayeredKVCache"], max_len: int) -> "LayeredKVCache":
        new = cls.__new__(cls)
        new.at, new.geometry, new.runner = caches[0].at, caches[0].geometry, None
        new.groups = [KVCache.stacked([c.groups[i] for c in caches], max_len) for i in range(len(caches[0].groups))]
        return new

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group, index = self.at[layer]
        return self.groups[group].write(index, k, v)

    def _all(self, op: str, *args):
        return [getattr(g, op)(*args) for g in self.groups][0]

    def select_batch(self, rows): self._all("select_batch", rows)
    def begin(self, n_new): self._all("begin", n_new)
    def commit(self, n): return self._all("commit", n)
    def keep(self, rows): return self._all("keep", rows)
    def rollback(self, to_len): return self._all("rollback", to_len)


def new_cache(geometry: list[tuple[int, int]], max_len: int, dtype=torch.float32, device="cpu",
              batch: int = 1) -> KVCache | LayeredKVCache:
    """The cache for layers of (K/V heads, head size) `geometry`: one KVCache when every layer has the same."""
    if len(set(geometry)) == 1:
        return KVCache(len(geometry), *geometry[0], max_len, dtype=dtype, device=device, batch=batch)
    return LayeredKVCache(geometry, max_len, dtype, device, batch)

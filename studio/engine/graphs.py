"""CUDA-graph runner for the extend forward (the nano-vllm / gpt-fast pattern).

A small model decoding on a GPU is launch-bound: one forward is hundreds of tiny kernels. A CUDA graph
records them once and relaunches them all at once. A graph fixes every shape and address, so one is
captured per key -- (new tokens T, KV bucket, LoRA gated, adapter) -- on static buffers: tokens,
positions, the KV slots to write, a bool mask [T, bucket] and a 0/1 LoRA row gate. It attends over the
first `bucket` KV slots (the smallest bucket that holds the committed length + T); the mask hides the
stale and unwritten ones. A replay copies every input into its buffer, every time, and relaunches. All
graphs share one memory pool. Anything else -- prefill-sized extends, batches, 4-D or float masks,
another cache -- runs the eager forward.

On CPU there are no CUDA graphs: the runner "captures" by recording the callable and replays it on the
same static buffers, so the CPU tests check the buffer discipline of the real thing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from studio.engine.kv_cache import KVCache, SlotView
from studio.engine.gated_lora import RowGate
from studio.engine.model import Transformer


def kv_buckets(max_len: int, smallest: int = 64) -> list[int]:
    """Powers of two from `smallest`, then the cache size: past the smallest bucket, attention reads
    fewer than twice the keys it needs."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


class CachePool:
    """Decode caches lent to runs and taken back, each keeping its GraphRunner (`KVCache.runner`), so the
    graphs one run captured replay in the next: a capture is a warm-up forward plus a recording, and
    would otherwise land on every run's clock (a bench's timed runs included). Sizes are powers of two
    (capped at the model's context), so runs of similar lengths share caches. Used when graphs are on; one
    pool per engine, whose views share one model."""

    def __init__(self, keep: int = 4):
        self.keep = keep                             # caches kept per size; more are left to the GC
        self.free: dict[int, list[KVCache]] = {}

    @staticmethod
    def size_for(model: Transformer, kv_len: int) -> int:
        """The slots of a cache for `kv_len`: the next power of two, at most the model's context."""
        return max(kv_len, min(1 << (kv_len - 1).bit_length(), model.config.max_seq_len))

    def lend(self, model: Transformer, kv_len: int) -> KVCache:
        """An empty cache of at least `kv_len` slots on `model`'s device."""
        size = self.size_for(model, kv_len)
        free = self.free.get(size)
        if free:
            kv = free.pop()
            kv.rollback(0)
            return kv
        return model.new_cache(size)

    def give_back(self, kv: KVCache) -> None:
        free = self.free.setdefault(kv.max_len, [])
        if len(free) < self.keep:
            free.append(kv)


class _Recorded:
    """The CPU stand-in for a captured torch.cuda.CUDAGraph: `replay` reruns the recorded callable on
    the same static buffers and writes into the same output tensor."""

    def __init__(self, fn):
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        self.out.copy_(self.fn())


@dataclass
class _Graph:
    tokens: torch.Tensor          # [1, T] long
    positions: torch.Tensor       # [1, T] long
    slots: torch.Tensor           # [T] long: the KV slots this forward writes
    mask: torch.Tensor            # [T, bucket] bool
    gate: torch.Tensor | None     # [1, T] 0/1 in the model dtype (gated graphs only)
    adapter: object               # the adapter baked in, held so its id() stays unique
    graph: object = None          # has .replay()
    out: torch.Tensor | None = None   # [1, T, V] float logits, rewritten by every replay


class GraphRunner:
    """`Transformer.forward` for one cache, through captured graphs where the shape allows.

    Extends of up to `max_tokens` tokens are captured on first sight (or up front with `capture`);
    longer ones (prefills) run eagerly. `buckets`: the KV lengths attention reads (default
    `kv_buckets`). `enabled=False` runs everything eagerly (--no-graphs). Graphs bake in the weights,
    the adapter's tensors and this cache's storage: an adapter switched by `lora.install` gets graphs
    of its own and a new embedding table (an adapter's MASK row) drops them all; any other swap of
    weight tensors needs `reset()`.
    """

    def __init__(self, model: Transformer, kv: KVCache, max_tokens: int = 16, buckets: list[int] | None = None,
                 enabled: bool = True):
        self.model, self.kv, self.max_tokens, self.enabled = model, kv, max_tokens, enabled
        self.buckets = sorted(buckets) if buckets else kv_buckets(kv.max_len)
        if self.buckets[-1] > kv.max_len:
            raise ValueError(f"KV bucket {self.buckets[-1]} exceeds the cache ({kv.max_len} slots)")
        p = model.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.pool = torch.cuda.graph_pool_handle() if p.is_cuda else None
        self.cols = torch.arange(self.buckets[-1], device=self.device)   # KV slot index, for causal masks
        self.graphs: dict[tuple, _Graph] = {}
        self.replays = self.fallbacks = 0
        self.reset()

    def reset(self) -> None:
        """Drop every graph (they are recaptured on demand)."""
        self.graphs.clear()
        self._tables = self._current_tables()

    def _current_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.model.embed_tokens.weight, self.model.lm_head.weight

    def _adapter(self):
        """The active adapter, part of every key. A new embedding table (an adapter's MASK row) first
        drops every graph: they read the old table's memory."""
        if any(a is not b for a, b in zip(self._tables, self._current_tables())):
            self.reset()
        return getattr(self.model, "active_adapter", None)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVCache, mask: torch.Tensor | None = None,
                lora_gate: torch.Tensor | None = None, logits_rows=None) -> torch.Tensor:
        """`Transformer.forward`'s contract: float logits [1, R, V] for `logits_rows` (all rows if None),
        the new K/V written at slots [kv.length, kv.length + T) for the caller to commit."""
        if not self._fits(tokens, kv, mask):
            self.fallbacks += 1
            return self.model(tokens, positions, kv, mask, lora_gate, logits_rows)
        T = tokens.shape[-1]
        kv.begin(T)
        adapter = self._adapter()
        gated = lora_gate is not None and bool(lora_gate.any())
        bucket = next(b for b in self.buckets if b >= kv.length + T)
        key = (T, bucket, gated, id(adapter))
        g = self.graphs.get(key) or self._capture(key, adapter)
        self._load(g, tokens, positions, mask, lora_gate)
        g.graph.replay()
        self.replays += 1
        if logits_rows is None:
            return g.out.clone()   # the next replay overwrites g.out
        return g.out[:, torch.as_tensor(logits_rows, device=self.device)]

    def _fits(self, tokens: torch.Tensor, kv: KVCache, mask: torch.Tensor | None) -> bool:
        """Whether a graph can run this forward: batch 1 on this runner's cache, at most max_tokens new
        tokens within the largest bucket, no mask or a 2-D bool one."""
        T = tokens.shape[-1]
        return (self.enabled and kv is self.kv and tokens.numel() == T and kv.k.shape[1] == 1
                and T <= self.max_tokens and kv.length + T <= self.buckets[-1]
                and (mask is None or (mask.dim() == 2 and mask.dtype == torch.bool)))

    @torch.inference_mode()
    def capture(self, n_tokens: list[int], gated: tuple[bool, ...] = (False, True)) -> None:
        """Capture every bucket for these extend sizes now, so a timed run never pays for a capture."""
        adapter = self._adapter()
        for key in itertools.product(n_tokens, self.buckets, gated, [id(adapter)]):
            if key not in self.graphs:
                self._capture(key, adapter)

    def _capture(self, key: tuple, adapter) -> _Graph:
        """Static buffers for one key and the forward recorded on them. Recording runs the forward on
        harmless inputs (an all-visible mask, the next T slots, which nobody has committed); `_load`
        puts the real ones in before every replay."""
        T, bucket, gated, _ = key
        L = self.kv.length
        if L + T > self.kv.max_len:
            raise ValueError(f"cannot capture {T} tokens: {L} of {self.kv.max_len} KV slots are committed")
        dev = self.device
        slots = torch.arange(L, L + T, device=dev)
        g = _Graph(tokens=torch.zeros(1, T, dtype=torch.long, device=dev), positions=slots[None].clone(),
                   slots=slots, mask=torch.ones(T, bucket, dtype=torch.bool, device=dev),
                   gate=torch.ones(1, T, dtype=self.dtype, device=dev) if gated else None, adapter=adapter)
        view = SlotView(self.kv, g.slots, bucket)
        row_gate = RowGate(g.gate, dense=True) if gated else None

        def fn():
            return self.model.run(g.tokens, g.positions, view, g.mask, row_gate, None)

        g.graph, g.out = self._record(fn)
        self.graphs[key] = g
        return g

    def _record(self, fn):
        """(something to replay, its static output): a CUDA graph in the shared pool, or on CPU a recording."""
        if self.pool is None:
            rec = _Recorded(fn)
            return rec, rec.out
        # warm up on a side stream: lazy initialisation (cuBLAS handles, kernel choice) cannot be captured
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out

    def _load(self, g: _Graph, tokens, positions, mask, gate) -> None:
        """Copy this forward's inputs into the graph's buffers -- every one, every time."""
        L, T = self.kv.length, g.slots.shape[0]
        g.tokens.copy_(tokens.reshape(1, T))
        g.positions.copy_(positions.reshape(1, T))
        torch.arange(L, L + T, out=g.slots)
        if mask is None:   # causal; slots past L + T (stale or unwritten) are hidden
            torch.le(self.cols[:g.mask.shape[1]], g.slots[:, None], out=g.mask)
        else:
            g.mask[:, L + T:] = False
            g.mask[:, :L + T] = mask
        if g.gate is not None:
            g.gate.copy_(gate.reshape(1, T))

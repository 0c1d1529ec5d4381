"""CUDA-graph runner for the extend forward (the nano-vllm / gpt-fast pattern).

A small model decoding on a GPU is launch-bound: one forward is hundreds of tiny kernels. A CUDA graph
records them once and relaunches them all at once. A graph fixes every shape and address, so one is
captured per key -- (new tokens T, KV bucket, LoRA gated, adapter, logits rows R) -- on static buffers:
tokens, positions, the KV slots to write, a bool mask [T, bucket], a 0/1 LoRA row gate and the rows
whose logits it computes. It attends over the first `bucket` KV slots (the smallest bucket that holds
what the forward sees); the mask hides the stale and unwritten ones. A replay copies every input into
its buffer, every time, and relaunches. All graphs share one memory pool.

Two kinds of forward run through the same graphs, since both write T slots and attend over a bucket:
an extend (T new tokens after the committed K/V) and a window (`kv_cache.WindowWrite`: Fast-dLLM's dual
cache rewrites the open block's slots inside the committed canvas). A canvas forward is wide (the block,
or the prompt and the whole canvas); past `WIDE` rows a graph computes the logits of the rows asked for
alone, their count rounded up to a power of two (R), so a canvas that fills shrinks R through a few
graphs, never one per count. Anything else -- forwards wider than `max_tokens` (a causal run's prefill),
batches, 4-D or float masks, an embedding shift, another cache -- runs the eager forward.

On CPU there are no CUDA graphs: the runner "captures" by recording the callable and replays it on the
same static buffers, so the CPU tests check the buffer discipline of the real thing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from studio.engine.kv_cache import KVCache, SlotView, WindowWrite
from studio.engine.gated_lora import RowGate
from studio.engine.model import Transformer


# up to this many rows a graph computes every row's logits (and the caller picks); past it, only the rows asked for
WIDE = 16


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


def record(fn, pool, device: torch.device):
    """(something to replay, its static output): `fn` captured as a CUDA graph in `pool`, or on the CPU (no pool)
    a recording."""
    if pool is None:
        rec = _Recorded(fn)
        return rec, rec.out
    # warm up on a side stream: lazy initialisation (cuBLAS handles, kernel choice) cannot be captured
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@dataclass
class _Graph:
    tokens: torch.Tensor          # [1, T] long
    positions: torch.Tensor       # [1, T] long
    slots: torch.Tensor           # [T] long: the KV slots this forward writes
    mask: torch.Tensor            # [T, bucket] bool
    gate: torch.Tensor | None     # [1, T] 0/1 in the model dtype (gated graphs only)
    rows: torch.Tensor | None     # [R] long: the rows whose logits it computes (None: every row)
    adapter: object               # the adapter baked in, held so its id() stays unique
    graph: object = None          # has .replay()
    out: torch.Tensor | None = None   # [1, T or R, V] float logits, rewritten by every replay


class GraphRunner:
    """`Transformer.forward` for one cache, through captured graphs where the shape allows.

    Forwards of up to `max_tokens` tokens (None: any that fits the largest bucket, as a canvas run asks)
    are captured on first sight (or up front with `capture`); wider ones (prefills) run eagerly. `buckets`:
    the KV lengths attention reads (default `kv_buckets`). `enabled=False` runs everything eagerly
    (--no-graphs). Graphs bake in the weights, the adapter's tensors and this cache's storage: an adapter
    switched by `lora.install` gets graphs of its own and a new embedding table (an adapter's MASK row)
    drops them all; any other swap of weight tensors needs `reset()`.
    """

    def __init__(self, model: Transformer, kv: KVCache, max_tokens: int | None = WIDE, buckets: list[int] | None = None,
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
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVCache | WindowWrite,
                mask: torch.Tensor | None = None, lora_gate: torch.Tensor | None = None,
                logits_rows=None) -> torch.Tensor:
        """`Transformer.forward`'s contract: float logits [1, R, V] for `logits_rows` (all rows if None),
        the new K/V written at slots [kv.length, kv.length + T) for the caller to commit (a window: at
        the window's slots, over the committed ones)."""
        span = self._span(tokens, kv, mask)
        if span is None:
            self.fallbacks += 1
            return self.model(tokens, positions, kv, mask, lora_gate, logits_rows)
        start, visible = span
        T = tokens.shape[-1]
        kv.begin(T)
        adapter = self._adapter()
        gated = lora_gate is not None and bool(lora_gate.any())
        bucket = next(b for b in self.buckets if b >= visible)
        wanted = None if logits_rows is None else torch.as_tensor(logits_rows, device=self.device).reshape(-1)
        R = None if wanted is None or T <= WIDE else 1 << (len(wanted) - 1).bit_length()
        key = (T, bucket, gated, id(adapter), R)
        g = self.graphs.get(key) or self._capture(key, adapter, start)
        self._load(g, tokens, positions, mask, lora_gate, start, visible, wanted)
        g.graph.replay()
        self.replays += 1
        if R is not None:
            return g.out[:, :len(wanted)].clone()   # the next replay overwrites g.out
        if wanted is None:
            return g.out.clone()
        return g.out[:, wanted]

    def _span(self, tokens: torch.Tensor, kv, mask: torch.Tensor | None) -> tuple[int, int] | None:
        """(first slot written, slots visible) of a forward a graph can run, else None: batch 1 on this
        runner's cache (an extend, or a window over it with its mask), at most max_tokens new tokens
        within the largest bucket, no mask or a 2-D bool one."""
        T = tokens.shape[-1]
        if kv is self.kv:
            span = kv.length, kv.length + T
        elif isinstance(kv, WindowWrite) and kv.kv is self.kv and mask is not None:
            span = kv.start, kv.length
        else:
            return None
        fits = (self.enabled and tokens.numel() == T and self.kv.k.shape[1] == 1
                and (self.max_tokens is None or T <= self.max_tokens) and span[1] <= self.buckets[-1]
                and (mask is None or (mask.dim() == 2 and mask.dtype == torch.bool)))
        return span if fits else None

    @torch.inference_mode()
    def capture(self, n_tokens: list[int], gated: tuple[bool, ...] = (False, True)) -> None:
        """Capture every bucket for these extend sizes now, so a timed run never pays for a capture."""
        adapter = self._adapter()
        for key in itertools.product(n_tokens, self.buckets, gated, [id(adapter)], [None]):
            if key not in self.graphs:
                self._capture(key, adapter, self.kv.length)

    def _capture(self, key: tuple, adapter, start: int) -> _Graph:
        """Static buffers for one key and the forward recorded on them. Recording runs the forward on
        harmless inputs (an all-visible mask, the T slots the forward itself is about to write, which
        its replay overwrites); `_load` puts the real ones in before every replay."""
        T, bucket, gated, _, R = key
        if start + T > self.kv.max_len:
            raise ValueError(f"cannot capture {T} tokens at slot {start} of {self.kv.max_len}")
        dev = self.device
        slots = torch.arange(start, start + T, device=dev)
        g = _Graph(tokens=torch.zeros(1, T, dtype=torch.long, device=dev), positions=slots[None].clone(),
                   slots=slots, mask=torch.ones(T, bucket, dtype=torch.bool, device=dev),
                   gate=torch.ones(1, T, dtype=self.dtype, device=dev) if gated else None,
                   rows=None if R is None else torch.zeros(R, dtype=torch.long, device=dev), adapter=adapter)
        view = SlotView(self.kv, g.slots, bucket)
        row_gate = RowGate(g.gate, dense=True) if gated else None

        def fn():
            return self.model.run(g.tokens, g.positions, view, g.mask, row_gate, g.rows)

        g.graph, g.out = record(fn, self.pool, self.device)
        self.graphs[key] = g
        return g

    def _load(self, g: _Graph, tokens, positions, mask, gate, start: int, visible: int, wanted) -> None:
        """Copy this forward's inputs into the graph's buffers -- every one, every time."""
        T = g.slots.shape[0]
        g.tokens.copy_(tokens.reshape(1, T))
        g.positions.copy_(positions.reshape(1, T))
        torch.arange(start, start + T, out=g.slots)
        if mask is None:   # causal; slots past the forward's own (stale or unwritten) are hidden
            torch.le(self.cols[:g.mask.shape[1]], g.slots[:, None], out=g.mask)
        else:
            g.mask[:, visible:] = False
            g.mask[:, :visible] = mask
        if g.gate is not None:
            g.gate.copy_(gate.reshape(1, T))
        if g.rows is not None:   # the rows asked for, then the last one again up to R
            g.rows[:len(wanted)] = wanted
            g.rows[len(wanted):] = wanted[-1]


class PassGraphs:
    """Graphs of a canvas pass whose shapes are all fixed while the committed length is: DiffusionGemma's decoder pass
    (`strategies.gemma_canvas`) takes up to `max_denoising_steps` passes over one canvas of C tokens, each reading
    the same committed K/V and writing the canvas's own past it, never committed. One graph per committed length is
    captured at a canvas's first pass through here and replayed for the rest of that canvas; the next canvas (a
    longer committed length) drops it, since it never replays again. `fn(tokens, positions, kv, extra)` -> logits
    is the eager pass on one cache; its K/V slots and masks are baked in from the committed length, which the key
    holds, and `extra` (the self-conditioning logits) is an input like the tokens."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device = fn, device
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[tuple, tuple] = {}
        self.replays = 0

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv, extra: torch.Tensor) -> torch.Tensor:
        key = (kv.length, tuple(tokens.shape), tuple(extra.shape))
        if key not in self.graphs:
            self.graphs.clear()
            inputs = [t.clone() for t in (tokens, positions, extra)]
            graph, out = record(lambda: self.fn(*inputs[:2], kv, inputs[2]), self.pool, self.device)
            self.graphs[key] = inputs, graph, out
        inputs, graph, out = self.graphs[key]
        for buffer, value in zip(inputs, (tokens, positions, extra)):
            buffer.copy_(value)
        kv.begin(tokens.shape[-1])   # the pass's Python side, which a replay skips
        graph.replay()
        self.replays += 1
        return out.clone()   # the next replay overwrites it

"""What a forward costs by its shape: the number a parallel decoder's TPF is divided by.

A strategy that commits k tokens per forward is only k times faster than `ar` if its wide forward
costs what a one-token step costs. `measure_forwards` times the shapes the strategies use -- a 1-token
step, a 2N-1 = 7-token extend (ISD N=4), a 16-token extend, the 7-token extend with the LoRA gated on its
3 MASK rows (R-ISD), and a batch-8 step -- on one KV cache after a fixed context, round-robin so that
drifts of the machine hit every shape alike, and reports each median as a ratio to the 1-token step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from studio.engine.compiled import compile_step, is_compiled, plain_step
from studio.engine.device import synchronize
from studio.engine.engine import Engine
from studio.engine.graphs import GraphRunner
from studio.engine.kernels import runs_fused, verify_logits
from studio.engine.masks import causal
from studio.engine.model import Fused, fuse_projections, plain_projections
from studio.engine.moe import Experts, MoE, SwiGLU
from studio.engine.quantize import dequantized, is_quantized
from studio.engine.random_models import RANDOM_SOURCE, build_random
from studio.engine.sampling import Proposal, SamplingParams


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int            # new tokens per sequence
    batch: int = 1
    gated: int = 0         # trailing rows with the LoRA on (needs an adapter)


SHAPES = [Shape("1-token step", 1), Shape("7-token extend", 7), Shape("16-token extend", 16),
          Shape("7-token extend, LoRA on 3 MASK rows", 7, gated=3), Shape("batch-8 1-token step", 1, batch=8)]


@dataclass
class ForwardCost:
    shape: Shape
    ms: float              # median wall time of one forward
    ratio: float           # ms / the 1-token step's ms
    spread: float = 0.0    # the samples' interquartile range / their median: how steady the machine was

    @property
    def throughput_ratio(self) -> float:
        """Tokens per second over the 1-token step's (a batch step makes batch x tokens)."""
        return self.shape.tokens * self.shape.batch / self.ratio

    def to_dict(self) -> dict:
        return {"shape": self.shape.name, "tokens": self.shape.tokens, "batch": self.shape.batch,
                "gated_rows": self.shape.gated, "ms": round(self.ms, 3), "ratio": round(self.ratio, 3),
                "throughput_ratio": round(self.throughput_ratio, 3), "spread": round(self.spread, 3)}


def measure_forwards(engine: Engine, repeats: int = 20, warmup: int = 2, context: int = 200,
                     shapes: list[Shape] = SHAPES) -> list[ForwardCost]:
    """Median time of each shape's forward (every row's logits, as a verify reads them) after `context`
    tokens of KV. The gated shapes run when `engine` has an adapter; the others pass no gate, which is the
    plain model's forward whether or not an adapter is installed. Where the engine runs CUDA graphs, a
    sequence's forwards replay graphs as a run's do (captured in the warm-up), a batch's run eagerly."""
    shapes = [s for s in shapes if not s.gated or engine.lora is not None]
    engine.activate()
    model, device = engine.model, engine.model.lm_head.weight.device
    caches = {b: _filled_cache(engine, b, context) for b in {s.batch for s in shapes}}
    forward = {b: GraphRunner(model, kv, max_tokens=None).forward if engine.graphs and b == 1 else model
               for b, kv in caches.items()}
    times: dict[Shape, list[float]] = {s: [] for s in shapes}
    for i in range(warmup + repeats):
        for s in shapes:
            kv = caches[s.batch]
            tokens = _tokens(model, 1000, s.tokens, s.batch)
            positions = torch.arange(context, context + s.tokens, device=device).repeat(s.batch, 1)
            gate = None
            if s.gated:
                gate = torch.zeros(s.batch, s.tokens, dtype=torch.bool, device=device)
                gate[:, -s.gated:] = True
            mask = causal(s.tokens, context, device=device) if s.tokens > 1 else None
            synchronize(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                forward[s.batch](tokens, positions, kv, mask=mask, lora_gate=gate)
            synchronize(device)
            if i >= warmup:
                times[s].append(time.perf_counter() - t0)
    base = statistics.median(times[shapes[0]])
    return [ForwardCost(s, statistics.median(t) * 1e3, statistics.median(t) / base, _spread(t))
            for s, t in times.items()]


def _spread(samples: list[float]) -> float:
    """Interquartile range over the median (0 for fewer than 2 samples)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


def lora_overhead(costs: list[ForwardCost]) -> float | None:
    """A gated forward's time over the plain forward of the same shape (None when none was measured)."""
    by_shape = {(c.shape.tokens, c.shape.batch, c.shape.gated): c.ms for c in costs}
    for (tokens, batch, gated), ms in by_shape.items():
        if gated and (tokens, batch, 0) in by_shape:
            return ms / by_shape[tokens, batch, 0]
    return None


def _filled_cache(engine: Engine, batch: int, context: int):
    """A cache holding `context` committed tokens per sequence; forwards write after it and never commit."""
    model = engine.model
    kv = model.new_cache(context + 32, batch=batch)
    device = model.lm_head.weight.device
    with torch.inference_mode():
        model(_tokens(model, 100, context, batch), torch.arange(context, device=device).repeat(batch, 1), kv,
              logits_rows=[context - 1])
    kv.commit(context)
    return kv


def _tokens(model, start: int, n: int, batch: int) -> torch.Tensor:
    """Arbitrary in-vocabulary ids [batch, n] (a forward's cost does not depend on which)."""
    ids = torch.arange(start, start + n, device=model.lm_head.weight.device) % model.config.vocab_size
    return ids.repeat(batch, 1)


def _median_s(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn() in seconds (device synchronised around each call), after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def moe_vs_dense(engine: Engine, repeats: int = 50) -> float | None:
    """For a mixture-of-experts model: one token through its first MoE layer, over one token through a dense SwiGLU
    with the same active width (k experts + the shared one), same device and dtype. None for a dense model. The
    price of routing and grouping: a 1-token step should cost about what its active parameters cost."""
    layer = next((m for m in engine.model.modules() if isinstance(m, MoE)), None)
    if layer is None:
        return None
    cfg, p = engine.config, layer.gate.weight
    dense = SwiGLU(cfg.dim, cfg.n_experts_per_tok * cfg.moe_ffn_dim + cfg.moe_shared_ffn_dim,
                   cfg.hidden_act).to(p.device, p.dtype)
    x = torch.randn(1, 1, cfg.dim, device=p.device, dtype=p.dtype)
    with torch.inference_mode():
        return _median_s(lambda: layer(x), p.device, repeats) / _median_s(lambda: dense(x), p.device, repeats)


def moe_step_vs_dense(engine: Engine, repeats: int = 50, context: int = 200) -> float | None:
    """For a mixture-of-experts model: its 1-token step over the step of a dense model of its active width (each MoE
    layer's experts as one SwiGLU of k experts' width plus the shared expert's; attention, head and dtype the same),
    both after `context` tokens and, where the engine runs CUDA graphs, both replaying a graph. None for a dense
    model. What routing costs a whole step: on a bandwidth-bound engine, little more than the active weights'."""
    cfg = engine.config
    if not cfg.n_experts:
        return None
    p = engine.model.lm_head.weight
    dense_cfg = dataclasses.replace(cfg, n_experts=0, ffn_dim=cfg.n_experts_per_tok * cfg.moe_ffn_dim
                                    + cfg.moe_shared_ffn_dim, moe_shared_ffn_dim=0, first_dense_layers=0)
    dense = Engine(model=build_random(dense_cfg, p.device, p.dtype), tokenizer=engine.tokenizer, config=dense_cfg,
                   name=f"{engine.name} (dense, active width)", source=RANDOM_SOURCE, load_s=0.0, from_cache=False)
    dense.graphs = engine.graphs
    fuse_projections(dense.model)
    ms = [measure_forwards(e, repeats=repeats, context=context, shapes=SHAPES[:1])[0].ms for e in (engine, dense)]
    return ms[0] / ms[1]


def fused_vs_plain(engine: Engine, repeats: int = 50, context: int = 200) -> dict[str, float] | None:
    """The fused projections' forward time over the plain ones' (studio.engine.model.Fused): what fusing q/k/v and
    gate/up buys here. None for a model with nothing fused."""
    if not any(isinstance(m, Fused) for m in engine.model.modules()):
        return None
    return _against(engine, lambda: plain_projections(engine.model), repeats, context)


def int8_vs_float(engine: Engine, repeats: int = 50, context: int = 200) -> dict[str, float] | None:
    """An int8 model's forward time over the float model's (its dequantised twin: the same shapes and dtype as the
    float model, so the same time): what a quarter of the bytes buys here. None for a float model."""
    if not is_quantized(engine.model):
        return None
    twin = dequantized(engine.model)
    fuse_projections(twin)
    if is_compiled(engine.model):   # the weights' difference alone
        compile_step(twin)
    return _against(engine, lambda: contextlib.nullcontext(twin), repeats, context)


def compiled_vs_eager(engine: Engine, repeats: int = 50, context: int = 200) -> dict[str, float] | None:
    """The compiled step's forward time over the eager one's (studio.engine.compiled), both warm (the first round
    compiles): what inductor buys here. None for an engine whose step is not compiled."""
    if not is_compiled(engine.model):
        return None
    return _against(engine, lambda: plain_step(engine.model), repeats, context)


def _against(engine: Engine, other, repeats: int, context: int) -> dict[str, float]:
    """engine.model's forward time over the model `other()` lends (a context manager) for the 1-token step and the
    7-token extend, the two timed in alternation on one cache (the forwards never commit, so whose K/V it holds does
    not change their cost)."""
    model, device = engine.model, engine.model.lm_head.weight.device
    engine.activate()
    kv = _filled_cache(engine, 1, context)
    ratios = {}
    for s in SHAPES[:2]:
        tokens, positions = _tokens(model, 1000, s.tokens, 1), torch.arange(context, context + s.tokens, device=device)
        mask = causal(s.tokens, context, device=device) if s.tokens > 1 else None
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(repeats + 1):   # the first round warms both up
            for mine in (True, False):
                with contextlib.nullcontext(model) if mine else other() as m, torch.inference_mode():
                    synchronize(device)
                    t0 = time.perf_counter()
                    m(tokens, positions[None], kv, mask=mask)
                    synchronize(device)
                if i:
                    times[mine].append(time.perf_counter() - t0)
        ratios[s.name] = statistics.median(times[True]) / statistics.median(times[False])
    return ratios


def copy_bandwidth(device: torch.device, n_bytes: int = 512 * 2**20, repeats: int = 10) -> float:
    """The device's copy bandwidth in GB/s: bytes read plus bytes written by one large copy, per second --
    the ceiling a 1-token step, which reads every weight once, is measured against."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * n_bytes / _median_s(lambda: dst.copy_(src), device, repeats) / 1e9


def weight_bytes(engine: Engine) -> int:
    """Bytes a 1-token step streams: every weight once, but of a mixture only the k experts the token goes to
    (the rest stay in memory unread). Counted by storage: a tied head is a second Parameter viewing the embedding
    table's storage (after an adapter's MASK row has grown the table)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in engine.model.parameters()}
    cfg = engine.config
    for experts in (m for m in engine.model.modules() if isinstance(m, Experts)):
        for p in experts.parameters():   # unread: all but k of the E stacked experts
            storages[p.untyped_storage().data_ptr()] = p.nbytes * cfg.n_experts_per_tok // cfg.n_experts
    model = engine.model
    if model.head_scale is not None:   # a 1-byte head is read instead of the float one (a tied table: one row)
        storages[model.lm_head.weight.untyped_storage().data_ptr()] = model.head_quant.nbytes + model.head_scale.nbytes
    return sum(storages.values())


def verify_time(engine: Engine, rows: int = 7, repeats: int = 50) -> tuple[float, str]:
    """Seconds to verify a chain of `rows` sampled drafts (T = 1) against random logits of the model's vocabulary,
    and the path that ran: the fused Triton kernel where it runs, else the torch rules."""
    device = engine.model.lm_head.weight.device
    gen = torch.Generator(device=device).manual_seed(0)
    V = engine.config.vocab_size
    target = torch.randn(rows, V, device=device, generator=gen)
    draft = torch.randn(rows, V, device=device, generator=gen)
    drafts = torch.randint(V, (rows,), generator=gen, device=device).tolist()
    params = SamplingParams(temperature=1.0)
    seconds = _median_s(lambda: verify_logits(drafts, target, draft, Proposal.SAMPLED, params, gen), device, repeats)
    return seconds, "fused" if runs_fused(target) else "torch"

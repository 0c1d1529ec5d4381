"""A compact transformer for the Llama, Qwen2 and Qwen3 blocks (and the checkpoint families mapped onto them,
studio.engine.families), with a dense or mixture-of-experts feed-forward (studio.engine.moe). Its parts also build
DiffusionGemma's Gemma-4 layers (studio.engine.gemma); studio.engine.architectures says which model a config builds.

Parameter names follow Hugging Face Llama/Qwen exactly, so those checkpoints and PEFT adapters load without a
rename table (other families' names are mapped onto them). The forward takes explicit position ids (RoPE) separately from KV slots, an optional
attention mask over [committed KV | new tokens], a per-row LoRA gate, and the rows whose logits
are wanted: the vocab projection dominates a small model, so we never compute rows nobody reads.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from studio.engine.config import ModelConfig
from studio.engine.gated_lora import RowGate, add_gated_lora
from studio.engine.kernels.norm import add_rms_norm, rms_norm
from studio.engine.kernels.projection import linear, quant_linear, vocab_logits
from studio.engine.kv_cache import KVCache, new_cache
from studio.engine.masks import causal
from studio.engine.moe import ACTIVATIONS, MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[1]

    def after_add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add fused into the norm (`kernels.norm`)."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear composed of three parts: the base projection (`kernels.projection.linear`: the CPU's decode-sized
    routing), an optional gated LoRA term on the rows a RowGate picks (`gated_lora`, attached by studio.engine.lora),
    and under tensor parallelism the sum of the ranks' partial products (`reduce`)."""
    lora_A: torch.Tensor | None = None   # [r, in]
    lora_B: torch.Tensor | None = None   # [out, r]
    lora_scale: float = 0.0
    # tensor parallelism: a projection split by input columns makes a partial sum, which this adds up across the
    # ranks (studio.engine.tensor_parallel); None on one process
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    fused: bool = False   # its product runs inside a `Fused` one (its weight a view of that one's)
    scale: torch.Tensor | None = None   # weight-only int8/fp8: the weight is 1-byte, times this per row (quantize.py)

    def _apply(self, fn, recurse=True):
        if self.scale is not None and not self.fused:   # a plain attribute: a move or cast must reach it too
            self.scale = fn(self.scale)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, gate: RowGate | None = None) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.scale)
        if self.lora_A is not None and gate is not None:
            y = add_gated_lora(x, y, gate, self.lora_A, self.lora_B, self.lora_scale)
        return y if self.reduce is None else self.reduce(y)


class Fused(nn.Module):
    """Projections of one input (q/k/v, gate/up) as one product: their weights concatenated, each part's output a
    slice of it plus the part's own gated LoRA term. One product streams the same bytes as the parts' but is one
    kernel, not two or three: a decode step is launch-bound on a GPU, and on the CPU each call costs ~10 us of
    Python. The parts keep their weights as views of the concatenation (one copy in memory), so adapters still
    attach to `q_proj`, `up_proj`, ... by name; a move or cast of the model (`.to`, `.double`) casts the product
    and makes the parts views of it again (`_apply`)."""

    def __init__(self, parts: list[Linear]):
        super().__init__()
        assert all(p.reduce is None for p in parts), "a row-parallel projection's partial sums cannot be fused"
        self.parts = parts                                              # a list: the parts stay where they are
        self.weight = torch.cat([p.weight.detach() for p in parts])     # not a Parameter: the parts' weights are
        self.bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        self.scale = None if parts[0].scale is None else torch.cat([p.scale for p in parts])   # 1-byte parts
        if getattr(parts[0].weight, "_onednn", None) is False:         # forgo_packed_copies chose for the parts
            self.weight._onednn = False
        ends = list(itertools.accumulate(p.weight.shape[0] for p in parts))
        self.spans = list(zip([0, *ends[:-1]], ends))
        self._share()

    def _share(self) -> None:
        """Make each part's weight (bias, scale) the view of its rows of the product."""
        for p, (a, b) in zip(self.parts, self.spans):
            p.weight = nn.Parameter(self.weight[a:b], requires_grad=False)
            if self.bias is not None:
                p.bias = nn.Parameter(self.bias[a:b], requires_grad=False)
            if self.scale is not None:
                p.scale = self.scale[a:b]
            p.fused = True

    def _apply(self, fn, recurse=True):
        self.weight = fn(self.weight)
        self.bias = None if self.bias is None else fn(self.bias)
        self.scale = None if self.scale is None else fn(self.scale)
        self._share()   # whichever of the parts and the product the move reached first
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, gate: RowGate | None = None) -> list[torch.Tensor]:
        y = linear(x, self.weight, self.bias, self.scale)
        outs = []
        for p, (a, b) in zip(self.parts, self.spans):
            out = y[..., a:b]
            if p.lora_A is not None and gate is not None:
                out = add_gated_lora(x, out, gate, p.lora_A, p.lora_B, p.lora_scale)
            outs.append(out)
        return outs


_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}   # where Attention/MLP keep one


def fuse_projections(model: nn.Module) -> None:
    """Fuse every attention's q/k/v (q/k where V is the key) and every dense MLP's gate/up (`Fused`), once the model
    is on its device and dtype (a later move or cast keeps them fused)."""
    for m in list(model.modules()):
        for slot, names in _FUSED.items():
            if hasattr(m, slot) and getattr(m, slot) is None:
                setattr(m, slot, Fused([p for p in (getattr(m, n) for n in names) if p is not None]))


def unfuse_projections(model: nn.Module) -> None:
    """The plain projections again: each part keeps its rows as a weight of its own (a copy, not a view)."""
    for m in model.modules():
        for slot in _FUSED:
            product = getattr(m, slot, None)
            if isinstance(product, Fused):
                for p in product.parts:
                    p.weight = nn.Parameter(p.weight.detach().clone(), requires_grad=False)
                    p.bias = None if p.bias is None else nn.Parameter(p.bias.detach().clone(), requires_grad=False)
                    p.scale = None if p.scale is None else p.scale.clone()
                    p.fused = False
                setattr(m, slot, None)


@contextlib.contextmanager
def plain_projections(model: nn.Module):
    """The model with its plain projections for a while: the fused products' oracle, and what `bench forwards`
    times them against (the parts' weights are views of the products, so both paths read the same numbers)."""
    fused = [(m, name, getattr(m, name)) for m in model.modules() for name in _FUSED
             if isinstance(getattr(m, name, None), Fused)]
    for m, name, _ in fused:
        setattr(m, name, None)
    try:
        yield model
    finally:
        for m, name, product in fused:
            setattr(m, name, product)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    rd = cfg.rotary_dim or cfg.head_dim   # partial rotary: the first rd dims of a head turn, the rest pass through
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs["rope_type"] == "linear":
        return inv / rs["factor"]
    # llama3: low frequencies scaled by `factor`, high ones kept, a smooth ramp between.
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, 1, T, rotary dims] for positions [B, T], computed in fp32 and cast to the activations' dtype."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of each head (all of them unless the rotary is partial)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned = x[..., :rd]
    return torch.cat((turned * cos + rotate_half(turned) * sin, x[..., rd:]), dim=-1)


class Attention(nn.Module):
    """Multi-head attention over [committed K/V | new rows], grouped-query when `layer` has fewer K/V heads. Gemma's
    layers ask for three variations: `k_as_v` (no v_proj: V is the raw key projection), `v_norm` (V RMS-normalised
    without a gain) and `scale` (its softmax scale is 1, not 1/sqrt(head size))."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, k_as_v: bool = False, v_norm: bool = False,
                 scale: float | None = None):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv, self.hd = cfg.kv_geometry(layer)
        self.q_proj = Linear(cfg.dim, cfg.n_heads * self.hd, bias=cfg.attn_bias)
        self.k_proj = Linear(cfg.dim, self.n_kv * self.hd, bias=cfg.attn_bias)
        self.v_proj = None if k_as_v else Linear(cfg.dim, self.n_kv * self.hd, bias=cfg.attn_bias)
        self.o_proj = Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_eps)
        self.v_eps = cfg.rms_eps if v_norm else None
        self.scale = scale
        self.qkv: Fused | None = None   # q/k/v as one product (`fuse_projections`)

    def project(self, x, gate) -> list[torch.Tensor]:
        if self.qkv is not None:
            return self.qkv(x, gate)
        return [p(x, gate) for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None]

    def forward(self, x, cos, sin, kv: KVCache, layer: int, mask, gate):
        B, T, _ = x.shape
        q, k, *v = self.project(x, gate)
        q = q.view(B, T, self.n_heads, self.hd)
        k = k.view(B, T, self.n_kv, self.hd)
        v = v[0].view(B, T, self.n_kv, self.hd) if v else k
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_eps is not None:
            v = rms_norm(v, self.v_eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        keys, values = kv.write(layer, k, v)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1), gate)


class MLP(nn.Module):
    """The gated feed-forward: SwiGLU, or GeGLU where the config says gelu_tanh (Gemma)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_up: Fused | None = None   # gate/up as one product (`fuse_projections`)

    def forward(self, x, gate=None):
        g, u = self.gate_up(x, gate) if self.gate_up is not None else (self.gate_proj(x, gate), self.up_proj(x, gate))
        return self.down_proj(self.act(g) * u, gate)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg) if cfg.n_experts and layer >= cfg.first_dense_layers else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)

    def forward(self, x, cos, sin, kv, layer, mask, gate):
        x, h = self.post_attention_layernorm.after_add(x, self.self_attn(self.input_layernorm(x), cos, sin, kv, layer,
                                                                          mask, gate))
        return x + self.mlp(h, gate)


class Backbone(nn.Module):
    """Holds the `model.*` parameters (HF naming): the embedding, the layers (`block` each), the final norm."""

    def __init__(self, cfg: ModelConfig, block=Block, norm=RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.n_layers))
        self.norm = norm(cfg.dim, cfg.rms_eps)


class LanguageModel(nn.Module):
    """What every model class has: its config, the `model.*` backbone, the (maybe tied) head, its RoPE tables as
    fp32 buffers, and a KV cache of its layers' geometry. Subclasses name their `backbone` and `block` classes and
    write the forward."""
    backbone = Backbone
    block = Block   # what one layer builds (studio.engine.weights checks shapes layer by layer)
    parallel = None   # this rank's TensorParallel plan when the model is one rank's shard (studio.engine.tensor_parallel)
    # weight-only int8/fp8 (studio.engine.quantize): a 1-byte copy of the head [V, D] and its row scales, which `logits`
    # reads instead of the (maybe tied) float head
    head_quant: torch.Tensor | None = None
    head_scale: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.backbone(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, table in self.rotary_buffers(cfg).items():
            self.register_buffer(name, table, persistent=False)

    @staticmethod
    def rotary_buffers(cfg: ModelConfig) -> dict[str, torch.Tensor]:
        return {"inv_freq": rope_inv_freq(cfg)}

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float logits of final hidden states x [..., D]: through the 1-byte head where the model is quantised."""
        if self.head_scale is not None:
            return quant_linear(x, self.head_quant, self.head_scale).float()
        return vocab_logits(self.lm_head.weight, x)

    def _apply(self, fn, recurse=True):
        if self.head_scale is not None:   # plain attributes: a move must reach them too
            self.head_quant, self.head_scale = fn(self.head_quant), fn(self.head_scale)
        return super()._apply(fn, recurse)

    def projection_weights(self) -> list[torch.Tensor]:
        """The weights its forward multiplies by, the head aside: the fused products' and every projection outside
        them (the packed copies `kernels.projection.pack_weights` makes)."""
        return [m.weight for m in self.modules() if isinstance(m, Fused)
                or isinstance(m, nn.Linear) and m is not self.lm_head and not getattr(m, "fused", False)]

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        cfg, p = self.config, self.lm_head.weight
        return new_cache([cfg.kv_geometry(i) for i in range(cfg.n_layers)], max_len or cfg.max_seq_len,
                         dtype=p.dtype, device=p.device, batch=batch)


class Transformer(LanguageModel):
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                mask: torch.Tensor | None = None, lora_gate: torch.Tensor | None = None,
                logits_rows: torch.Tensor | list[int] | None = None,
                embed_shift: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [T] or [B, T]. mask: bool [T, kv.length + T] (default causal).
        lora_gate: bool [T] or [B, T]. Returns float logits [B, R, V] for `logits_rows` (all rows if None).
        `embed_shift` [T, D]: added to the token embeddings (dInfer's iteration smoothing feeds a MASK its expected
        token embedding this way). Writes the new K/V at slots [kv.length, kv.length + T); the caller commits what
        it keeps."""
        if tokens.dim() == 1:
            tokens, positions = tokens[None], positions[None]
            lora_gate = None if lora_gate is None else lora_gate[None]
        T = tokens.shape[1]
        kv.begin(T)
        if mask is None and T > 1:
            mask = causal(T, kv.length, device=tokens.device)
        # nothing gated on: the plain path; else the gated rows, found once for every layer
        gate = RowGate(lora_gate) if lora_gate is not None and bool(lora_gate.any()) else None
        rows = None if logits_rows is None else torch.as_tensor(logits_rows, device=tokens.device)
        return self.run(tokens, positions, kv, mask, gate, rows, embed_shift)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, kv, mask: torch.Tensor | None,
            gate: RowGate | None, rows: torch.Tensor | None, embed_shift: torch.Tensor | None = None) -> torch.Tensor:
        """The forward proper, on prepared inputs: tokens, positions [B, T]; `kv` anything whose
        write(layer, k, v) stores the new K/V and returns what to attend over -- the KVCache, or a
        fixed-shape `SlotView` of it (studio.engine.graphs captures this call on one)."""
        cos, sin = rotary_tables(positions, self.inv_freq, self.lm_head.weight.dtype)
        x = self.model.embed_tokens(tokens)
        if embed_shift is not None:
            x = x + embed_shift.to(x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv, i, mask, gate)
        if rows is not None:
            x = x[:, rows]
        logits = self.logits(self.model.norm(x))
        return logits if self.parallel is None else self.parallel.gather_vocab(logits)


# Row counts up to which a CPU projection runs as W @ x.T or through oneDNN (`linear`)

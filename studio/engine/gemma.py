"""DiffusionGemma's text model (google/diffusiongemma-26B-A4B-it): a Gemma-4 backbone run in two passes over one KV
cache, built from the compact model's parts (studio.engine.model).

- The **encoder** pass is causal: it reads the prompt, later each finished canvas, and writes their K/V (the caller
  commits them). `encode` returns its last hidden state.
- The **decoder** pass (`forward`) is bidirectional over the canvas and reads the committed K/V; it writes the
  canvas's K/V past the committed slots like any forward, and the caller never commits them. Its logits are soft-capped
  (cap * tanh(x / cap)); its input adds a self-conditioning signal made from the previous step's logits.

A Gemma-4 layer differs from a Llama one: every sub-block is normalised before and after ("sandwich" norms); every
layer runs a dense GeGLU *and* a mixture of GeGLU experts beside it, the router reading the raw residual and the
experts their own normalised copy; the whole residual stream is then multiplied by a per-layer scalar, one set for
each pass. Sliding-window layers (heads of head_dim, a window of sliding_window) alternate with full-attention layers
(heads of full_head_dim, fewer K/V heads, V = the raw key projection, "proportional" RoPE on a quarter of the
frequency pairs). Attention scores are not scaled by 1/sqrt(d), V is RMS-normalised, the embedding is multiplied by
sqrt(hidden size) in the weights' dtype. Design: docs/families.md#diffusiongemma.
"""
from __future__ import annotations

import torch
from torch import nn

from studio.engine.config import ModelConfig
from studio.engine.kv_cache import KVCache
from studio.engine.masks import bidirectional, causal
from studio.engine.gated_lora import RowGate
from studio.engine.model import MLP, Attention, Backbone, LanguageModel, RMSNorm, rms_norm, rope_inv_freq, rotary_tables
from studio.engine.moe import MoE


class GemmaRMSNorm(RMSNorm):
    """Gemma multiplies by its gain in fp32, before casting back (Llama casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x.float(), self.eps) * self.weight.float()).to(x.dtype)


def _norm(cfg: ModelConfig, dim: int | None = None) -> GemmaRMSNorm:
    return GemmaRMSNorm(dim or cfg.dim, cfg.rms_eps)


class GemmaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer, k_as_v=not cfg.is_sliding(layer), v_norm=True, scale=1.0)
        self.self_attn.q_norm, self.self_attn.k_norm = _norm(cfg, self.self_attn.hd), _norm(cfg, self.self_attn.hd)
        self.mlp = MLP(cfg)
        self.moe = MoE(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                     "post_feedforward_layernorm_2"):
            setattr(self, name, _norm(cfg))
        self.register_buffer("layer_scalar", torch.ones(1))     # the decoder pass's
        self.register_buffer("encoder_scalar", torch.ones(1))   # the encoder pass's (the checkpoint keeps both)

    def forward(self, x, cos, sin, kv, layer, mask, gate, encoder: bool = False):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, mask, gate))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x), gate))
        routed = self.post_feedforward_layernorm_2(self.moe(x, expert_input=self.pre_feedforward_layernorm_2(x)))
        x = x + self.post_feedforward_layernorm(dense + routed)
        return x * (self.encoder_scalar if encoder else self.layer_scalar)


class SelfConditioning(MLP):
    """The decoder's input: post_norm(embedding + GeGLU(pre_norm(soft))), where `soft` is the previous step's token
    distribution times the (scaled) embedding table, zero on a canvas's first step."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.pre_norm = _norm(cfg)
        self.eps = cfg.rms_eps

    def forward(self, embedded: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is not None:   # GeGLU(pre_norm(0)) is 0: the first step skips the MLP
            embedded = embedded + super().forward(self.pre_norm(soft))
        return rms_norm(embedded, self.eps)


class GemmaBackbone(Backbone):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, GemmaBlock, GemmaRMSNorm)
        self.self_conditioning = SelfConditioning(cfg)


class DiffusionGemma(LanguageModel):
    backbone, block = GemmaBackbone, GemmaBlock   # its config always ties the head to the embedding

    @staticmethod
    def rotary_buffers(cfg: ModelConfig) -> dict[str, torch.Tensor]:
        return {"inv_freq": rope_inv_freq(cfg), "inv_freq_full": full_inv_freq(cfg)}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight
        return self.model.embed_tokens(tokens) * torch.tensor(self.config.dim ** 0.5, dtype=w.dtype)

    def encode(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """The causal encoder pass: K/V of `tokens` written at [kv.length, kv.length + T) for the caller to commit;
        returns the final (normalised) hidden states [B, T, D]."""
        tokens, positions = _batched(tokens, positions)
        kv.begin(tokens.shape[1])
        full = causal(tokens.shape[1], kv.length, device=tokens.device)
        window = causal(tokens.shape[1], kv.length, device=tokens.device, window=self.config.sliding_window)
        return self.model.norm(self._layers(self.embed(tokens), positions, kv, full, window, None, encoder=True))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                mask: torch.Tensor | None = None, lora_gate: torch.Tensor | None = None,
                logits_rows: torch.Tensor | list[int] | None = None,
                self_conditioning: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder pass over a canvas: every row sees the committed prefix and the whole canvas (the sliding
        layers the last sliding_window - 1 committed slots only); `mask` [T, kv.length + T] narrows that further.
        `self_conditioning`: the previous step's (temperature-scaled) logits [B, T, V], None on the first step.
        Returns soft-capped float logits [B, R, V] for `logits_rows` (all rows if None)."""
        tokens, positions = _batched(tokens, positions)
        T = tokens.shape[1]
        lora_gate = None if lora_gate is None else lora_gate.reshape(tokens.shape)
        kv.begin(T)
        window, W = mask, self.config.sliding_window
        if W and kv.length >= W:   # else the whole prefix is in the window
            recent = bidirectional(T, kv.length, device=tokens.device, window=W)
            window = recent if mask is None else recent & mask
        soft = None
        if self_conditioning is not None:
            w = self.model.embed_tokens.weight
            probs = torch.softmax(self_conditioning.float(), dim=-1).to(w.dtype)
            soft = (probs @ w) * torch.tensor(self.config.dim ** 0.5, dtype=w.dtype)
        x = self.model.self_conditioning(self.embed(tokens), soft)
        gate = RowGate(lora_gate) if lora_gate is not None and bool(lora_gate.any()) else None
        x = self._layers(x, positions, kv, mask, window, gate, encoder=False)
        if logits_rows is not None:
            x = x[:, torch.as_tensor(logits_rows, device=tokens.device)]
        logits = self.logits(self.model.norm(x))
        if self.parallel is not None:   # a shard's head gives its vocabulary rows' logits
            logits = self.parallel.gather_vocab(logits)
        cap = self.config.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def _layers(self, x, positions, kv, full_mask, window_mask, gate, encoder: bool) -> torch.Tensor:
        rotary = {kind: rotary_tables(positions, freq, x.dtype) for kind, freq in
                  (("sliding", self.inv_freq), ("full", self.inv_freq_full))}
        for i, layer in enumerate(self.model.layers):
            kind = "sliding" if self.config.is_sliding(i) else "full"
            mask = window_mask if kind == "sliding" else full_mask
            x = layer(x, *rotary[kind], kv, i, mask, gate, encoder=encoder)
        return x


def full_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Gemma's "proportional" RoPE for the full-attention layers: frequency pairs over the whole head (rotate-half
    pairs dim j with j + d/2), the exponent divided by the full head size, only the first `full_rotary_fraction` of
    the pairs turning (the rest get frequency 0: cos 1, sin 0)."""
    d = cfg.full_head_dim or cfg.head_dim
    turning = int(cfg.full_rotary_fraction * d // 2)
    theta = cfg.full_rope_theta or cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / d))
    return torch.cat([inv, torch.zeros(d // 2 - turning)])


def _batched(tokens: torch.Tensor, positions: torch.Tensor):
    return (tokens[None], positions[None]) if tokens.dim() == 1 else (tokens, positions)

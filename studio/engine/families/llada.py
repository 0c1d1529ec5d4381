"""LLaDA dense (GSAI-ML/LLaDA-8B-Base, -Instruct, LLaDA-1.5): a Llama block (RMSNorm, rotate-half RoPE, SwiGLU,
no biases) under OLMo-style tensor names, trained with full bidirectional attention over the whole sequence, its
logits position-aligned (a MASK at i predicts token i). Facts and sources: docs/families.md#llada-dense.
"""
from __future__ import annotations

import re

import torch

from studio.engine.config import ModelConfig
from studio.errors import BadInput

NAME = "llada"   # ModelConfig.family
MASK_ID = 126336   # <|mdm_mask|>, when config.json does not say

# what the one compact model supports of LLaDA's config switches: anything else is another model
_REQUIRED = {"block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True,
             "alibi": False, "include_bias": False, "include_qkv_bias": False, "attention_layer_norm": False,
             "input_emb_norm": False, "scale_logits": False}

_GLOBAL = {"model.transformer.wte.weight": "model.embed_tokens.weight",
           "model.transformer.ln_f.weight": "model.norm.weight",
           "model.transformer.ff_out.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
          "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj", "ff_norm": "post_attention_layernorm",
          "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj"}
_BLOCK_KEY = re.compile(r"^model\.transformer\.blocks\.(\d+)\.([a-z_]+)\.weight$")


def matches(raw: dict) -> bool:
    """LLaDA dense; LLaDA-MoE shares the model_type "llada" but has Hugging Face style keys (no `d_model`)."""
    return "LLaDAModelLM" in (raw.get("architectures") or []) or (raw.get("model_type") == "llada" and "d_model" in raw)


def config(raw: dict, name: str = "") -> ModelConfig:
    for key, want in _REQUIRED.items():
        if key in raw and raw[key] != want:
            raise BadInput(f"unsupported LLaDA variant: {key} = {raw[key]!r} (supported: {want!r})")
    try:
        n_heads = raw["n_heads"]
        eos = raw.get("eos_token_id")
        return ModelConfig(
            arch="llama",
            vocab_size=raw.get("embedding_size") or raw["vocab_size"],
            dim=raw["d_model"],
            n_layers=raw["n_layers"],
            n_heads=n_heads,
            n_kv_heads=raw.get("n_kv_heads") or n_heads,
            head_dim=raw["d_model"] // n_heads,
            ffn_dim=raw["mlp_hidden_size"],
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_eps=raw.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(raw.get("weight_tying", False)),
            max_seq_len=int(raw.get("max_sequence_length", 4096)),
            bos_id=raw.get("bos_token_id"),
            eos_ids=[] if eos is None else [eos],
            logit_shift=False,
            mask_token_id=raw.get("mask_token_id", MASK_ID),
            attention="bidirectional",
            family=NAME,
            name=name,
        )
    except KeyError as e:
        raise BadInput(f"LLaDA config.json is missing required key {e.args[0]!r}") from None


def state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LLaDA's tensor names -> the compact model's (Hugging Face Llama's)."""
    out = {}
    for key, tensor in sd.items():
        block = _BLOCK_KEY.match(key)
        if key in _GLOBAL:
            out[_GLOBAL[key]] = tensor
        elif block and block.group(2) in _BLOCK:
            out[f"model.layers.{block.group(1)}.{_BLOCK[block.group(2)]}.weight"] = tensor
        else:
            raise BadInput(f"unexpected tensor {key!r} in a LLaDA checkpoint")
    return out


_LORA_KEY = re.compile(r"^model\.transformer\.blocks\.(\d+)\.([a-z_]+)\.(lora_[AB]\.weight)$")


def adapter_names(tensors: dict[str, torch.Tensor], targets, cfg: ModelConfig):
    """A PEFT adapter trained on LLaDA (its LoRA on `model.transformer.blocks.{i}.attn_out`, target_modules
    `attn_out`, `ff_proj`, ...): keys and targets renamed onto the compact model's; other keys pass through."""
    out = {}
    for key, tensor in tensors.items():
        m = _LORA_KEY.match(key)
        out[f"model.layers.{m.group(1)}.{_BLOCK.get(m.group(2), m.group(2))}.{m.group(3)}" if m else key] = tensor
    if isinstance(targets, list):
        targets = [_BLOCK.get(t.rsplit(".", 1)[-1], t).rsplit(".", 1)[-1] for t in targets]
    return out, targets

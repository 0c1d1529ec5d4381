"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct, -Instruct-TD): OLMoE-style, Hugging Face style config
keys, every layer a softmax top-k mixture of SwiGLU experts without renormalisation, per-head QK RMSNorm before
RoPE, full bidirectional attention, position-aligned logits. Facts: docs/families.md#llada-moe.
"""
from __future__ import annotations

import re

import torch

from studio.engine.config import ModelConfig
from studio.engine.families.experts import EXPERT_KEY, stack_experts
from studio.engine.families.hf_keys import shape_fields
from studio.errors import BadInput

NAME = "llada-moe"   # ModelConfig.family
MASK_ID, EOS_ID = 156895, 156892   # the Ling vocabulary's MASK and EOS, when config.json does not say

_PLAIN_KEY = re.compile(r"^(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|model\.layers\.\d+\."
                        r"(input_layernorm|post_attention_layernorm|mlp\.gate|self_attn\.[qkvo]_proj|"
                        r"self_attn\.[qk]_norm)\.weight)$")


def matches(raw: dict) -> bool:
    return "LLaDAMoEModelLM" in (raw.get("architectures") or [])


def _refuse(raw: dict) -> None:
    """What the compact model does not run of LLaDA-MoE's config: one line naming it."""
    if any(f == 0 for f in raw.get("moe_layer_freq") or []):
        raise BadInput("unsupported LLaDA-MoE variant: dense layers (moe_layer_freq has 0s)")
    if raw.get("shared_expert_intermediate_size"):
        raise BadInput("unsupported LLaDA-MoE variant: a shared expert (shared_expert_intermediate_size)")
    if raw.get("moe_router_enable_expert_bias"):
        raise BadInput("unsupported LLaDA-MoE variant: a router expert bias (moe_router_enable_expert_bias)")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise BadInput(f"unsupported LLaDA-MoE variant: partial_rotary_factor = {raw['partial_rotary_factor']}")


def config(raw: dict, name: str = "") -> ModelConfig:
    _refuse(raw)
    try:
        return ModelConfig(
            **shape_fields({"eos_token_id": EOS_ID, **raw, "head_dim": None}, default_eps=1e-5),   # head_dim: D / H
            ffn_dim=raw.get("dense_intermediate_size") or raw["expert_intermediate_size"],
            attn_bias=bool(raw.get("attention_bias", False)),
            qk_norm=bool(raw.get("qk_layernorm", True)),
            max_seq_len=int(raw.get("max_position_embeddings", 8192)),
            logit_shift=False,
            mask_token_id=raw.get("mask_token_id", MASK_ID),
            attention="bidirectional",
            n_experts=raw["num_experts"],
            n_experts_per_tok=raw["num_experts_per_tok"],
            moe_ffn_dim=raw["expert_intermediate_size"],
            moe_renormalize=False,   # the published modeling code hard-codes it, whatever the config says
            family=NAME,
            name=name,
        )
    except KeyError as e:
        raise BadInput(f"LLaDA-MoE config.json is missing required key {e.args[0]!r}") from None


def state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Checked names; the per-expert tensors stacked into one [E, ...] tensor per layer and projection."""
    for key in sd:
        if not (EXPERT_KEY.match(key) or _PLAIN_KEY.match(key)):
            raise BadInput(f"unexpected tensor {key!r} in a LLaDA-MoE checkpoint")
    return stack_experts(sd)

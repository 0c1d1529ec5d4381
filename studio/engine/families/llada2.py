"""LLaDA2.0 / 2.1 (inclusionAI/LLaDA2.0-mini, -flash, LLaDA2.1-mini, -flash; Ling/Bailing-MoE-v2 derived): one fused
QKV projection split per head, per-head QK RMSNorm, partial rotary (the first half of each head), a dense first
layer then sigmoid-routed mixtures with group-limited top-k, an expert bias, a shared expert and a scaling factor.
Trained with block-causal attention on a block grid from position 0; logits position-aligned.
Facts: docs/families.md#llada2.
"""
from __future__ import annotations

import re

import torch

from studio.engine.config import ModelConfig
from studio.engine.families.experts import EXPERT_KEY, stack_experts
from studio.engine.families.hf_keys import shape_fields
from studio.errors import BadInput

NAME = "llada2"   # ModelConfig.family
MASK_ID, EOS_ID = 156895, 156892
BLOCK = 32   # the block grid it was trained on and its generate() decodes with (block_length)

_RENAMES = {"model.word_embeddings.weight": "model.embed_tokens.weight"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IN_LAYER = {"attention.query_layernorm.weight": "self_attn.q_norm.weight",
             "attention.key_layernorm.weight": "self_attn.k_norm.weight",
             "attention.dense.weight": "self_attn.o_proj.weight",
             **{k: k for k in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
                               "mlp.gate.expert_bias", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                               "mlp.down_proj.weight", "mlp.shared_experts.gate_proj.weight",
                               "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight")}}


def matches(raw: dict) -> bool:
    return raw.get("model_type") == "llada2_moe" or "LLaDA2MoeModelLM" in (raw.get("architectures") or [])


def _refuse(raw: dict) -> None:
    for key, want in (("score_function", "sigmoid"), ("use_qkv_bias", False), ("use_bias", False),
                      ("norm_head", False), ("norm_softmax", False), ("use_qk_norm", True)):
        if key in raw and raw[key] != want:
            raise BadInput(f"unsupported LLaDA2 variant: {key} = {raw[key]!r} (supported: {want!r})")
    if raw.get("rope_scaling"):
        raise BadInput("unsupported LLaDA2 variant: rope_scaling")


def config(raw: dict, name: str = "") -> ModelConfig:
    _refuse(raw)
    try:
        shape = shape_fields({"eos_token_id": EOS_ID, **raw}, default_eps=1e-6)
        rotary = raw.get("rotary_dim") or int(shape["head_dim"] * raw.get("partial_rotary_factor", 1.0))
        return ModelConfig(
            **shape,
            ffn_dim=raw["intermediate_size"],
            qk_norm=True,
            max_seq_len=int(raw.get("max_position_embeddings", 16384)),
            logit_shift=False,
            mask_token_id=raw.get("mask_token_id", MASK_ID),
            attention="block",
            block_size=int(raw.get("block_size", BLOCK)),
            n_experts=raw["num_experts"],
            n_experts_per_tok=raw["num_experts_per_tok"],
            moe_ffn_dim=raw["moe_intermediate_size"],
            moe_renormalize=True,   # its gate normalises whenever k > 1, whatever norm_topk_prob says
            moe_router="sigmoid",
            moe_groups=raw.get("n_group", 1),
            moe_topk_groups=raw.get("topk_group", 1),
            moe_expert_bias=bool(raw.get("moe_router_enable_expert_bias", True)),
            moe_scale=float(raw.get("routed_scaling_factor", 1.0)),
            moe_shared_ffn_dim=raw["moe_intermediate_size"] * raw.get("num_shared_experts", 0),
            first_dense_layers=raw.get("first_k_dense_replace", 0),
            rotary_dim=rotary,
            family=NAME,
            name=name,
        )
    except KeyError as e:
        raise BadInput(f"LLaDA2 config.json is missing required key {e.args[0]!r}") from None


def state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LLaDA2's names -> the compact model's: the fused QKV split by heads (q heads, then k, then v), the attention
    and embedding renamed, the per-expert tensors stacked."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        layer = _LAYER.match(key)
        if key in _RENAMES:
            out[_RENAMES[key]] = tensor
        elif key in ("model.norm.weight", "lm_head.weight") or EXPERT_KEY.match(key):
            out[key] = tensor
        elif layer and layer.group(2) == "attention.query_key_value.weight":
            out.update(_split_qkv(f"model.layers.{layer.group(1)}.self_attn.", tensor, cfg))
        elif layer and layer.group(2) in _IN_LAYER:
            out[f"model.layers.{layer.group(1)}.{_IN_LAYER[layer.group(2)]}"] = tensor
        else:
            raise BadInput(f"unexpected tensor {key!r} in a LLaDA2 checkpoint")
    return stack_experts(out)


def _split_qkv(prefix: str, w: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    if w.shape[0] != q + 2 * kv:
        raise BadInput(f"{prefix}query_key_value has {w.shape[0]} rows, the config implies {q + 2 * kv}")
    return {prefix + "q_proj.weight": w[:q], prefix + "k_proj.weight": w[q:q + kv], prefix + "v_proj.weight": w[q + kv:]}


_LORA_KEY = re.compile(r"^model\.layers\.(\d+)\.attention\.(query_key_value|dense)\.(lora_[AB])\.weight$")


def adapter_names(tensors: dict[str, torch.Tensor], targets, cfg: ModelConfig):
    """A PEFT adapter trained on LLaDA2 (LoRA on `attention.query_key_value`, `attention.dense`, the dense and shared
    MLPs): the fused QKV's LoRA becomes q/k/v LoRAs -- the same A, B's rows split by heads as the weight is, which is
    exact (B·A·x split by rows) -- and `dense` is o_proj; the MLP names are the compact model's already."""
    out: dict[str, torch.Tensor] = {}
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for key, tensor in tensors.items():
        m = _LORA_KEY.match(key)
        if not m:
            out[key] = tensor
            continue
        prefix, module, part = f"model.layers.{m.group(1)}.self_attn.", m.group(2), m.group(3)
        if module == "dense":
            out[f"{prefix}o_proj.{part}.weight"] = tensor
        elif part == "lora_A":
            out.update({f"{prefix}{p}_proj.lora_A.weight": tensor for p in "qkv"})
        elif tensor.shape[0] != q + 2 * kv:
            raise BadInput(f"adapter tensor {key} has {tensor.shape[0]} rows, the model's fused QKV has {q + 2 * kv}")
        else:
            out.update({f"{prefix}q_proj.lora_B.weight": tensor[:q], f"{prefix}k_proj.lora_B.weight": tensor[q:q + kv],
                        f"{prefix}v_proj.lora_B.weight": tensor[q + kv:]})
    if isinstance(targets, list):
        names = {"query_key_value": ["q_proj", "k_proj", "v_proj"], "dense": ["o_proj"]}
        targets = [n for t in targets for n in names.get(t.rsplit(".", 1)[-1], [t])]
    return out, targets

"""DiffusionGemma (google/diffusiongemma-26B-A4B-it): its config.json (the text model under `text_config`) and tensor
names onto studio.engine.gemma. One weight set serves both passes: the checkpoint stores the text weights once,
under `model.decoder.*`, and only each layer's encoder scalar under `model.encoder.language_model.*`. Text only: the
vision tower's tensors are skipped, with a line in `models info`. No MASK token (the canvas starts as uniform noise);
logits position-aligned (canvas row i predicts canvas token i). Facts: docs/families.md#diffusiongemma.
"""
from __future__ import annotations

import re

import torch

from studio.engine.config import ModelConfig
from studio.errors import BadInput

NAME = "diffusion_gemma"   # ModelConfig.family
CANVAS = 256               # the canvas (block) length when config.json does not say
TEXT_ONLY = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")   # skipped: the engine runs text

_DECODER = re.compile(r"^model\.decoder\.(.+)$")
_ENCODER_SCALAR = re.compile(r"^model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")
_ROUTER = {"router.proj.weight": "moe.gate.weight", "router.scale": "moe.gate.scale",
           "router.per_expert_scale": "moe.gate.per_expert_scale", "experts.down_proj": "moe.experts.down_proj"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def matches(raw: dict) -> bool:
    return raw.get("model_type") in ("diffusion_gemma", "diffusion_gemma_text") or \
        "DiffusionGemmaForBlockDiffusion" in (raw.get("architectures") or [])


def _layer_types(text: dict, n: int) -> list[str]:
    # its config class's default: every sixth layer full, the last one always full
    given = text.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    kinds = {"sliding_attention": "sliding", "full_attention": "full"}
    if len(given) != n or set(given) - set(kinds):
        raise BadInput(f"DiffusionGemma layer_types must name {n} layers, each sliding_attention or full_attention")
    return [kinds[t] for t in given[:-1]] + ["full"]


def _full_geometry(text: dict, types: list[str]) -> tuple[int, int]:
    """(head size, K/V heads) of the full-attention layers: per_layer_config where config.json has it (what
    transformers writes), else global_head_dim and num_global_key_value_heads; one geometry for all of them."""
    per_layer = text.get("per_layer_config") or {}
    default = (text.get("global_head_dim", 512), text.get("num_global_key_value_heads") or text["num_key_value_heads"])
    found = {(int(per_layer.get(str(i), {}).get("head_dim", default[0])),
              int(per_layer.get(str(i), {}).get("num_key_value_heads", default[1])))
             for i, t in enumerate(types) if t == "full"}
    if len(found) > 1:
        raise BadInput(f"unsupported DiffusionGemma variant: full-attention layers of different shapes {sorted(found)}")
    return found.pop() if found else default


def _rope(text: dict) -> tuple[float, float, float]:
    """(sliding theta, full theta, full layers' turning fraction)."""
    params = text.get("rope_parameters") or {}
    sliding, full = params.get("sliding_attention", {}), params.get("full_attention", {})
    for kind, p, want in (("sliding", sliding, "default"), ("full", full, "proportional")):
        if p.get("rope_type", want) != want:
            raise BadInput(f"unsupported DiffusionGemma variant: {kind} layers' rope_type {p['rope_type']!r} "
                           f"(supported: {want})")
    return (float(sliding.get("rope_theta", 10000.0)), float(full.get("rope_theta", 1000000.0)),
            float(full.get("partial_rotary_factor", 0.25)))


def config(raw: dict, name: str = "") -> ModelConfig:
    text = raw.get("text_config", raw)
    if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise BadInput(f"unsupported DiffusionGemma variant: hidden_activation {text['hidden_activation']!r}")
    if text.get("use_bidirectional_attention") == "all":
        raise BadInput("unsupported DiffusionGemma variant: use_bidirectional_attention 'all' (a bidirectional encoder)")
    try:
        n = text["num_hidden_layers"]
        types = _layer_types(text, n)
        full_head, full_kv = _full_geometry(text, types)
        sliding_theta, full_theta, fraction = _rope(text)
        eos = raw.get("eos_token_id", text.get("eos_token_id", 1))
        return ModelConfig(
            arch="gemma4",
            vocab_size=text["vocab_size"],
            dim=text["hidden_size"],
            n_layers=n,
            n_heads=text["num_attention_heads"],
            n_kv_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim", 256),
            ffn_dim=text["intermediate_size"],
            rope_theta=sliding_theta,
            rms_eps=text.get("rms_norm_eps", 1e-6),
            tie_embeddings=True,
            attn_bias=bool(text.get("attention_bias", False)),
            qk_norm=True,
            max_seq_len=int(text.get("max_position_embeddings", 131072)),
            bos_id=text.get("bos_token_id", 2),
            eos_ids=list(eos) if isinstance(eos, list) else [eos],
            logit_shift=False,
            block_size=int(raw.get("canvas_length", CANVAS)),
            attention="canvas",
            n_experts=text["num_experts"],
            n_experts_per_tok=text["top_k_experts"],
            moe_ffn_dim=text["moe_intermediate_size"],
            moe_renormalize=True,
            moe_router="gemma",
            hidden_act="gelu_tanh",
            layer_types=types,
            sliding_window=int(text.get("sliding_window", 512)),
            full_head_dim=full_head,
            full_kv_heads=full_kv,
            full_rope_theta=full_theta,
            full_rotary_fraction=fraction,
            logit_softcap=float(text.get("final_logit_softcapping") or 30.0),
            family=NAME,
            name=name,
        )
    except (KeyError, TypeError) as e:
        raise BadInput(f"DiffusionGemma config.json is missing required key {e.args[0]!r}") from None


def state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's names -> studio.engine.gemma's: `model.decoder.` dropped, the router and experts under `moe.`
    (the fused gate_up_proj [E, 2I, D] split into gate rows then up rows), each encoder scalar beside its layer's."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        decoder, scalar = _DECODER.match(key), _ENCODER_SCALAR.match(key)
        if key.startswith(TEXT_ONLY) or key == "lm_head.weight":   # vision; the head is the embedding
            continue
        if scalar:
            out[f"model.layers.{scalar.group(1)}.encoder_scalar"] = tensor
        elif decoder:
            out.update(_decoder_tensor(decoder.group(1), tensor))
        else:
            raise BadInput(f"unexpected tensor {key!r} in a DiffusionGemma checkpoint")
    return out


def _decoder_tensor(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    layer = _LAYER.match(name)
    if not layer:
        return {f"model.{name}": tensor}
    prefix, rest = f"model.layers.{layer.group(1)}.", layer.group(2)
    if rest == "experts.gate_up_proj":
        gate, up = tensor.chunk(2, dim=1)
        return {prefix + "moe.experts.gate_proj": gate, prefix + "moe.experts.up_proj": up}
    return {prefix + _ROUTER.get(rest, rest): tensor}


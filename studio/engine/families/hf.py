"""The Hugging Face Llama/Qwen layout, and the block-diffusion checkpoints that keep it (SDAR, Fast-dLLM v2): their
config.json read onto ModelConfig. Every other family has its own module beside this one.
"""
from __future__ import annotations

from studio.engine.config import ModelConfig
from studio.errors import BadInput

# HF `architectures[0]` / `model_type` -> our family name.
_HF_FAMILY = {
    "LlamaForCausalLM": "llama", "llama": "llama",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
}
# Block-diffusion checkpoints read natively; their remote code is never run (docs/architecture.md, capability flags).
# HF name -> (family, logit_shift, default MASK id, block-size keys, default block).
_DLM = {
    # SDAR (JetLM/SDAR-*-Chat): Qwen3 geometry, position-aligned (a MASK at i predicts token i);
    # config.json carries block_size 4 and mask_token_id 151669 (<|MASK|>).
    "SDARForCausalLM": ("qwen3", False, 151669, ("block_size",), 4),
    "sdar": ("qwen3", False, 151669, ("block_size",), 4),
    # Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_*): Qwen2.5 geometry, right-shifted (hidden t-1
    # predicts t); config.json carries bd_size (32); the MASK |<MASK>| = 151665 lives only in the tokenizer.
    "Fast_dLLM_QwenForCausalLM": ("qwen2", True, 151665, ("bd_size", "block_size"), 32),
    "Fast_dLLM_V2_QwenForCausalLM": ("qwen2", True, 151665, ("bd_size", "block_size"), 32),
    "Fast_dLLM_Qwen": ("qwen2", True, 151665, ("bd_size", "block_size"), 32),
    "fast_dllm_qwen": ("qwen2", True, 151665, ("bd_size", "block_size"), 32),
}


def config(cfg: dict, name: str = "") -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch0, model_type = archs[0] if archs else "", cfg.get("model_type", "")
    dlm = _DLM.get(arch0) or (None if arch0 in _HF_FAMILY else _DLM.get(model_type))
    family = dlm[0] if dlm else _HF_FAMILY.get(arch0) or _HF_FAMILY.get(model_type)
    if family is None:
        raise BadInput(f"unsupported model: architectures={archs} model_type={model_type!r}")
    logit_shift, mask_id, block_size = True, cfg.get("mask_token_id"), cfg.get("block_size")
    if dlm:
        _, logit_shift, default_mask, block_keys, default_block = dlm
        if cfg.get("use_regular_causal") is True and family == "qwen3":
            logit_shift = True  # an I-DLM checkpoint (SDARForCausalLM class, but trained with the AR shift)
        if mask_id is None and default_mask < cfg.get("vocab_size", 0):
            mask_id = default_mask
        block_size = next((cfg[k] for k in block_keys if cfg.get(k) is not None), default_block)
    try:
        n_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return ModelConfig(
            arch=family,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            ffn_dim=cfg["intermediate_size"],
            rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            bos_id=cfg.get("bos_token_id"),
            eos_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
            logit_shift=logit_shift,
            mask_token_id=mask_id,
            block_size=block_size,
            name=name,
        )
    except KeyError as e:
        raise BadInput(f"config.json is missing required key {e.args[0]!r}") from None


def _rope_scaling(cfg: dict) -> dict | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise BadInput(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")
    return dict(rs, rope_type=kind)

"""The ModelConfig fields a family with Hugging Face style config keys (hidden_size, num_attention_heads, ...) shares
with every other: the MoE families build on these."""
from __future__ import annotations


def shape_fields(raw: dict, default_eps: float) -> dict:
    """Geometry, RoPE base, norm epsilon, head tying and context from HF-style keys (KeyError when one is missing)."""
    n_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    return dict(arch="llama", vocab_size=raw["vocab_size"], dim=raw["hidden_size"], n_layers=raw["num_hidden_layers"],
                n_heads=n_heads, n_kv_heads=raw.get("num_key_value_heads") or n_heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
                rope_theta=float(raw.get("rope_theta", 10000.0)), rms_eps=raw.get("rms_norm_eps", default_eps),
                tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [eos])

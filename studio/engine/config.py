"""ModelConfig: the shape of a causal transformer, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field, asdict

from studio.errors import BadInput

SUPPORTED_ARCHS = {"llama", "qwen2", "qwen3"}
# HF `architectures[0]` / `model_type` -> our family name.
_HF_FAMILY = {
    "LlamaForCausalLM": "llama", "llama": "llama",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
}


@dataclass
class ModelConfig:
    arch: str                       # llama | qwen2 | qwen3
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling dict (llama3 / linear), None = plain RoPE
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    attn_bias: bool = False          # Qwen2: bias on q/k/v
    qk_norm: bool = False            # Qwen3: RMSNorm on q and k per head
    max_seq_len: int = 4096
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    # Capabilities (DESIGN §3). logit_shift: hidden i predicts token i+1 (AR, I-DLM).
    logit_shift: bool = True
    mask_token_id: int | None = None
    block_size: int | None = None
    name: str = ""

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise BadInput(f"unsupported architecture {self.arch!r} (supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
        if self.n_heads % self.n_kv_heads:
            raise BadInput(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        family = _HF_FAMILY.get(archs[0] if archs else "") or _HF_FAMILY.get(cfg.get("model_type", ""))
        if family is None:
            raise BadInput(f"unsupported model: architectures={archs} model_type={cfg.get('model_type')!r}")
        try:
            n_heads = cfg["num_attention_heads"]
            eos = cfg.get("eos_token_id")
            return cls(
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
                mask_token_id=cfg.get("mask_token_id"),
                block_size=cfg.get("block_size"),
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

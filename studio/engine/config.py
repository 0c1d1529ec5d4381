"""ModelConfig: the shape of a transformer (read from a config.json by studio.engine.families, or from GGUF
metadata) and the capability flags the strategies read (logit shift, MASK token, block size).

Design: docs/architecture.md#modelconfig-and-capability-flags
"""
from __future__ import annotations

from dataclasses import dataclass, field, asdict

from studio.errors import BadInput

SUPPORTED_ARCHS = {"llama", "qwen2", "qwen3", "gemma4"}   # gemma4: studio.engine.gemma (DiffusionGemma's backbone)
# the attention a model was trained with. block: block-causal; canvas: a causal encoder pass commits the prompt and
# each finished canvas, a bidirectional decoder pass over the canvas reads them (DiffusionGemma)
ATTENTIONS = ("causal", "bidirectional", "block", "canvas")
LAYER_TYPES = ("full", "sliding")
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
    # Capabilities (docs/architecture.md#modelconfig-and-capability-flags).
    # logit_shift: hidden i predicts token i+1 (AR, I-DLM).
    logit_shift: bool = True
    mask_token_id: int | None = None
    block_size: int | None = None
    adapter_block_size: int | None = None   # the attached adapter's training block size (a block adapter)
    # attention: what the model was trained with. A forward's mask is the run's choice (studio.engine.masks);
    # strategies that need token-causal predictions refuse a bidirectional (LLaDA, Dream) or block-causal (LLaDA2) one.
    attention: str = "causal"
    # mixture of experts (studio.engine.moe): n_experts > 0 replaces every layer's MLP by n_experts SwiGLU experts
    # of width moe_ffn_dim behind a softmax top-k router
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_ffn_dim: int = 0
    moe_renormalize: bool = False    # divide the top-k weights by their sum
    moe_router: str = "softmax"      # softmax (OLMoE) | sigmoid (Ling/Bailing v2, DeepSeek-V3: group-limited top-k)
    moe_groups: int = 1              # sigmoid router: expert groups, and how many of them a token may use
    moe_topk_groups: int = 1
    moe_expert_bias: bool = False    # sigmoid router: a per-expert bias added to the selection scores only
    moe_scale: float = 1.0           # the routed output's scaling factor
    moe_shared_ffn_dim: int = 0      # a shared expert beside the routed ones (its width; 0 = none)
    first_dense_layers: int = 0      # an MoE model's first layers keep a dense MLP of ffn_dim
    rotary_dim: int = 0              # RoPE on the first rotary_dim dims of each head (0 = all of head_dim)
    hidden_act: str = "silu"         # the gated MLPs' and experts' activation: silu (SwiGLU) | gelu_tanh (GeGLU)
    # Gemma-4 layer geometry (studio.engine.gemma): sliding-window layers use head_dim, n_kv_heads, rope_theta and see
    # the last sliding_window - 1 keys; full-attention layers have their own head size, K/V heads and RoPE, which
    # turns only the first full_rotary_fraction of the frequency pairs (Gemma's "proportional" RoPE)
    layer_types: list[str] = field(default_factory=list)   # per layer "full" | "sliding"; empty = every layer full
    sliding_window: int = 0
    full_head_dim: int = 0
    full_kv_heads: int = 0
    full_rope_theta: float = 0.0
    full_rotary_fraction: float = 1.0
    logit_softcap: float = 0.0       # logits = cap * tanh(logits / cap) (0 = none)
    family: str = ""                 # the checkpoint family when it is not `arch`'s own layout (llada, ...)
    name: str = ""

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise BadInput(f"unsupported architecture {self.arch!r} (supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
        if self.attention not in ATTENTIONS:
            raise BadInput(f"unsupported attention {self.attention!r} (supported: {', '.join(ATTENTIONS)})")
        if self.moe_router not in ("softmax", "sigmoid", "gemma"):
            raise BadInput(f"unsupported MoE router {self.moe_router!r} (supported: softmax, sigmoid, gemma)")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise BadInput(f"unsupported activation {self.hidden_act!r} (supported: silu, gelu_tanh)")
        if self.layer_types and (len(self.layer_types) != self.n_layers or set(self.layer_types) - set(LAYER_TYPES)):
            raise BadInput(f"layer_types must name {self.n_layers} layers, each one of {', '.join(LAYER_TYPES)}")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise BadInput(f"rotary_dim must be an even number of dims within head_dim {self.head_dim}, got {self.rotary_dim}")
        if self.n_experts and not 0 < self.n_experts_per_tok <= self.n_experts:
            raise BadInput(f"experts per token must be in 1..{self.n_experts}, got {self.n_experts_per_tok}")
        if self.n_heads % self.n_kv_heads:
            raise BadInput(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    def to_dict(self) -> dict:
        return asdict(self)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    def kv_geometry(self, layer: int) -> tuple[int, int]:
        """(K/V heads, head size) of `layer`'s attention: Gemma's full-attention layers have their own."""
        if self.layer_types and not self.is_sliding(layer) and self.full_head_dim:
            return self.full_kv_heads or self.n_kv_heads, self.full_head_dim
        return self.n_kv_heads, self.head_dim

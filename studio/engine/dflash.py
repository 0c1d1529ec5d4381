"""DFlash's drafter (arXiv 2602.06036): a few non-causal Qwen3-style layers with no embedding or head of their own,
conditioned on the target's hidden states at a handful of tapped layers.

The target's tapped hidden states of the committed tokens (concatenated, through `fc` and `hidden_norm`) are the
drafter's context: at every layer they give keys and values, never queries, and the drafter keeps their K/V as the
run goes (a second KV cache, `Drafter.new_cache`). A block is [the last committed token, MASK x (B - 1)], embedded
by the target's embedding; every block row attends to the whole context and the whole block (non-causal), and the
target's head reads row i as the token at the block's position i (aligned, not shifted). One forward drafts B - 1
tokens.

The published layout, read natively (`load_drafter`):
  config.json        a Qwen3 config (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
                     head_dim, intermediate_size, rms_norm_eps, rope_theta, block_size) whose `dflash_config` (or top
                     level) holds `target_layer_ids` and `mask_token_id`
  model.safetensors  fc.weight [D, taps x D], hidden_norm.weight, norm.weight, and per layer
                     layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.self_attn.{q,k}_norm.weight,
                     layers.N.mlp.{gate,up,down}_proj.weight, layers.N.{input,post_attention}_layernorm.weight
A tap id t is the output of the target's layer t (Hugging Face's hidden_states[t + 1]).

Ours may add `draft_vocab` to model.safetensors: the target token ids (int64, ascending) the drafter's head reads,
the most frequent in its training answers (FR-Spec's frequency-ranked draft vocabulary). The head is a fifth of a
small target's weights, and a drafter that reads all of it every forward costs a quarter of a step on a CPU; a
sixth of the rows costs a sixth. Drafts are then drawn among those tokens only, which verification makes exact:
a token the drafter cannot propose is still the target's correction.

Design: docs/strategies.md#dflash
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from studio.engine.config import ModelConfig
from studio.engine.kv_cache import KVCache
from studio.engine.model import MLP, Attention, Linear, RMSNorm, rope, rope_inv_freq, rotary_tables
from studio.errors import BadInput

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
VOCAB = "draft_vocab"   # the optional tensor of the head's rows (target token ids)
ARCHITECTURE = "DFlashDraftModel"


def default_taps(target_layers: int, drafter_layers: int) -> list[int]:
    """The published default: one tap per drafter layer, spread evenly over the target's layers 1 .. n - 3 (the middle
    layer for a one-layer drafter)."""
    if drafter_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    return [int(round(start + i * (end - start) / (drafter_layers - 1))) for i in range(drafter_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    layers: ModelConfig      # the drafter's layers (a Qwen3 block shape: q/k norms)
    taps: tuple[int, ...]    # the target layers whose outputs are its context
    block_size: int          # B: the anchor and B - 1 drafts
    mask_token_id: int       # the token whose embedding fills the block's draft rows

    @classmethod
    def from_json(cls, raw: dict, where: str = "drafter") -> "DrafterConfig":
        """The published config.json (see the module docstring); BadInput for what this drafter cannot be."""
        extra = raw.get("dflash_config") or {}
        pick = lambda key, default=None: extra.get(key, raw.get(key, default))   # noqa: E731
        archs = raw.get("architectures") or [ARCHITECTURE]
        if not _names_dflash(archs):
            raise BadInput(f"{where}: architectures {archs} is not a DFlash drafter ({ARCHITECTURE})")
        if any(t != "full_attention" for t in raw.get("layer_types") or []):
            raise BadInput(f"{where}: sliding-window drafter layers are not supported")
        try:
            dim, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            n_layers = int(raw["num_hidden_layers"])
            theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            layers = ModelConfig(arch="qwen3", vocab_size=int(raw.get("vocab_size", 1)), dim=dim, n_layers=n_layers,
                                 n_heads=heads, n_kv_heads=int(raw.get("num_key_value_heads", heads)),
                                 head_dim=int(raw.get("head_dim") or dim // heads),
                                 ffn_dim=int(raw["intermediate_size"]), rope_theta=float(theta),
                                 rope_scaling=raw.get("rope_scaling"), rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
                                 attn_bias=bool(raw.get("attention_bias", False)), qk_norm=True,
                                 hidden_act=raw.get("hidden_act", "silu"))
            taps = pick("target_layer_ids")
            if taps is None:
                taps = default_taps(int(raw["num_target_layers"]), n_layers)
            mask = pick("mask_token_id")
            if mask is None:
                raise KeyError("mask_token_id")
            return cls(layers, tuple(int(t) for t in taps), int(pick("block_size", 16)), int(mask))
        except KeyError as e:
            raise BadInput(f"{where}: config has no {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise BadInput(f"{where}: bad config value ({e})") from None

    @classmethod
    def for_target(cls, target: ModelConfig, layers: int, taps: list[int] | None, block_size: int,
                   mask_token_id: int) -> "DrafterConfig":
        """A drafter for `target` whose layers have the target's shape (width, heads, MLP, RoPE), as the paper's
        drafters do; `taps` None: the published default for `layers` layers."""
        shape = ModelConfig(arch="qwen3", vocab_size=target.vocab_size, dim=target.dim, n_layers=layers,
                            n_heads=target.n_heads, n_kv_heads=target.n_kv_heads, head_dim=target.head_dim,
                            ffn_dim=target.ffn_dim, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                            rms_eps=target.rms_eps, qk_norm=True)
        taps = default_taps(target.n_layers, layers) if taps is None else taps
        return cls(shape, tuple(taps), block_size, mask_token_id)

    def to_json(self, target_layers: int) -> dict:
        m = self.layers
        return {"architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": m.dim,
                "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
                "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.ffn_dim,
                "rms_norm_eps": m.rms_eps, "rope_theta": m.rope_theta, "attention_bias": m.attn_bias,
                "hidden_act": m.hidden_act, "vocab_size": m.vocab_size, "num_target_layers": target_layers,
                "block_size": self.block_size,
                "dflash_config": {"target_layer_ids": list(self.taps), "mask_token_id": self.mask_token_id}}

    def check_target(self, target: ModelConfig, name: str, vocab: torch.Tensor | None = None) -> None:
        """BadInput unless this drafter (with its draft vocabulary `vocab`) fits the target `name` (its width, layers
        and vocabulary)."""
        if self.layers.dim != target.dim:
            raise BadInput(f"the drafter is {self.layers.dim} wide and {name!r} {target.dim}: a DFlash drafter reads the "
                           "target's embedding and head, so it is trained for one target")
        if max(self.taps) >= target.n_layers:
            raise BadInput(f"the drafter taps layer {max(self.taps)} and {name!r} has {target.n_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise BadInput(f"the drafter's mask token {self.mask_token_id} is outside {name!r}'s vocabulary")
        if vocab is not None and int(vocab[-1]) >= target.vocab_size:
            raise BadInput(f"the drafter's draft vocabulary holds token {int(vocab[-1])}, outside {name!r}'s")


class DrafterAttention(Attention):
    """Queries from the block's rows; keys and values from the context rows and the block's rows, q/k normalised per
    head, every row seeing every key (no mask at decode time)."""

    def forward(self, x, context, cos, sin, kv: KVCache | None, layer: int, mask):
        B, T, _ = x.shape
        rows = torch.cat([context, x], dim=1)
        C = context.shape[1]
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        k = self.k_proj(rows).view(B, C + T, self.n_kv, self.hd)
        v = self.v_proj(rows).view(B, C + T, self.n_kv, self.hd)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)
        q, k, v = rope(q, cos[:, :, C:], sin[:, :, C:]), rope(k, cos, sin), v.transpose(1, 2)
        keys, values = (k, v) if kv is None else kv.write(layer, k, v)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)

    def forward(self, x, context, cos, sin, kv, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, kv, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        m = cfg.layers
        self.config = cfg
        self.layers = nn.ModuleList(DrafterLayer(m) for _ in range(m.n_layers))
        self.fc = Linear(len(cfg.taps) * m.dim, m.dim, bias=False)
        self.hidden_norm = RMSNorm(m.dim, m.rms_eps)
        self.norm = RMSNorm(m.dim, m.rms_eps)
        self.register_buffer("inv_freq", rope_inv_freq(m), persistent=False)
        self.vocab: torch.Tensor | None = None   # the target ids its head reads (None: all of them)

    def new_cache(self, max_len: int) -> KVCache:
        m, p = self.config.layers, self.norm.weight   # (a norm stays float where the projections are int8)
        return KVCache(m.n_layers, m.n_kv_heads, m.head_dim, max_len, dtype=p.dtype, device=p.device)

    def forward(self, context: torch.Tensor, block: torch.Tensor, positions: torch.Tensor,
                kv: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block rows' final hidden states [B, T, D] (the target's head makes them logits).
        context [B, C, taps x D]: the target's tapped hidden states of context rows not in `kv` yet; block [B, T, D]:
        the block's embeddings; positions [B, C + T]: the context rows', then the block's. With `kv`, the rows attend
        over its committed context too, and it is left holding the new context rows' K/V (committed) -- never the
        block's. Without it (training), `mask` [B, 1, T, C + T] says which rows each block row sees."""
        C, T = context.shape[1], block.shape[1]
        dtype = self.norm.weight.dtype   # the activations': a norm stays float in an int8 drafter
        context = self.hidden_norm(self.fc(context.to(dtype)))
        cos, sin = rotary_tables(positions, self.inv_freq, dtype)
        if kv is not None:
            kv.begin(C + T)
        x = block.to(dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, context, cos, sin, kv, i, mask)
        if kv is not None:
            kv.commit(C)
        return self.norm(x)


def is_drafter_dir(path: str | Path) -> bool:
    """Whether `path` is a directory whose config.json names a DFlash drafter (what `--draft-model` reads for dflash)."""
    f = Path(path).expanduser() / CONFIG
    try:
        return _names_dflash(json.loads(f.read_text(encoding="utf-8")).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


def _names_dflash(architectures: list) -> bool:
    """Whether a config's `architectures` name a DFlash drafter (DFlashDraftModel and its variants)."""
    return any("DFlash" in str(a) for a in architectures)


def read_drafter_config(root: Path) -> DrafterConfig:
    """The drafter config in `root`'s config.json; BadInput where it is not JSON or not a DFlash drafter's."""
    try:
        raw = json.loads((root / CONFIG).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{root / CONFIG}: not JSON ({e})") from None
    return DrafterConfig.from_json(raw, str(root))


def load_drafter(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Drafter:
    """A drafter in the published layout (a directory with config.json and model.safetensors)."""
    from studio.engine.lazy_tensors import read_safetensors

    root = Path(path).expanduser()
    if not (root / CONFIG).is_file() or not (root / WEIGHTS).is_file():
        raise BadInput(f"{root} is not a DFlash drafter: it needs {CONFIG} and {WEIGHTS}")
    drafter = Drafter(read_drafter_config(root))
    weights = dict(read_safetensors(root / WEIGHTS))
    vocab = weights.pop(VOCAB, None)
    if vocab is not None:
        drafter.vocab = _checked_vocab(vocab, root / WEIGHTS)
    own = drafter.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        bad = (missing or unexpected)[0]
        raise BadInput(f"{root / WEIGHTS}: {'missing' if missing else 'unexpected'} tensor {bad!r} for a DFlash drafter")
    for name, t in weights.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise BadInput(f"{root / WEIGHTS}: {name} is {tuple(t.shape)}, the config makes it {tuple(own[name].shape)}")
    drafter.load_state_dict(weights)
    drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)
    drafter.inv_freq = rope_inv_freq(drafter.config.layers).to(device)   # fp32, as the target's
    return drafter


def _checked_vocab(ids: torch.Tensor, where: Path) -> torch.Tensor:
    """`draft_vocab` as ascending int64 ids, or a one-line refusal (the target's vocabulary: `check_target`)."""
    if ids.dim() != 1 or ids.is_floating_point() or not len(ids):
        raise BadInput(f"{where}: {VOCAB} must be a non-empty 1-D tensor of token ids")
    ids = ids.long().sort().values
    if ids[0] < 0 or bool((ids[1:] == ids[:-1]).any()):
        raise BadInput(f"{where}: {VOCAB} must hold distinct token ids")
    return ids


def save_drafter(drafter: Drafter, path: str | Path, target_layers: int, dtype: torch.dtype | None = None) -> None:
    """Write `drafter` in the published layout (weights cast to `dtype` when given), its draft vocabulary beside them."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v if dtype is None else v.to(dtype)).detach().contiguous() for k, v in drafter.state_dict().items()}
    if drafter.vocab is not None:
        tensors[VOCAB] = drafter.vocab.long().cpu().contiguous()
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    (root / CONFIG).write_text(json.dumps(drafter.config.to_json(target_layers), indent=2) + "\n", encoding="utf-8")

"""Gated LoRA adapters in the PEFT format, and the MASK token an adapter may add to an AR model.

An adapter directory is what `peft`'s `save_pretrained` writes:

  adapter_config.json        r, lora_alpha, target_modules (a list of names, or "all-linear"; any other string
                             is a PEFT regex and is not checked by name), use_rslora (scale alpha/sqrt(r), else
                             alpha/r). fan_in_fan_out, use_dora, bias != "none", rank_pattern and alpha_pattern
                             are refused; lora_dropout is ignored (inference); modules_to_save may only name
                             embed_tokens / lm_head (see the MASK token below).
  adapter_model.safetensors  base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight and
                             base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight,
                             A [r, in], B [out, r]; the `base_model.model.` prefix is optional.
                             adapter_model.bin (a pickle) is never read.

Attaching sets `lora_A`, `lora_B`, `lora_scale` on the matching `model.Linear` modules; the forward's per-row
gate decides where they apply (R-ISD: MASK rows only, so clean rows and their KV stay base-only).

Which rows an adapter adapts (our convention on top of PEFT, written by `dlm-studio train`):

  adapter_config.json  "adapted_rows": "mask" (trained with the LoRA on MASK rows only: on clean tokens the model
                       is the base model) or "all" (the LoRA on every row: a different model; the default, as for
                       any PEFT LoRA). The model an adapter makes is the LoRA on the rows it adapts, and that is
                       the model a run decodes on its clean rows (`Strategy.clean_gate`).

The attention an adapter was trained with (our convention; `dlm-studio train mdm` writes it):

  adapter_config.json  "attention": "bidirectional" (a masked-diffusion model made from an AR one, Dream's recipe:
                       the adapted model is the one `canvas` decodes, and the causal strategies refuse it) or
                       "causal". Absent: the base model's own attention. Attaching sets `ModelConfig.attention`.

The MASK token (our convention on top of PEFT; a base AR model has none):

  adapter_config.json  "mask_token_id": the id the adapter was trained with.
  a tensor, either     "mask_embedding" [1, dim]: the new embedding row; mask_token_id must be the base vocab size V;
  or                   "model.embed_tokens.weight" [V + k, dim] (a resized table, as PEFT writes for modules_to_save
                       or trainable_token_indices): only rows >= V are read.
  With no such tensor, mask_token_id names an existing token (a reserved id) and only the config changes.

The MASK is an *input-only* token: the new rows are appended to the embedding table, but the output head keeps
its V rows (a tied head is re-pointed at the first V rows of the new table, sharing its storage). So the model
never predicts MASK, clean rows score exactly the base vocabulary, and R-ISD stays lossless. For the same reason
the existing rows of a resized table, and a saved `lm_head.weight`, are ignored: the gate cannot switch an
embedding or the head, so changing them would change the base model. `config.vocab_size` stays the output
vocabulary V (the logits' width); `config.mask_token_id` becomes the adapter's id (engine.config and model.config).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from studio.engine.config import ModelConfig
from studio.engine.families import adapter_names
from studio.engine.kernels.projection import keep_packed_copy
from studio.engine.model import Linear
from studio.engine.lazy_tensors import read_safetensors
from studio.errors import BadInput, one_line, short_repr

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTED_ROWS = ("mask", "all")
ATTENTIONS = ("causal", "bidirectional")   # what an adapter may declare it was trained with
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_PREFIX = "base_model.model."
# ASCII layer numbers of at most 9 digits: int() of a 5000-digit one raises ValueError
_LORA_KEY = re.compile(r"(model\.layers\.[0-9]{1,9}\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight")
_EMBED_KEY = "model.embed_tokens.weight"
_MASK_KEY = "mask_embedding"
_HEAD_KEY = "lm_head.weight"


@dataclass
class Adapter:
    """An adapter as read from disk, not yet checked against a model."""
    path: Path
    r: int
    alpha: float
    scale: float
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]]   # "model.layers.0.self_attn.q_proj" -> (A [r,in], B [out,r])
    mask_token_id: int | None = None
    mask_embedding: torch.Tensor | None = None           # [1, dim], appended at id V
    embed_table: torch.Tensor | None = None              # [V + k, dim], rows >= V appended
    block_size: int | None = None                        # a block adapter's training block size
    adapted_rows: str = "all"                            # "mask" | "all": the rows it was trained on
    attention: str | None = None                         # the attention it was trained with (None: the base's)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def read_adapter(path: str | Path, base: ModelConfig | None = None) -> Adapter:
    """Read and validate an adapter directory (or its adapter_model.safetensors) on its own. `base`: the config of
    the model it is for, whose checkpoint family's module names an adapter trained on it uses
    (`studio.engine.families`): they are renamed onto the compact model's."""
    root = Path(path)
    if root.is_file():
        root = root.parent
    if not root.is_dir():
        raise BadInput(f"adapter not found: {path}")
    cfg = _read_config(root)
    r, alpha = cfg["r"], cfg["lora_alpha"]
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        if (root / "adapter_model.bin").is_file():
            raise BadInput(f"{root} has only adapter_model.bin (a PyTorch pickle); dlm-studio reads "
                           f"{WEIGHTS_FILE} only and never unpickles -- save the adapter with safe_serialization")
        raise BadInput(f"{root} has no {WEIGHTS_FILE}")
    tensors = {k.removeprefix(_PREFIX): v for k, v in read_safetensors(weights).items()}
    targets = cfg.get("target_modules")
    if base is not None and base.family:
        tensors, targets = adapter_names(base, tensors, targets)
    lora, extra = _split_lora(tensors, r)
    _check_targets(targets, lora)
    mask_id = cfg.get("mask_token_id")
    if mask_id is not None and (isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0):
        raise BadInput(f"{CONFIG_FILE}: mask_token_id must be a non-negative integer, got {mask_id!r}")
    block = cfg.get("block_size")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise BadInput(f"{CONFIG_FILE}: block_size must be a positive integer, got {block!r}")
    adapted = cfg.get("adapted_rows", "all")
    if adapted not in ADAPTED_ROWS:
        raise BadInput(f"{root / CONFIG_FILE}: adapted_rows must be one of {', '.join(map(repr, ADAPTED_ROWS))}, "
                       f"got {short_repr(adapted)}")
    attention = cfg.get("attention")
    if attention is not None and attention not in ATTENTIONS:
        raise BadInput(f"{root / CONFIG_FILE}: attention must be one of {', '.join(map(repr, ATTENTIONS))}, "
                       f"got {short_repr(attention)}")
    mask_emb, table = extra.get(_MASK_KEY), extra.get(_EMBED_KEY)
    if mask_emb is not None and (mask_emb.dim() != 2 or mask_emb.shape[0] != 1):
        raise BadInput(f"adapter tensor {_MASK_KEY} must have shape [1, dim], got {tuple(mask_emb.shape)}")
    if mask_emb is not None and table is not None:
        raise BadInput(f"adapter has both {_MASK_KEY} and {_EMBED_KEY}: give one")
    if (mask_emb is not None or table is not None) and mask_id is None:
        raise BadInput(f"adapter adds embedding rows but {CONFIG_FILE} names no mask_token_id")
    if not lora and mask_id is None:
        raise BadInput(f"{weights} holds no LoRA weights")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return Adapter(path=root, r=r, alpha=alpha, scale=scale, lora=lora, mask_token_id=mask_id,
                   mask_embedding=mask_emb, embed_table=table, block_size=block, adapted_rows=adapted,
                   attention=attention)


def _read_config(root: Path) -> dict:
    """adapter_config.json, with everything we cannot apply exactly refused up front."""
    f = root / CONFIG_FILE
    if not f.is_file():
        raise BadInput(f"{root} has no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise BadInput(f"invalid {f}: {one_line(e)}") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"invalid {f}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise BadInput(f"{f}: peft_type {short_repr(cfg['peft_type'])} is not supported (only LORA)")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        try:
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < float(v) < math.inf
        except OverflowError:  # an int beyond the float range (10**400): math.isfinite() raised here
            ok = False
        if not ok or (key == "r" and not isinstance(v, int)):
            raise BadInput(f"{f}: {key} must be a positive {'integer' if key == 'r' else 'number'}, got {short_repr(v)}")
    # Each of these changes what the weights mean; applying the adapter without them would be silently wrong.
    for key, ok in (("fan_in_fan_out", False), ("use_dora", False), ("bias", "none")):
        if cfg.get(key, ok) not in (ok, None):
            raise BadInput(f"{f}: {key}={short_repr(cfg[key])} is not supported (must be {ok!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise BadInput(f"{f}: {key} is not supported (one r and lora_alpha for every module)")
    saved = cfg.get("modules_to_save") or []
    if isinstance(saved, str):
        saved = [saved]
    if not isinstance(saved, list):
        raise BadInput(f"{f}: modules_to_save must be a list of module names, got {short_repr(saved)}")
    bad = [m for m in saved if str(m).rsplit(".", 1)[-1] not in ("embed_tokens", "lm_head")]
    if bad:
        raise BadInput(f"{f}: modules_to_save {bad[0]!r} is not supported (only embed_tokens / lm_head for a MASK row)")
    return cfg


def _split_lora(tensors: dict[str, torch.Tensor], r: int):
    """Pair up lora_A/lora_B per module (rank checked against r); return (lora, the other known tensors)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    extra: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = _LORA_KEY.fullmatch(key)
        if m is None:
            if key not in (_EMBED_KEY, _MASK_KEY, _HEAD_KEY):
                raise BadInput(f"adapter tensor {key!r} is not a LoRA weight of q/k/v/o/gate/up/down_proj "
                               "(unknown target module)")
            extra[key] = t
            continue
        name, target, half = m.groups()
        if _PARENT.get(target) != name.split(".")[-2]:
            raise BadInput(f"adapter targets unknown module {target!r} ({key}); supported: {', '.join(TARGETS)}")
        if not torch.is_floating_point(t) or t.dim() != 2 or not bool(torch.isfinite(t).all()):
            raise BadInput(f"adapter tensor {key} is not a finite 2-D float matrix")
        halves.setdefault(name, {})[half] = t
    lora = {}
    for name, ab in sorted(halves.items(), key=lambda kv: _model_order(kv[0])):
        if set(ab) != {"A", "B"}:
            raise BadInput(f"adapter has lora_{'A' if 'A' in ab else 'B'} but no "
                           f"lora_{'B' if 'A' in ab else 'A'} for {name}")
        A, B = ab["A"], ab["B"]
        if A.shape[0] != r or B.shape[1] != r:
            raise BadInput(f"adapter rank mismatch at {name}: lora_A {tuple(A.shape)}, lora_B {tuple(B.shape)}, "
                           f"but {CONFIG_FILE} says r={r}")
        lora[name] = (A, B)
    return lora, extra


def _model_order(name: str) -> tuple[int, int]:
    """(layer, q..down index): errors name the first module in model order."""
    parts = name.split(".")
    return int(parts[2]), TARGETS.index(parts[-1])


def _check_targets(targets, lora: dict) -> None:
    """Every target must be one of ours, and every listed target must have weights."""
    if targets is None or targets == "all-linear":
        return
    if isinstance(targets, str):
        return  # a PEFT regex: the tensor names (checked in _split_lora) decide
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise BadInput(f"{CONFIG_FILE}: target_modules must be a string or a list of strings, got {targets!r}")
    short = [t.rsplit(".", 1)[-1] for t in targets]
    unknown = [t for t in short if t not in TARGETS]
    if unknown:
        raise BadInput(f"adapter targets unknown module {unknown[0]!r}; supported: {', '.join(TARGETS)}")
    present = {name.rsplit(".", 1)[-1] for name in lora}
    absent = [t for t in short if t not in present]
    if absent:
        raise BadInput(f"{CONFIG_FILE} targets {absent[0]!r} but {WEIGHTS_FILE} has no weights for it")


# ---------------------------------------------------------------------------------------------
# attaching
# ---------------------------------------------------------------------------------------------
@dataclass
class LoadedAdapter:
    """An adapter checked against one model, its tensors on the model's device and dtype: what `install`
    puts on the model (cheap, so engines sharing one model can switch adapters between steps)."""
    path: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    rows: torch.Tensor | None       # embedding rows appended after the base vocabulary
    mask_token_id: int | None
    block_size: int | None = None   # a block adapter's training block size (blockdiff, s2d2, simsd default to it)
    adapted_rows: str = "all"       # "mask" | "all": with "all" the LoRA applies on clean rows too
    attention: str | None = None    # the attention it was trained with; None keeps the model's

    def configure(self, config):
        """`config` (a ModelConfig) as this adapter reads it: its MASK id, its training block size and the
        attention it was trained with (a masked-diffusion adapter makes its model bidirectional)."""
        over = {"adapter_block_size": self.block_size}
        if self.mask_token_id is not None:
            over["mask_token_id"] = self.mask_token_id
        if self.attention is not None:
            over["attention"] = self.attention
        return dataclasses.replace(config, **over)


def load_adapter(model: nn.Module, path: str | Path) -> LoadedAdapter:
    """Read `path` and check it against `model` (BadInput, and the model untouched, when it does not fit)."""
    adapter = read_adapter(path, model.config)
    if getattr(model, "parallel", None) is not None:   # one rank's shard: its part of each pair
        adapter = dataclasses.replace(adapter, lora={name: model.parallel.shard_lora(name, A, B)
                                                     for name, (A, B) in adapter.lora.items()})
    _check_fits(model, adapter)   # before anything changes
    rows = _new_embedding_rows(model, adapter)
    w = model.lm_head.weight
    pairs = {name: (A.to(device=w.device, dtype=w.dtype).contiguous(),   # the activations' dtype (an int8
                    B.to(device=w.device, dtype=w.dtype).contiguous())   # weight's is not)
             for name, (A, B) in adapter.lora.items()}
    if rows is not None:
        rows = rows.to(device=w.device, dtype=model.model.embed_tokens.weight.dtype)
    return LoadedAdapter(str(adapter.path), pairs, float(adapter.scale), rows, adapter.mask_token_id,
                         adapter.block_size, adapter.adapted_rows, adapter.attention)


def install(model: nn.Module, loaded: LoadedAdapter | None) -> None:
    """Put `loaded` on the model (None: the base model): LoRA on every adapted Linear, the others cleared,
    its MASK rows in the embedding table. Rows left from another adapter stay: base tokens never read them."""
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            pair = loaded.modules.get(name) if loaded else None
            m.lora_A, m.lora_B = pair if pair else (None, None)
            m.lora_scale = loaded.scale if pair else 0.0
    if loaded is not None and loaded.rows is not None:
        _write_embedding_rows(model, loaded.rows)
    model.active_adapter = loaded


def attach_adapter(engine, path: str | Path) -> LoadedAdapter:
    """Load the adapter at `path` onto engine.model (replacing any attached one); sets engine.adapter,
    engine.lora and the MASK id of engine.config."""
    loaded = load_adapter(engine.model, path)   # checks everything before changing anything
    if engine.lora is None:   # `with_adapter(None)` then still has the base model's config (its attention, MASK id)
        engine._views[None] = dataclasses.replace(engine, adapter_choice="none")
    engine.lora, engine.adapter, engine.adapter_choice = loaded, loaded.path, loaded.path
    engine.config = loaded.configure(engine.config)
    engine.activate()
    return loaded


def _check_fits(model: nn.Module, adapter: Adapter) -> None:
    """Each LoRA pair has a Linear of its shapes to go on (a mismatch = an adapter for another model)."""
    for name, (A, B) in adapter.lora.items():
        try:
            m = model.get_submodule(name)
        except AttributeError:
            raise BadInput(f"adapter has weights for {name}, which this model lacks "
                           f"({model.config.n_layers} layers): adapter trained for another model?") from None
        if not isinstance(m, Linear):
            raise BadInput(f"adapter target {name} is not a linear layer of this model")
        want_a, want_b = (adapter.r, m.in_features), (m.out_features, adapter.r)
        for half, got, want in (("lora_A", A, want_a), ("lora_B", B, want_b)):
            if tuple(got.shape) != want:
                raise BadInput(f"adapter does not fit this model: {name}.{half} has shape {tuple(got.shape)}, "
                               f"the model needs {want} (adapter trained for another model?)")


def _new_embedding_rows(model: nn.Module, adapter: Adapter) -> torch.Tensor | None:
    """The embedding rows the adapter appends after the base (output) vocabulary, or None."""
    V, dim = _base_vocab(model), model.lm_head.weight.shape[1]
    mask_id = adapter.mask_token_id
    rows = None
    if adapter.mask_embedding is not None:
        if mask_id != V:
            raise BadInput(f"adapter mask_token_id {mask_id} with a {_MASK_KEY} must be the base vocab size {V} "
                           "(the new row is appended; existing rows are never overwritten)")
        rows = adapter.mask_embedding
    elif adapter.embed_table is not None:
        if adapter.embed_table.dim() != 2 or adapter.embed_table.shape[0] <= V:
            raise BadInput(f"adapter {_EMBED_KEY} has shape {tuple(adapter.embed_table.shape)}: no rows beyond "
                           f"the model's vocab of {V}")
        rows = adapter.embed_table[V:]
    if rows is not None and rows.shape[1] != dim:
        raise BadInput(f"adapter embedding rows have dim {rows.shape[1]}, the model's is {dim} "
                       "(adapter trained for another model?)")
    n_rows = V + (0 if rows is None else rows.shape[0])
    if mask_id is not None and mask_id >= n_rows:
        raise BadInput(f"adapter mask_token_id {mask_id} has no embedding row (the model has {n_rows})")
    if rows is not None and not bool(torch.isfinite(rows).all()):
        raise BadInput("adapter embedding rows are not finite")
    return rows


def _base_vocab(model: nn.Module) -> int:
    """The tokens the head scores (a tensor-parallel shard's head has its share of them)."""
    rows = model.lm_head.weight.shape[0]
    parallel = getattr(model, "parallel", None)
    return rows if parallel is None else rows * parallel.world


def _write_embedding_rows(model: nn.Module, rows: torch.Tensor) -> None:
    """Rows V.. of the embedding table = `rows` (the table grows when it has fewer); the head keeps the
    base rows (MASK is input-only)."""
    emb, head = model.model.embed_tokens, model.lm_head
    old = emb.weight
    V, k = _base_vocab(model), rows.shape[0]
    if old.shape[0] >= V + k:
        with torch.no_grad():
            keep_packed_copy(head.weight, lambda: old[V:V + k].copy_(rows))
        return
    tied = head.weight.untyped_storage().data_ptr() == old.untyped_storage().data_ptr()
    table = torch.cat([old.detach()[:V], rows.to(device=old.device, dtype=old.dtype)])
    emb.weight = nn.Parameter(table, requires_grad=old.requires_grad)
    emb.num_embeddings = table.shape[0]
    if tied:  # a view of the new table: still one copy of the shared rows
        rows_of_head = slice(0, V) if getattr(model, "parallel", None) is None else model.parallel.vocab
        head.weight = nn.Parameter(table[rows_of_head], requires_grad=old.requires_grad)


def detach_adapter(model: nn.Module) -> None:
    """Remove the LoRA terms (the base model again). Added MASK rows stay: base tokens never read them."""
    install(model, None)


def merge_adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict with W + scale * B @ A in every adapted Linear: the adapter applied on every row."""
    sd = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.lora_A is not None:
            delta = (m.lora_B.double() @ m.lora_A.double()) * m.lora_scale  # float64: one rounding at the end
            sd[f"{name}.weight"] = (m.weight.double() + delta).to(m.weight.dtype)
    return sd


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------
def save_adapter(model_or_tensors: nn.Module | Mapping[str, tuple[torch.Tensor, torch.Tensor]], path: str | Path,
                 r: int, alpha: float, targets: list[str] | str, mask_token_id: int | None = None,
                 mask_embedding: torch.Tensor | None = None, use_rslora: bool = False,
                 block_size: int | None = None, adapted_rows: str | None = None,
                 attention: str | None = None) -> Path:
    """Write a PEFT-format adapter directory. `model_or_tensors`: a model with LoRA attached, or
    {"model.layers.0.self_attn.q_proj": (A [r,in], B [out,r]), ...}. Nothing is checked here (tests write
    deliberately broken adapters); `attach_adapter` checks on the way in."""
    from safetensors.torch import save_file

    if isinstance(model_or_tensors, nn.Module):
        pairs = {name: (m.lora_A, m.lora_B) for name, m in model_or_tensors.named_modules()
                 if isinstance(m, Linear) and m.lora_A is not None}
    else:
        pairs = dict(model_or_tensors)
    tensors = {}
    for name, (A, B) in pairs.items():
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = A.detach().cpu().contiguous()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = B.detach().cpu().contiguous()
    if mask_embedding is not None:
        tensors[_MASK_KEY] = mask_embedding.detach().cpu().reshape(1, -1).contiguous()
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
           "target_modules": targets if isinstance(targets, str) else list(targets), "lora_dropout": 0.0,
           "bias": "none", "fan_in_fan_out": False, "use_rslora": use_rslora, "modules_to_save": None}
    if mask_token_id is not None:
        cfg["mask_token_id"] = mask_token_id
    if block_size is not None:
        cfg["block_size"] = block_size
    if adapted_rows is not None:
        cfg["adapted_rows"] = adapted_rows
    if attention is not None:
        cfg["attention"] = attention
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(root / WEIGHTS_FILE), metadata={"format": "pt"})
    return root

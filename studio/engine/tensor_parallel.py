"""Tensor and expert parallelism for the compact Transformer (Llama, Qwen2, Qwen3, the DLMs built on them, the
mixture-of-experts families) and DiffusionGemma.

Rank r of `world` keeps (Megatron's layout):
- attention: its `n_heads / world` query heads and the K/V heads they read (`n_kv_heads / world` of them, or the
  one they share when there are fewer K/V heads than ranks: it is then kept on several ranks), so its KV cache holds
  those heads only; q/k/v are split by output rows, o_proj by input columns; each layer by its own geometry
  (DiffusionGemma's full-attention layers have their own head size and K/V heads);
- MLP: `ffn_dim / world` columns of gate/up and the matching input columns of down;
- MoE layers: the router whole (every rank routes every token the same way); the experts either split like MLPs
  (`moe_ffn_dim / world` columns of every expert) or, with `--ep`, placed whole (`n_experts / world` experts per
  rank, each rank running only the assignments to its own); a shared expert split like an MLP;
- the head: `vocab / world` rows of the vocabulary; each forward gathers the logits of the rows the strategy asked
  for, so every rank holds the whole logits and decides the same way (studio.run.mirror).
o_proj, down_proj and an MoE layer produce partial sums that one all-reduce each adds up (`Linear.reduce`,
`MoE.reduce`): activations are whole on every rank between layers, so the experts need no all-to-all -- a rank
skips the tokens routed elsewhere and the all-reduce the layer needs anyway brings their outputs. The embedding table
(with an adapter's MASK rows) stays whole on every rank. A LoRA pair is split like its projection: B by rows where
the projection is split by rows, A by columns where it is split by columns (its partial product joins the same
all-reduce, as B is linear).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from studio.engine.architectures import model_class
from studio.engine.config import ModelConfig
from studio.engine.model import MLP, Attention
from studio.engine.moe import Experts, MoE
from studio.errors import BadInput

BY_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # split by output rows (column-parallel)
BY_COLUMNS = ("o_proj", "down_proj")                               # split by input columns (row-parallel)


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `world`'s shard plan for one model config, and its two collectives. `place_experts`: an MoE
    model's experts are placed whole across the ranks (expert parallelism) rather than split by columns."""
    rank: int
    world: int
    group: object
    config: ModelConfig   # the whole model's
    place_experts: bool = False

    def _share(self, total: int) -> slice:
        """This rank's equal share of `total` consecutive units."""
        n = total // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    @property
    def q_heads(self) -> slice:
        return self._share(self.config.n_heads)

    def kv_heads(self, layer: int) -> slice:
        """The K/V heads of `layer` this rank keeps (DiffusionGemma's full-attention layers have fewer)."""
        return self._kv_share(self.config.kv_geometry(layer)[0])

    def _kv_share(self, kv: int) -> slice:
        w = self.world
        if kv % w == 0:
            return self._share(kv)
        head = self.rank // (w // kv)   # fewer K/V heads than ranks: the one this rank's query heads read
        return slice(head, head + 1)

    @property
    def vocab(self) -> slice:
        return self._share(self.config.vocab_size)

    @property
    def experts(self) -> slice:
        """The experts this rank holds: its share with `place_experts`, else all of them (each split by columns)."""
        n = self.config.n_experts
        return self._share(n) if self.place_experts else slice(0, n)

    def ffn_of(self, parts: list[str]) -> slice:
        """This rank's columns of the feed-forward that state-dict name `parts` belongs to: a shared expert's, an
        expert's (all of them when the experts are placed whole) or the dense MLP's."""
        cfg = self.config
        if "shared_experts" in parts:
            return self._share(cfg.moe_shared_ffn_dim)
        if "experts" in parts:
            return slice(0, cfg.moe_ffn_dim) if self.place_experts else self._share(cfg.moe_ffn_dim)
        return self._share(cfg.ffn_dim)

    def shard_config(self) -> ModelConfig:
        cfg, w = self.config, self.world
        kv = self._kv_share(cfg.n_kv_heads)
        full = _count(self._kv_share(cfg.full_kv_heads)) if cfg.full_kv_heads else 0
        moe_ffn = cfg.moe_ffn_dim if self.place_experts else cfg.moe_ffn_dim // w
        return dataclasses.replace(cfg, n_heads=cfg.n_heads // w, n_kv_heads=_count(kv), full_kv_heads=full,
                                   ffn_dim=cfg.ffn_dim // w, moe_ffn_dim=moe_ffn,
                                   moe_shared_ffn_dim=cfg.moe_shared_ffn_dim // w)

    def rows_of(self, parts: list[str]) -> slice:
        """The output rows this rank keeps of the projection whose dotted name is `parts` (last: the module)."""
        if parts[-1] in ("q_proj", "k_proj", "v_proj"):
            layer = _layer_of(parts)
            hd = self.config.kv_geometry(layer)[1]
            return _scaled(self.q_heads if parts[-1] == "q_proj" else self.kv_heads(layer), hd)
        return self.ffn_of(parts)

    def columns_of(self, parts: list[str]) -> slice:
        if parts[-1] == "o_proj":
            return _scaled(self.q_heads, self.config.kv_geometry(_layer_of(parts))[1])
        return self.ffn_of(parts)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the state-dict entry `name` (a view; whole when it is not split)."""
        parts = name.split(".")
        if name == "lm_head.weight":
            return tensor[self.vocab]
        if len(parts) >= 2 and parts[-2] == "experts":   # stacked [E, I, D] (gate, up) or [E, D, I] (down)
            tensor = tensor[self.experts]
            return tensor[:, :, self.ffn_of(parts)] if parts[-1] == "down_proj" else tensor[:, self.ffn_of(parts)]
        if len(parts) >= 2 and parts[-2] in BY_ROWS:
            return tensor[self.rows_of(parts[:-1])]
        if len(parts) >= 2 and parts[-2] in BY_COLUMNS and parts[-1] == "weight":
            return tensor[:, self.columns_of(parts[:-1])]
        return tensor

    def shard_lora(self, module: str, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA pair ([r, in], [out, r]) of the Linear at `module` (a dotted name), split as that Linear is."""
        parts = module.split(".")
        if parts[-1] in BY_ROWS:
            return A, B[self.rows_of(parts)]
        if parts[-1] in BY_COLUMNS:
            return A[:, self.columns_of(parts)], B
        return A, B

    def tie_head(self, shard: nn.Module) -> None:
        """A tied head as a view of this rank's rows of the (whole) embedding table: one copy (moving a model to
        another device or dtype copies the two apart)."""
        table = shard.model.embed_tokens.weight
        shard.lm_head.weight = nn.Parameter(table[self.vocab], requires_grad=table.requires_grad)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel projection's partial products."""
        dist.all_reduce(partial, group=self.group)
        return partial

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the vocabulary's logits [..., V / world], joined into [..., V] on every rank."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits, group=self.group)
        return torch.cat(parts, dim=-1)


def _scaled(heads: slice, size: int) -> slice:
    return slice(heads.start * size, heads.stop * size)


def _count(heads: slice) -> int:
    return heads.stop - heads.start


def _layer_of(parts: list[str]) -> int:
    """The layer index in a dotted name (`model.layers.3.self_attn.q_proj`)."""
    return int(parts[parts.index("layers") + 1])


def check_splittable(cfg: ModelConfig, world: int, place_experts: bool = False) -> None:
    """BadInput, naming what does not divide, when `cfg` cannot be split across `world` ranks."""
    if place_experts and not cfg.n_experts:
        raise BadInput("--ep: the model has no experts to place (it is not a mixture of experts)")
    parts = [("attention heads", cfg.n_heads), ("vocabulary", cfg.vocab_size)]
    if not cfg.n_experts or cfg.first_dense_layers:
        parts.append(("MLP columns", cfg.ffn_dim))
    if cfg.n_experts:
        parts.append(("experts", cfg.n_experts) if place_experts else ("expert columns", cfg.moe_ffn_dim))
    if cfg.moe_shared_ffn_dim:
        parts.append(("shared-expert columns", cfg.moe_shared_ffn_dim))
    for what, n in parts:
        if n % world:
            raise BadInput(f"--tp {world}: the model's {n} {what} do not split into {world} equal parts")
    for kv in {cfg.kv_geometry(i)[0] for i in range(cfg.n_layers)}:
        if kv % world and world % kv:
            raise BadInput(f"--tp {world}: the model's {kv} K/V heads neither split into {world} parts nor divide it")


def shard_model(model: nn.Module, plan: TensorParallel) -> nn.Module:
    """A model of the shard config holding this rank's part of `model`'s weights (same device and dtype)."""
    p = model.lm_head.weight
    return build_shard({name: plan.shard(name, t).clone() for name, t in model.state_dict().items()}, plan, p.device)


def build_shard(state: dict[str, torch.Tensor], plan: TensorParallel, device=None) -> nn.Module:
    """The shard model holding `state` (each entry already this rank's part, `plan.shard`; taken, not copied): its
    row-parallel projections and MoE layers all-reduce and its head gathers the vocabulary."""
    cfg = plan.shard_config()
    with torch.device("meta"):
        shard = model_class(cfg)(cfg)
        if plan.place_experts:   # each MoE layer holds its share of the experts, whole
            for moe in (m for m in shard.modules() if isinstance(m, MoE)):
                moe.experts = Experts(_count(plan.experts), cfg.dim, cfg.moe_ffn_dim, cfg.hidden_act)
                moe.experts.held = plan.experts
    shard.lm_head = nn.Linear(cfg.dim, cfg.vocab_size // plan.world, bias=False, device="meta")
    state = dict(state)
    head = state.pop("lm_head.weight", None)
    missing, unexpected = shard.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"shard does not match its config: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        plan.tie_head(shard)
    else:
        shard.lm_head.weight = nn.Parameter(head, requires_grad=False)
    for name, table in model_class(cfg).rotary_buffers(cfg).items():
        setattr(shard, name, table.to(device or shard.lm_head.weight.device))
    for module in shard.modules():   # what ends in a partial sum: attention, MLPs (self-conditioning's too), MoEs
        if isinstance(module, Attention):
            module.o_proj.reduce = plan.reduce
        elif isinstance(module, MLP):
            module.down_proj.reduce = plan.reduce
        elif isinstance(module, MoE):
            module.reduce = plan.reduce
    shard.parallel = plan
    return shard.eval().requires_grad_(False)

"""Tensor parallelism for the compact Transformer (Llama, Qwen2, Qwen3 and the DLMs built on them).

Rank r of `world` keeps (Megatron's layout):
- attention: its `n_heads / world` query heads and the K/V heads they read (`n_kv_heads / world` of them, or the
  one they share when there are fewer K/V heads than ranks: it is then kept on several ranks), so its KV cache holds
  those heads only; q/k/v are split by output rows, o_proj by input columns;
- MLP: `ffn_dim / world` columns of gate/up and the matching input columns of down;
- the head: `vocab / world` rows of the vocabulary; each forward gathers the logits of the rows the strategy asked
  for, so every rank holds the whole logits and decides the same way (studio.parallel.mirror).
o_proj and down_proj produce partial sums that one all-reduce each adds up (`Linear.reduce`). The embedding table
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

from studio.engine.config import ModelConfig
from studio.errors import BadInput

BY_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # split by output rows (column-parallel)
BY_COLUMNS = ("o_proj", "down_proj")                               # split by input columns (row-parallel)


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `world`'s shard plan for one model config, and its two collectives."""
    rank: int
    world: int
    group: object
    config: ModelConfig   # the whole model's

    def _share(self, total: int) -> slice:
        """This rank's equal share of `total` consecutive units."""
        n = total // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    @property
    def q_heads(self) -> slice:
        return self._share(self.config.n_heads)

    @property
    def kv_heads(self) -> slice:
        kv, w = self.config.n_kv_heads, self.world
        if kv % w == 0:
            return self._share(kv)
        head = self.rank // (w // kv)   # fewer K/V heads than ranks: the one this rank's query heads read
        return slice(head, head + 1)

    @property
    def ffn(self) -> slice:
        return self._share(self.config.ffn_dim)

    @property
    def vocab(self) -> slice:
        return self._share(self.config.vocab_size)

    def shard_config(self) -> ModelConfig:
        cfg = self.config
        kv = self.kv_heads
        return dataclasses.replace(cfg, n_heads=cfg.n_heads // self.world, n_kv_heads=kv.stop - kv.start,
                                   ffn_dim=cfg.ffn_dim // self.world)

    def rows_of(self, module: str) -> slice:
        """The output rows of projection `module` (its last name) this rank keeps."""
        hd = self.config.head_dim
        if module == "q_proj":
            return _scaled(self.q_heads, hd)
        if module in ("k_proj", "v_proj"):
            return _scaled(self.kv_heads, hd)
        return self.ffn

    def columns_of(self, module: str) -> slice:
        return _scaled(self.q_heads, self.config.head_dim) if module == "o_proj" else self.ffn

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the state-dict entry `name` (a view; whole when it is not split)."""
        parts = name.split(".")
        if name == "lm_head.weight":
            return tensor[self.vocab]
        if len(parts) >= 2 and parts[-2] in BY_ROWS:
            return tensor[self.rows_of(parts[-2])]
        if len(parts) >= 2 and parts[-2] in BY_COLUMNS and parts[-1] == "weight":
            return tensor[:, self.columns_of(parts[-2])]
        return tensor

    def shard_lora(self, module: str, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA pair ([r, in], [out, r]) of the Linear at `module` (a dotted name), split as that Linear is."""
        last = module.rsplit(".", 1)[-1]
        if last in BY_ROWS:
            return A, B[self.rows_of(last)]
        if last in BY_COLUMNS:
            return A[:, self.columns_of(last)], B
        return A, B

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


def check_splittable(cfg: ModelConfig, world: int) -> None:
    """BadInput, naming what does not divide, when `cfg` cannot be split across `world` ranks."""
    if cfg.arch == "gemma4" or cfg.layer_types:
        raise BadInput("--tp: DiffusionGemma models are not split across ranks yet")
    if cfg.n_experts:
        raise BadInput("--tp: MoE models are not split across ranks yet (expert parallelism is planned)")
    kv = cfg.n_kv_heads
    for what, n in (("attention heads", cfg.n_heads), ("MLP columns", cfg.ffn_dim), ("vocabulary", cfg.vocab_size)):
        if n % world:
            raise BadInput(f"--tp {world}: the model's {n} {what} do not split into {world} equal parts")
    if kv % world and world % kv:
        raise BadInput(f"--tp {world}: the model's {kv} K/V heads neither split into {world} parts nor divide it")


def shard_model(model: nn.Module, plan: TensorParallel) -> nn.Module:
    """A model of the shard config holding this rank's part of `model`'s weights (same device and dtype); its
    row-parallel projections all-reduce and its head gathers the vocabulary."""
    from studio.engine.model import model_class
    cfg = plan.shard_config()
    p = model.lm_head.weight
    with torch.device("meta"):
        shard = model_class(cfg)(cfg)
    shard.lm_head = nn.Linear(cfg.dim, cfg.vocab_size // plan.world, bias=False, device="meta")
    whole = model.state_dict()
    state = {name: plan.shard(name, t).clone() for name, t in whole.items()}
    tied = cfg.tie_embeddings
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = shard.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"shard does not match its config: missing {missing}, unexpected {unexpected}")
    if tied:   # a view of this rank's rows of the (whole) embedding table: one copy
        shard.lm_head.weight = nn.Parameter(shard.model.embed_tokens.weight[plan.vocab], requires_grad=False)
    else:
        shard.lm_head.weight = nn.Parameter(plan.shard("lm_head.weight", whole["lm_head.weight"]).clone(),
                                            requires_grad=False)
    for name, table in model.rotary_buffers(cfg).items():
        setattr(shard, name, table.to(p.device))
    for layer in shard.model.layers:
        layer.self_attn.o_proj.reduce = plan.reduce
        layer.mlp.down_proj.reduce = plan.reduce
    shard.parallel = plan
    return shard.eval().requires_grad_(False)

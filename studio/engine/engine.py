"""Engine: a loaded model + tokenizer + what is known about it, ready for sessions."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from studio.engine.architectures import model_class
from studio.engine.compiled import compile_step
from studio.engine.config import ModelConfig
from studio.engine.device import cpu_threads, resolve_device, resolve_dtype
from studio.engine.graphs import CachePool
from studio.engine.lora import attach_adapter, install, load_adapter
from studio.engine.kernels.projection import forgo_packed_copies
from studio.engine.model import Transformer, fuse_projections
from studio.engine.memory import check_file_model_fits, ram_bytes
from studio.engine.moe import Experts
from studio.engine.quantize import QUANTS, check_quant, quantize_head, quantize_layers
from studio.engine.random_models import RANDOM_SOURCE, build_random, check_fits, is_random, random_config
from studio.engine.tensor_parallel import build_shard
from studio.engine.tokenizer import ByteIdTokenizer
from studio.engine.weights import load_model_files
from studio.errors import BadInput
from studio.presets import load_model_preset
from studio.presets.shipped import adapter_path, shipped_for, shipped_name

_threads_set = False


def _init_torch() -> None:
    global _threads_set
    if not _threads_set:
        torch.set_num_threads(cpu_threads())
        _threads_set = True


def to_device(model: Transformer, device: torch.device, dtype: torch.dtype, quant: str = "none") -> None:
    """Move and cast the weights in place. The RoPE frequencies stay fp32: rounded to bf16 they would
    shift every position's angle. With `quant` (int8 | fp8), each layer is quantised as soon as it is placed, so
    the device never holds the whole float model (`studio.engine.quantize`)."""
    tables = model.rotary_buffers(model.config)
    if quant != "none":
        layers = model.model.layers
        for layer in layers:
            layer.to(device=device, dtype=dtype)
            quantize_layers(layer, quant)
        model.model.layers = torch.nn.ModuleList()   # placed: out of the cast below, which would widen fp8 again
        model.to(device=device, dtype=dtype)
        model.model.layers = layers
        quantize_head(model, quant)
    else:
        model.to(device=device, dtype=dtype)
    for name, table in tables.items():
        setattr(model, name, table.to(device))
    if getattr(model, "parallel", None) is not None and model.config.tie_embeddings:   # a shard's head is a view of the embedding
        model.parallel.tie_head(model)


# The largest share of the machine's memory a CPU model's fp32 weights may take and still get packed copies of its
# projections for multi-row forwards (kernels/projection.py: they double the weights' memory)
PACKED_COPY_SHARE = 0.25


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class Engine:
    """A model with one adapter choice. Engines made by `with_adapter`/`for_strategy` share the model
    (weights, tokenizer) and differ only in the adapter, which `activate` installs before each step, so
    runs with different adapters can interleave (compare in lock-step, chat switching strategies)."""
    model: Transformer
    tokenizer: object
    config: ModelConfig
    name: str
    source: str
    load_s: float
    from_cache: bool
    adapter: str | None = None            # the attached adapter's path
    lora: object = None                   # its LoadedAdapter
    adapter_choice: str | None = None     # what the user asked: None = the shipped adapter per strategy (default
                                          # model), "none" = never, else a fixed adapter for every strategy
    graphs: bool = False                  # decode-sized forwards through CUDA graphs (studio.engine.graphs)
    quant: str = "none"                   # the layers' and experts' weights: none (the dtype's) | int8 | fp8
    _views: dict = field(default_factory=dict, repr=False)   # adapter path -> engine, shared by all views
    caches: CachePool = field(default_factory=CachePool, repr=False)   # decode caches with their graphs (shared)

    @classmethod
    def load(cls, spec: str = "default", adapter: str | None = None, progress=None, device: str = "auto",
             dtype: str = "auto", graphs: bool = True, shard=None, fuse: bool = True,
             quant: str = "none", compile: bool = False) -> "Engine":
        """`spec`: a model preset name (studio/presets/models), 'default', a HF directory, a .gguf file or
        `random:NAME` (random weights of a published shape, studio.engine.random_models).
        `adapter`: a PEFT directory or a shipped adapter's name (used for every strategy), 'none', or None:
        each strategy gets the adapter shipped for it and this model, if any (studio/presets/adapters).
        `device`: auto | cpu | cuda; `dtype`: auto | fp32 | bf16 | fp16 (studio.engine.device). The adapter
        attaches after the model is placed, so it lands on the model's device and dtype. `graphs`: CUDA graphs
        for decode-sized forwards, on CUDA only (on the CPU a graph would only add copies). `shard`: a tensor-
        parallel rank's planner (a config -> its TensorParallel plan): the model's files are read only as far as
        this rank keeps them, and the engine is that rank's shard (random weights are made whole: launch splits
        them). `fuse`: q/k/v and gate/up as one product each (studio.engine.model.Fused); False keeps the plain
        projections, the oracle the fused path is tested against. `quant`: none | int8 | fp8 (studio.engine.quantize:
        the layers' projections, the experts and the head as 1-byte weights with a scale per row, each layer
        quantised as it is placed). `compile`: the forward through torch.compile (studio.engine.compiled), each new
        layout compiled at its first forward."""
        _init_torch()
        if quant not in QUANTS:
            raise BadInput(f"--quant must be one of {', '.join(QUANTS)}, got {quant!r}")
        t0 = time.perf_counter()
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        check_quant(quant, dev)
        if compile and graphs and dev.type == "cuda":
            # a CUDA graph captures the forward on a SlotView, whose stores the compiled step would copy whole per layer
            raise BadInput("--compile runs without CUDA graphs: add --no-graphs")
        if is_random(spec):
            cfg = random_config(spec)
            check_fits(cfg, dt, dev, ram_bytes())
            engine = cls(model=build_random(cfg, dev, dt, quant=quant), tokenizer=ByteIdTokenizer(cfg.vocab_size),
                         config=cfg, name=cfg.name, source=RANDOM_SOURCE, load_s=0.0, from_cache=False,
                         adapter_choice=adapter)
        else:
            engine = cls._from_files(spec, progress, adapter, shard)
            to_device(engine.model, dev, dt, quant)
        engine.quant = quant
        if dev.type == "cpu" and _weight_bytes(engine.model) > PACKED_COPY_SHARE * ram_bytes():
            forgo_packed_copies(engine.model)
        if fuse:
            fuse_projections(engine.model)
        if compile:
            compile_step(engine.model)
        if adapter and adapter != "none":
            attach_adapter(engine, adapter_path(adapter))
        # an MoE layer runs under graphs where its experts run as grouped GEMMs (moe.py: the loop sizes them on the host)
        engine.graphs = graphs and dev.type == "cuda" and all(m.captured_on(dev, dt) for m in engine.model.modules()
                                                               if isinstance(m, Experts))
        engine.load_s = time.perf_counter() - t0
        return engine

    @classmethod
    def _from_files(cls, spec: str, progress, adapter: str | None, shard=None) -> "Engine":
        """The model of a preset, 'default', a directory or a GGUF, in fp32 on the CPU (with `shard`, this rank's
        part of it, read alone: studio.engine.tensor_parallel)."""
        preset = load_model_preset(spec)
        if preset and preset.source != "default" and not Path(preset.source).expanduser().exists():
            raise BadInput(f"model preset {preset.name!r}: no weights at {preset.source}. {preset.note}".strip())
        files = load_model_files(preset.source if preset else spec, progress=progress, shard=shard)
        cfg = files.config
        if preset:
            cfg = dataclasses.replace(cfg, **preset.overrides)
        if files.sharded:
            model = build_shard(files.state_dict, shard(cfg))
            return cls(model=model, tokenizer=files.tokenizer, config=model.config,
                       name=preset.name if preset else cfg.name, source=files.source, load_s=0.0,
                       from_cache=files.from_cache, adapter_choice=adapter)
        check_file_model_fits(preset.name if preset else cfg.name or spec, cfg, ram_bytes())   # nothing read yet
        model = model_class(cfg)(cfg)
        missing, unexpected = model.load_state_dict(files.state_dict, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_embeddings)]
        if missing or unexpected:
            bad = (missing or unexpected)[0]
            raise BadInput(f"weights do not match the {cfg.arch} architecture: "
                           f"{'missing' if missing else 'unexpected'} tensor {bad!r}")
        model.eval().requires_grad_(False)
        return cls(model=model, tokenizer=files.tokenizer, config=cfg, name=preset.name if preset else cfg.name,
                   source=files.source, load_s=0.0, from_cache=files.from_cache, adapter_choice=adapter)

    def activate(self) -> None:
        """Install this engine's adapter on the shared model (a no-op when it is already there)."""
        if getattr(self.model, "active_adapter", None) is not self.lora:
            install(self.model, self.lora)
            self.model.config = self.config

    def with_adapter(self, path: str | None) -> "Engine":
        """This model with the adapter at `path` (None: no adapter), sharing the weights; made once per path."""
        base = self._views.setdefault(None, self)   # `attach_adapter` keeps a copy from before its adapter
        if path not in self._views:
            loaded = load_adapter(self.model, path)
            cfg = loaded.configure(base.config)
            self._views[path] = dataclasses.replace(base, config=cfg, adapter=loaded.path, lora=loaded,
                                                    adapter_choice=loaded.path)
        return self._views[path]

    @torch.inference_mode()
    def forward_rows(self, ids: list[int], rows: list[int], gated: bool) -> torch.Tensor:
        """Float logits [len(rows), V] of one forward over `ids` on a fresh cache, every row through this view's
        adapter when `gated`: what scoring a text reads (lm-eval's log-likelihoods; under tensor parallelism
        through studio.run.mirror.score_logits, so every rank runs it)."""
        self.activate()
        dev = self.model.lm_head.weight.device
        gate = torch.full((len(ids),), gated, device=dev)
        return self.model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev),
                          self.model.new_cache(len(ids)), lora_gate=gate, logits_rows=list(rows))[0].float()

    def for_strategy(self, strategy: str) -> "Engine":
        """The engine a run of `strategy` uses: a fixed adapter choice applies to every strategy; otherwise
        the adapter shipped for this model and strategy, if there is one."""
        if self.adapter_choice is not None:
            return self
        return self.with_adapter(shipped_for(self.name, strategy))

    @property
    def title(self) -> str:
        """The model as headers name it: its own name (not the spec it was loaded by, e.g. `default`), then that
        spec, then its adapter's folder name (never a path)."""
        name = self.config.name or self.name
        spec = f" ({self.name})" if self.name not in (name, "") else ""
        adapter = f" + {Path(self.adapter).name}" if self.adapter else ""
        quant = f" · {self.quant}" if self.quant != "none" else ""
        return name + spec + quant + adapter

    def model_meta(self) -> dict:
        p = self.model.lm_head.weight
        meta = {"name": self.name, "arch": self.config.arch, "dtype": str(p.dtype).removeprefix("torch."),
                "device": str(p.device), "adapter": self.adapter, "adapter_name": shipped_name(self.adapter)}
        return meta if self.quant == "none" else {**meta, "quant": self.quant}

    def tokenizer_meta(self) -> dict:
        tok = self.tokenizer
        return {"name": tok.name, "vocab_size": self.config.vocab_size, "eos_ids": self.eos_ids(),
                "mask_id": self.config.mask_token_id}

    def eos_ids(self) -> list[int]:
        return sorted(set(self.config.eos_ids) | set(self.tokenizer.eos_ids))

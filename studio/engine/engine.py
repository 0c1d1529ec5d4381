"""Engine: a loaded model + tokenizer + what is known about it, ready for sessions."""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from studio.engine.config import ModelConfig
from studio.engine.model import Transformer
from studio.engine.weights import load_model_files
from studio.errors import BadInput
from studio.presets import load_model_preset

_threads_set = False


def _init_torch() -> None:
    global _threads_set
    if not _threads_set:
        torch.set_num_threads(os.cpu_count() or 1)
        _threads_set = True


@dataclass
class Engine:
    model: Transformer
    tokenizer: object
    config: ModelConfig
    name: str
    source: str
    load_s: float
    from_cache: bool
    adapter: str | None = None

    @classmethod
    def load(cls, spec: str = "default", adapter: str | None = None, progress=None) -> "Engine":
        """`spec`: a model preset name (presets/models), 'default', a HF directory or a .gguf file."""
        _init_torch()
        t0 = time.perf_counter()
        preset = load_model_preset(spec)
        if preset and preset.source != "default" and not Path(preset.source).expanduser().exists():
            raise BadInput(f"model preset {preset.name!r}: no weights at {preset.source}. {preset.note}".strip())
        files = load_model_files(preset.source if preset else spec, progress=progress)
        cfg = files.config
        if preset:
            cfg = dataclasses.replace(cfg, **preset.overrides)
        model = Transformer(cfg)
        missing, unexpected = model.load_state_dict(files.state_dict, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_embeddings)]
        if missing or unexpected:
            bad = (missing or unexpected)[0]
            raise BadInput(f"weights do not match the {cfg.arch} architecture: "
                           f"{'missing' if missing else 'unexpected'} tensor {bad!r}")
        model.eval().requires_grad_(False)
        engine = cls(model=model, tokenizer=files.tokenizer, config=cfg, name=preset.name if preset else cfg.name,
                     source=files.source, load_s=0.0, from_cache=files.from_cache)
        if adapter:
            from studio.engine.lora import attach_adapter
            attach_adapter(engine, adapter)
        engine.load_s = time.perf_counter() - t0
        return engine

    def model_meta(self) -> dict:
        p = self.model.lm_head.weight
        return {"name": self.name, "arch": self.config.arch, "dtype": str(p.dtype).removeprefix("torch."),
                "device": str(p.device), "adapter": self.adapter}

    def tokenizer_meta(self) -> dict:
        tok = self.tokenizer
        return {"name": tok.name, "vocab_size": self.config.vocab_size, "eos_ids": self.eos_ids(),
                "mask_id": self.config.mask_token_id}

    def eos_ids(self) -> list[int]:
        return sorted(set(self.config.eos_ids) | set(self.tokenizer.eos_ids))

"""Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B; apple/DiffuCoder-7B-*, Dream-Coder): Qwen2.5 under its own
class name, Hugging Face Qwen2 config keys and tensor names, trained with full bidirectional attention. Its logits
keep the AR shift (hidden i predicts token i+1): Dream's samplers shift them right by one themselves.
Facts: docs/families.md#dream.
"""
from __future__ import annotations

import dataclasses

import torch

from studio.engine.config import ModelConfig
from studio.engine.families import hf

NAME = "dream"   # ModelConfig.family
MASK_ID = 151666   # <|mask|>, when config.json does not say


def matches(raw: dict) -> bool:
    return raw.get("model_type") == "Dream" or "DreamModel" in (raw.get("architectures") or [])


def config(raw: dict, name: str = "") -> ModelConfig:
    qwen2 = dict(raw, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    cfg = hf.config(qwen2, name=name)
    return dataclasses.replace(cfg, attention="bidirectional", family=NAME, logit_shift=True,
                               mask_token_id=raw.get("mask_token_id", MASK_ID))


def state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return sd   # Qwen2's names already

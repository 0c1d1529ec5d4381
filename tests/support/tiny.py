"""Tiny random models of each family, built in code (tests never download anything)."""
from __future__ import annotations

import torch

from studio.engine.config import ModelConfig
from studio.engine.families import read_config
from studio.engine.model import Transformer

FAMILIES = ("llama", "qwen2", "qwen3")


def hf_config(family: str, vocab: int = 96, **over):
    """A tiny transformers config of `family` (the parity oracle's side)."""
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    common.update(over)
    if family == "llama":
        return tf.LlamaConfig(rope_theta=10000.0, **common)
    if family == "qwen2":
        return tf.Qwen2Config(rope_theta=1000000.0, **common)
    return tf.Qwen3Config(rope_theta=1000000.0, head_dim=24, **common)


def hf_pair(family: str, seed: int = 0, **over):
    """(transformers model, our model) with identical random weights, fp32, eval mode."""
    import transformers as tf
    torch.manual_seed(seed)
    hf_cfg = hf_config(family, **over)
    hf = tf.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").eval()
    ours = Transformer(read_config(hf_cfg.to_dict())).eval()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return hf, ours


def tiny_model(family: str = "llama", vocab: int = 16, seed: int = 0, dim: int = 32,
               layers: int = 2, **over) -> Transformer:
    """A tiny random model of ours (no transformers needed). Scaled-up init so distributions are peaked
    enough to make verification interesting but not degenerate."""
    torch.manual_seed(seed)
    cfg = ModelConfig(arch=family, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2,
                      head_dim=dim // 4 if family != "qwen3" else 12, ffn_dim=2 * dim,
                      rope_theta=10000.0, rms_eps=1e-6, attn_bias=family == "qwen2",
                      qk_norm=family == "qwen3", **{"max_seq_len": 128, "eos_ids": [], **over})
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() in (2, 3):   # 3: an MoE layer's stacked experts [E, out, in]
                p.normal_(0, 0.5 / p.shape[-1] ** 0.5 * 2)
            elif p.dim() == 1 and p.shape[0] != cfg.dim and p.shape[0] != cfg.head_dim:
                p.normal_(0, 0.1)  # biases
    return m


class TinyTokenizer:
    """Token i <-> the letter chr(97 + i): enough to exercise text, emit events and stop strings."""
    chat_template = None
    name = "tiny"

    def __init__(self, vocab: int, eos_ids=()):
        self.vocab_size, self.eos_ids = vocab, list(eos_ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(97 + i) for i in ids)

    def token_text(self, i: int) -> str:
        return chr(97 + i)


def tiny_engine(family: str = "llama", vocab: int = 16, seed: int = 0, mask_id: int | None = None,
                eos_ids=(), **kw):
    """An Engine around a tiny random model (mask_id defaults to the last vocab entry)."""
    import dataclasses
    from studio.engine.engine import Engine
    model = tiny_model(family, vocab=vocab, seed=seed, **kw)
    model.config = dataclasses.replace(model.config, mask_token_id=vocab - 1 if mask_id is None else mask_id,
                                       eos_ids=list(eos_ids))
    return Engine(model=model, tokenizer=TinyTokenizer(vocab, eos_ids), config=model.config, name=f"tiny-{family}",
                  source="test", load_s=0.0, from_cache=False)


def tiny_dlm(family: str = "qwen3", shift: bool = False, block: int = 4, vocab: int = 16, seed: int = 0, **kw):
    """A tiny block-diffusion engine: position-aligned (SDAR-like, shift=False) or right-shifted
    (Fast-dLLM-v2-like); MASK = the last vocab entry."""
    import dataclasses
    engine = tiny_engine(family, vocab=vocab, seed=seed, **kw)
    engine.model.config = engine.config = dataclasses.replace(engine.config, logit_shift=shift, block_size=block)
    return engine


def tiny_mdm(shift: bool = False, attention: str = "bidirectional", block: int | None = None, vocab: int = 16,
             seed: int = 0, **kw):
    """A tiny masked-diffusion engine: bidirectional (LLaDA-like, position-aligned; Dream-like with shift=True) or
    block-causal (LLaDA2-like); MASK = the last vocab entry."""
    import dataclasses
    engine = tiny_engine("llama", vocab=vocab, seed=seed, **kw)
    engine.model.config = engine.config = dataclasses.replace(engine.config, logit_shift=shift, attention=attention,
                                                              block_size=block)
    return engine


# DiffusionGemma's text model at tiny sizes: five sliding-window layers, then a full one with its own head size and
# one K/V head; experts beside the dense MLP in every layer
GEMMA_TEXT = {"model_type": "diffusion_gemma_text", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
              "num_global_key_value_heads": 1, "sliding_window": 8, "num_experts": 8, "top_k_experts": 2,
              "moe_intermediate_size": 16, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
              "final_logit_softcapping": 30.0,
              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                                     "partial_rotary_factor": 0.25}}}


def tiny_gemma(vocab: int = 24, seed: int = 0, max_seq_len: int = 256, canvas: int = 8):
    """A tiny DiffusionGemma engine (random weights, no EOS), its matrices scaled up so its canvases are not uniform
    noise -- by 5, not more: at 10 the self-conditioned steps amplify a different summation order's rounding (a
    shard's) past 1e-4 in the probabilities."""
    from studio.engine.engine import Engine
    from studio.engine.random_models import build_random
    raw = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
           "canvas_length": canvas, "text_config": dict(GEMMA_TEXT, vocab_size=vocab, max_position_embeddings=max_seq_len)}
    cfg = read_config(raw, name="tiny-gemma")
    import dataclasses
    cfg = dataclasses.replace(cfg, eos_ids=[], mask_token_id=None)
    model = build_random(cfg, torch.device("cpu"), torch.float32, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(5.0)
    return Engine(model=model, tokenizer=TinyTokenizer(vocab), config=cfg, name="tiny-gemma", source="test",
                  load_s=0.0, from_cache=False)

"""Shape-only models (`--model random:NAME`): a published architecture with seeded random weights, so speed
can be measured without a checkpoint. The weights are allocated once, on the target device, in the target
dtype (an 8B model is never materialised in fp32 on the CPU first)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from studio.engine.config import ModelConfig
from studio.engine.families import read_config
from studio.engine.architectures import model_class
from studio.engine.memory import check_weights_fit, parameter_count
from studio.engine.model import Transformer
from studio.engine.quantize import quantize_head, quantize_layers
from studio.errors import BadInput

RANDOM_SOURCE = "random weights"   # `Engine.source` of a model these build

PREFIX = "random:"
# the shapes of the published config.json files (Hugging Face hub)
SHAPES: dict[str, dict] = {
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "intermediate_size": 1536, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True, "max_position_embeddings": 8192},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 3072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True, "max_position_embeddings": 40960},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "intermediate_size": 12288, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": False, "max_position_embeddings": 40960},
    "llama3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "intermediate_size": 14336, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                  "tie_word_embeddings": False, "max_position_embeddings": 8192},
    # GSAI-ML/LLaDA-8B-Instruct's own config.json format (studio.engine.families.llada reads it)
    "llada-8b": {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 4096, "n_layers": 32,
                 "n_heads": 32, "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464,
                 "embedding_size": 126464, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                 "max_sequence_length": 4096, "weight_tying": False, "mask_token_id": 126336},
    # inclusionAI/LLaDA-MoE-7B-A1B: every layer 64 experts, top 8 (studio.engine.families.llada_moe). The sizes
    # are those its code and an independent loader agree on; the vocabulary (Ling's) is not confirmed
    "llada-moe-7b": {"architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_size": 2048,
                     "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
                     "num_experts": 64, "num_experts_per_tok": 8, "expert_intermediate_size": 1024,
                     "dense_intermediate_size": 8192, "vocab_size": 157184, "rope_theta": 50000.0,
                     "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "qk_layernorm": True},
    # inclusionAI/LLaDA2.0-mini (studio.engine.families.llada2): dFactory's training config
    "llada2-mini": {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": 2048,
                    "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                    "intermediate_size": 5120, "first_k_dense_replace": 1, "num_experts": 256,
                    "num_experts_per_tok": 8, "num_shared_experts": 1, "moe_intermediate_size": 512, "n_group": 8,
                    "topk_group": 4, "routed_scaling_factor": 2.5, "moe_router_enable_expert_bias": True,
                    "rope_theta": 600000.0, "partial_rotary_factor": 0.5, "max_position_embeddings": 16384,
                    "rms_norm_eps": 1e-6, "vocab_size": 157184, "tie_word_embeddings": False},
    # Dream-org/Dream-v0-Instruct-7B: Qwen2.5-7B's shape under DreamModel (studio.engine.families.dream)
    "dream-7b": {"architectures": ["DreamModel"], "model_type": "Dream", "vocab_size": 152064, "hidden_size": 3584,
                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "intermediate_size": 18944, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": False, "max_position_embeddings": 32768, "mask_token_id": 151666},
}
# google/diffusiongemma-26B-A4B-it's text model (studio.engine.families.diffusion_gemma; the vision tower has no
# part in a text step): the sizes its config.json carries, as copies of it and its GGUF metadata agree
SHAPES["diffusiongemma-26b-a4b"] = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma", "canvas_length": 256,
    "eos_token_id": [1, 106, 50],
    "text_config": {"model_type": "diffusion_gemma_text", "vocab_size": 262144, "hidden_size": 2816,
                    "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
                    "num_global_key_value_heads": 2, "sliding_window": 1024, "max_position_embeddings": 262144,
                    "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
                    "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                                           "partial_rotary_factor": 0.25}}}}
# inclusionAI/LLaDA2.0-flash (102.9B): LLaDA2.0-mini's config at flash's sizes (dFactory's training configs);
# random:llada2-flash@L keeps L layers, to fit a machine
SHAPES["llada2-flash"] = dict(SHAPES["llada2-mini"], hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                              intermediate_size=9216, moe_intermediate_size=1024)
INIT_STD = 0.02   # transformers' initializer_range: a deep random stack keeps finite activations in bf16/fp16


def is_random(spec: str) -> bool:
    return spec.startswith(PREFIX)


def random_config(spec: str) -> ModelConfig:
    """The ModelConfig of `random:NAME` or `random:NAME@L` (the first L layers only, so a large shape fits the
    memory: its per-layer costs are those of the whole model). No EOS (runs go to --max-new-tokens, as a speed
    measurement wants); the MASK is the model's own, else the last id, so every strategy can run."""
    name, _, layers = spec.removeprefix(PREFIX).partition("@")
    if name not in SHAPES:
        raise BadInput(f"unknown random model {name!r} (available: {', '.join(PREFIX + n for n in SHAPES)})")
    cfg = read_config(SHAPES[name], name=spec)
    if layers:
        if not layers.isdigit() or not 1 <= int(layers) <= cfg.n_layers:
            raise BadInput(f"{spec}: the layer count after @ must be 1..{cfg.n_layers}, got {layers!r}")
        # a model of sliding and full layers keeps its last one full, as DiffusionGemma's own config does
        kinds = cfg.layer_types[:int(layers) - 1] + ["full"] if cfg.layer_types else []
        cfg = dataclasses.replace(cfg, n_layers=int(layers), layer_types=kinds)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else cfg.vocab_size - 1
    if cfg.attention == "canvas":   # DiffusionGemma has no MASK: its canvas starts as noise
        mask = None
    return dataclasses.replace(cfg, eos_ids=[], bos_id=None, mask_token_id=mask)


def check_fits(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, ram_bytes: int) -> None:
    """BadInput, in one line and before anything is allocated, when the weights of `cfg` in `dtype` exceed
    `ram_bytes` (the machine's memory, on the CPU)."""
    if device.type == "cpu":
        check_weights_fit(cfg.name, parameter_count(cfg) * torch.empty((), dtype=dtype).element_size(),
                          str(dtype).removeprefix("torch."), ram_bytes,
                          "random:NAME@L keeps the first L layers; --dtype bf16 halves it")


def build_random(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 quant: str = "none") -> Transformer:
    """A Transformer of shape `cfg` with N(0, INIT_STD) matrices, unit norm gains and zero biases. Each tensor is made
    on `device` in the order of `named_parameters` from one seeded generator; with `quant` (int8 | fp8), each layer is
    quantised as soon as its tensors are made, so the float model is never whole in memory (a 26B MoE in int8 on a
    48 GB card), and the result is what quantising the whole float model gives."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to(dtype)
    for name, table in model.rotary_buffers(cfg).items():   # computed, fp32 as on a loaded model
        setattr(model, name, table.to(device))
    for name, b in list(model.named_buffers()):   # the layers' own (Gemma's layer scalars)
        if b.is_meta:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, torch.ones(b.shape, dtype=b.dtype, device=device))
    gen = torch.Generator(device=device).manual_seed(seed)
    # each layer by the name of its last parameter: made, it can be quantised
    layer_ends = {f"model.layers.{i}.{list(dict(layer.named_parameters()))[-1]}": layer
                  for i, layer in enumerate(model.model.layers)}
    with torch.no_grad():
        for name, p in list(model.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            if p.dim() >= 2:   # matrices, and the stacked expert matrices of an MoE
                t.normal_(0.0, INIT_STD, generator=gen)
            elif name.endswith("bias"):   # biases, and an MoE router's expert_bias
                t.zero_()
            else:
                t.fill_(1.0)
            model.get_submodule(owner).register_parameter(leaf, nn.Parameter(t, requires_grad=False))
            if quant != "none" and name in layer_ends:
                quantize_layers(layer_ends[name], quant)
    if cfg.tie_embeddings:   # the head is the embedding's parameter, made once
        model.lm_head.weight = model.model.embed_tokens.weight
    if quant != "none":
        quantize_head(model, quant)
    return model.eval().requires_grad_(False)


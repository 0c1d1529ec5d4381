"""Tiny Hugging Face model directories (config, safetensors, tokenizer, chat template) written in code."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_hf_model(arch: str = "llama", tie: bool = False):
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    cls_cfg, cls_model, name = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, "LlamaForCausalLM"),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, "Qwen2ForCausalLM"),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, "Qwen3ForCausalLM"),
    }[arch]
    cfg = cls_cfg(architectures=[name], head_dim=16, **common)
    torch.manual_seed(0)
    model = cls_model(cfg).eval()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    # random norms too (HF initialises them to ones, which would hide a norm mix-up)
    for k in sd:
        if k.endswith("norm.weight"):
            sd[k] = torch.rand_like(sd[k]) + 0.5
    if tie:
        sd.pop("lm_head.weight", None)
    return cfg.to_dict(), sd


def tiny_tokenizer_files(path: Path, template: str | None = CHATML):
    from tokenizers import Tokenizer as TkTokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "a", "cat", "sat", "<|im_start|>", "<|im_end|>"]
    tk = TkTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tk.save(str(path / "tokenizer.json"))
    tc = {"bos_token": "<s>", "eos_token": {"content": "<|im_end|>", "special": True}, "unk_token": "<unk>"}
    if template:
        tc["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10, 2]}))


def write_hf_dir(path: Path, arch="llama", tie=False, sharded=False, dtype=torch.float32):
    path.mkdir(parents=True, exist_ok=True)
    cfg, sd = tiny_hf_model(arch, tie)
    (path / "config.json").write_text(json.dumps(cfg))
    stored = {k: v.to(dtype) for k, v in sd.items()}
    if sharded:
        keys = sorted(stored)
        half = len(keys) // 2
        shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        weight_map = {}
        for fname, ks in shards.items():
            save_file({k: stored[k] for k in ks}, str(path / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in ks})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer_files(path)
    return cfg, sd


def write_checkpoint(path, config: dict, sd: dict) -> None:
    """A model directory as published: config.json, model.safetensors and a tiny tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(sd, str(path / "model.safetensors"))
    tiny_tokenizer_files(path)


def per_expert_tensors(prefix: str, n: int, ffn: int, dim: int, rand) -> dict:
    """`prefix`mlp.experts.{e}.{gate,up,down}_proj.weight for n experts, as MoE checkpoints publish them."""
    return {f"{prefix}mlp.experts.{e}.{proj}.weight": rand(*shape) for e in range(n)
            for proj, shape in (("gate_proj", (ffn, dim)), ("up_proj", (ffn, dim)), ("down_proj", (dim, ffn)))}


LLADA2_CONFIG = {   # inclusionAI/LLaDA2.0-mini's config.json keys, tiny sizes
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
    "first_k_dense_replace": 1, "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1,
    "moe_intermediate_size": 16, "score_function": "sigmoid", "router_dtype": "fp32", "n_group": 4, "topk_group": 2,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "moe_router_enable_expert_bias": True,
    "rope_theta": 600000.0, "partial_rotary_factor": 0.5, "rotary_dim": 4, "rope_scaling": None,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "use_qkv_bias": False, "use_bias": False,
    "use_qk_norm": True, "vocab_size": 40, "tie_word_embeddings": False, "norm_softmax": False, "norm_head": False,
    "mask_token_id": 39, "eos_token_id": 2, "pad_token_id": 2}


def llada2_checkpoint(path, seed=0):
    """A tiny LLaDA2 directory in its published names: fused QKV, per-expert tensors, an expert bias buffer."""
    c = LLADA2_CONFIG
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.3            # noqa: E731
    norm = lambda n: torch.rand(n, generator=g) + 0.5                       # noqa: E731
    d, hd, H, KV, f = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["moe_intermediate_size"]
    sd = {"model.word_embeddings.weight": rand(c["vocab_size"], d), "model.norm.weight": norm(d),
          "lm_head.weight": rand(c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                   p + "attention.query_key_value.weight": rand((H + 2 * KV) * hd, d),
                   p + "attention.query_layernorm.weight": norm(hd), p + "attention.key_layernorm.weight": norm(hd),
                   p + "attention.dense.weight": rand(d, H * hd)})
        if i < c["first_k_dense_replace"]:
            sd.update({p + "mlp.gate_proj.weight": rand(c["intermediate_size"], d),
                       p + "mlp.up_proj.weight": rand(c["intermediate_size"], d),
                       p + "mlp.down_proj.weight": rand(d, c["intermediate_size"])})
            continue
        sd.update({p + "mlp.gate.weight": rand(c["num_experts"], d), p + "mlp.gate.expert_bias": rand(c["num_experts"]),
                   p + "mlp.shared_experts.gate_proj.weight": rand(f, d), p + "mlp.shared_experts.up_proj.weight": rand(f, d),
                   p + "mlp.shared_experts.down_proj.weight": rand(d, f)})
        sd.update(per_expert_tensors(p, c["num_experts"], f, d, rand))
    write_checkpoint(path, c, sd)
    return sd

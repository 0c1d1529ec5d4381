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

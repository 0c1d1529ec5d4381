"""read_config on block-diffusion checkpoints' config.json (read natively, never remote code),
and the model presets that name them."""
import pytest

from studio.engine.families import read_config
from studio.errors import BadInput
from studio.presets import load_model_preset

# Shapes as published (references/s2d2_simsd.md A.7/B.3, references/idlm.md §5; HF config.json files).
SDAR_1_7B = {
    "architectures": ["SDARForCausalLM"], "model_type": "sdar",
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "attention_bias": False, "attn_implementation": "flex_attention", "bos_token_id": 151643,
    "eos_token_id": 151643, "block_size": 4, "mask_token_id": 151669, "fuse_cross_entropy": True,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 32768, "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
SDAR_8B = dict(SDAR_1_7B, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
               num_hidden_layers=36, num_key_value_heads=8)
FAST_DLLM_V2_7B = {
    "architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen",
    "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                 "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
    "bd_size": 32, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 152064,
}


@pytest.mark.parametrize("raw,dim,layers,heads,ffn", [(SDAR_1_7B, 2048, 28, 16, 6144), (SDAR_8B, 4096, 36, 32, 12288)])
def test_sdar_is_position_aligned_qwen3(raw, dim, layers, heads, ffn):
    cfg = read_config(raw)
    assert (cfg.arch, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == \
        ("qwen3", dim, layers, heads, 8, 128, ffn)
    assert cfg.qk_norm and not cfg.attn_bias and not cfg.tie_embeddings and cfg.rope_theta == 1e6
    assert cfg.logit_shift is False and cfg.mask_token_id == 151669 and cfg.block_size == 4


def test_sdar_defaults_and_overrides():
    bare = {k: v for k, v in SDAR_8B.items() if k not in ("mask_token_id", "block_size")}
    cfg = read_config(bare)
    assert (cfg.mask_token_id, cfg.block_size, cfg.logit_shift) == (151669, 4, False)
    assert read_config(dict(SDAR_8B, block_size=8)).block_size == 8       # SDAR-8B-Chat-b8
    no_arch = {k: v for k, v in SDAR_1_7B.items() if k != "architectures"}      # model_type alone
    assert read_config(no_arch).arch == "qwen3"
    assert read_config(no_arch).logit_shift is False


def test_idlm_checkpoint_keeps_the_shift():
    """I-DLM ships as SDARForCausalLM too, but is trained with the AR logit shift; its SDARConfig
    carries use_regular_causal=True (references/idlm.md §5), which original SDAR configs lack."""
    cfg = read_config(dict(SDAR_8B, block_size=3, use_regular_causal=True))
    assert cfg.arch == "qwen3" and cfg.logit_shift is True and cfg.mask_token_id == 151669


def test_fast_dllm_v2_is_right_shifted_qwen2():
    cfg = read_config(FAST_DLLM_V2_7B)
    assert (cfg.arch, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == \
        ("qwen2", 3584, 28, 28, 4, 128, 18944)
    assert cfg.attn_bias and not cfg.qk_norm and cfg.eos_ids == [151645]
    assert cfg.logit_shift is True and cfg.mask_token_id == 151665 and cfg.block_size == 32
    assert read_config(dict(FAST_DLLM_V2_7B, bd_size=16)).block_size == 16
    assert read_config(dict(FAST_DLLM_V2_7B, mask_token_id=151666)).mask_token_id == 151666
    no_bd = {k: v for k, v in FAST_DLLM_V2_7B.items() if k != "bd_size"}
    assert read_config(no_bd).block_size == 32
    no_arch = {k: v for k, v in FAST_DLLM_V2_7B.items() if k != "architectures"}
    assert read_config(no_arch).arch == "qwen2"


def test_a_default_mask_id_outside_the_vocab_is_not_invented():
    tiny = dict(SDAR_1_7B, vocab_size=64)
    del tiny["mask_token_id"]
    assert read_config(tiny).mask_token_id is None


def test_plain_ar_models_unchanged():
    qwen3 = dict(SDAR_1_7B, architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    for k in ("mask_token_id", "block_size"):
        qwen3.pop(k)
    cfg = read_config(qwen3)
    assert cfg.arch == "qwen3" and cfg.logit_shift is True and cfg.mask_token_id is None and cfg.block_size is None
    qwen2 = dict(FAST_DLLM_V2_7B, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    cfg = read_config(qwen2)
    assert cfg.arch == "qwen2" and cfg.logit_shift is True and cfg.mask_token_id is None and cfg.block_size is None


@pytest.mark.parametrize("arch,model_type", [
    ("SDARMoeForCausalLM", "sdar_moe"), ("", "llada"),   # model_type llada without LLaDA's own keys
    ("MistralForCausalLM", "mistral"), ("", "gpt2"),
])
def test_unknown_architectures_raise(arch, model_type):
    raw = dict(SDAR_1_7B, architectures=[arch] if arch else [], model_type=model_type)
    with pytest.raises(BadInput, match="unsupported model"):
        read_config(raw)


@pytest.mark.parametrize("name,raw", [("sdar-1.7b-chat", SDAR_1_7B), ("sdar-8b-chat", SDAR_8B),
                                      ("fast-dllm-v2-7b", FAST_DLLM_V2_7B)])
def test_presets_agree_with_config(name, raw):
    preset = load_model_preset(name)
    cfg = read_config(raw)
    assert preset.overrides == {"mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size,
                                "logit_shift": cfg.logit_shift}
    assert preset.source.startswith("~/models/")
    assert "cannot download" in preset.note and "hub id" in preset.note

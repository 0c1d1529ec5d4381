"""Checkpoint families read natively: a tiny random instance saved in the published key layout and config.json
format, loaded by the engine, against `transformers` driven with the attention the family was trained with."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from studio.engine.engine import Engine
from studio.engine.families import read_config
from studio.engine.masks import bidirectional, causal
from studio.engine.model import Transformer
from studio.engine.strategies import make_strategy
from studio.engine.weights import load_hf_dir
from studio.errors import BadInput
from studio.run.session import Settings, kv_length_needed, run_to_end
from tests.support.hf_files import LLADA2_CONFIG, llada2_checkpoint, per_expert_tensors, write_checkpoint

# -- LLaDA dense ------------------------------------------------------------------------------------
LLADA_CONFIG = {   # GSAI-ML/LLaDA-8B-Instruct's config.json keys, tiny sizes
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 64, "n_layers": 2, "n_heads": 4,
    "n_kv_heads": 4, "mlp_hidden_size": 96, "mlp_ratio": 4, "vocab_size": 40, "embedding_size": 40,
    "rope": True, "rope_theta": 500000.0, "rope_full_precision": True, "rms_norm_eps": 1e-5,
    "max_sequence_length": 128, "weight_tying": False, "block_type": "llama", "activation_type": "silu",
    "layer_norm_type": "rms", "alibi": False, "include_bias": False, "include_qkv_bias": False,
    "bias_for_layer_norm": False, "attention_layer_norm": False, "input_emb_norm": False, "scale_logits": False,
    "flash_attention": False, "mask_token_id": 39, "eos_token_id": 2, "pad_token_id": 2, "use_cache": False}
# the published tensor names -> transformers' Llama names (the oracle's side)
LLADA_TO_LLAMA = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                  "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj",
                  "ff_norm": "post_attention_layernorm", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                  "ff_out": "mlp.down_proj"}


def llada_checkpoint(path, dtype=torch.float32, seed=0):
    """A tiny LLaDA directory as published (config.json, model.safetensors, tokenizer); returns its tensors."""
    c = LLADA_CONFIG
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.2).to(dtype)   # noqa: E731
    norm = lambda: (torch.rand(c["d_model"], generator=g) + 0.5).to(dtype)     # noqa: E731 (not ones: a mix-up shows)
    d, f, v = c["d_model"], c["mlp_hidden_size"], c["embedding_size"]
    sd = {"model.transformer.wte.weight": rand(v, d), "model.transformer.ln_f.weight": norm(),
          "model.transformer.ff_out.weight": rand(v, d)}
    for i in range(c["n_layers"]):
        b = f"model.transformer.blocks.{i}."
        sd.update({b + "attn_norm.weight": norm(), b + "ff_norm.weight": norm(), b + "q_proj.weight": rand(d, d),
                   b + "k_proj.weight": rand(d, d), b + "v_proj.weight": rand(d, d), b + "attn_out.weight": rand(d, d),
                   b + "ff_proj.weight": rand(f, d), b + "up_proj.weight": rand(f, d), b + "ff_out.weight": rand(d, f)})
    write_checkpoint(path, c, sd)
    return sd


def llama_oracle(sd):
    """transformers' Llama with LLaDA's weights: the same block, which LLaDA runs without a causal mask."""
    import transformers as tf
    c = LLADA_CONFIG
    cfg = tf.LlamaConfig(vocab_size=c["embedding_size"], hidden_size=c["d_model"], intermediate_size=c["mlp_hidden_size"],
                         num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
                         num_key_value_heads=c["n_kv_heads"], max_position_embeddings=c["max_sequence_length"],
                         rope_theta=c["rope_theta"], rms_norm_eps=c["rms_norm_eps"], tie_word_embeddings=False)
    hf = tf.LlamaForCausalLM(cfg).eval()
    names = {"model.transformer.wte.weight": "model.embed_tokens.weight",
             "model.transformer.ln_f.weight": "model.norm.weight", "model.transformer.ff_out.weight": "lm_head.weight"}
    for key in sd:
        if key.startswith("model.transformer.blocks."):
            i, part = key.split(".")[3:5]
            names[key] = f"model.layers.{i}.{LLADA_TO_LLAMA[part]}.weight"
    hf.load_state_dict({names[k]: v.float() for k, v in sd.items()})
    return hf


def ours(path) -> Transformer:
    cfg, sd, _ = load_hf_dir(path)
    model = Transformer(cfg).eval()
    model.load_state_dict(sd)
    return model


def full_forward(model: Transformer, ids: list[int], mask) -> torch.Tensor:
    kv = model.new_cache(64)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), kv, mask=mask)[0]


IDS = [5, 17, 3, 39, 39, 39, 22, 39]   # a prompt, then a canvas with MASKs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llada_loads_as_published_and_matches_llama_run_bidirectionally(tmp_path, dtype):
    sd = llada_checkpoint(tmp_path / "llada", dtype)
    model = ours(tmp_path / "llada")
    cfg = model.config
    assert (cfg.attention, cfg.logit_shift, cfg.mask_token_id, cfg.eos_ids) == ("bidirectional", False, 39, [2])
    hf = llama_oracle(sd)
    T = len(IDS)
    with torch.no_grad():
        want = hf(torch.tensor([IDS]), attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool)).logits[0]
        want_causal = hf(torch.tensor([IDS])).logits[0]
    got = full_forward(model, IDS, bidirectional(T, 0))
    assert (got - want).abs().max().item() <= 1e-4
    # the attention is the run's: a causal mask gives the causal forward of the same weights
    assert (full_forward(model, IDS, causal(T, 0)) - want_causal).abs().max().item() <= 1e-4
    assert (got - want_causal).abs().max().item() > 1e-2


def test_bidirectional_kv_cached_for_a_canvas_state_gives_that_forwards_logits(tmp_path):
    """K/V of the prompt computed by a full forward over prompt + canvas, then the canvas forwarded again against
    them (same canvas state): its logits are the full forward's. The ground approximate caches stand on."""
    llada_checkpoint(tmp_path / "llada")
    model = ours(tmp_path / "llada")
    T, P = len(IDS), 3
    kv = model.new_cache(64)
    with torch.inference_mode():
        full = model(torch.tensor(IDS), torch.arange(T), kv, mask=bidirectional(T, 0))[0]
        kv.commit(P)                                    # keep the prompt's K/V (computed seeing the canvas)
        canvas = model(torch.tensor(IDS[P:]), torch.arange(P, T), kv, mask=bidirectional(T - P, P))[0]
    torch.testing.assert_close(canvas, full[P:], atol=1e-5, rtol=0)


def test_a_bidirectional_forward_runs_through_the_decode_context_and_causal_strategies_refuse(tmp_path):
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies.base import DecodeContext, Output
    sd = llada_checkpoint(tmp_path / "llada")
    engine = Engine.load(str(tmp_path / "llada"), device="cpu")
    T = len(IDS)
    ctx = DecodeContext(engine.model, engine.tokenizer, SamplingParams(), 0, Output(engine.tokenizer, 8, frozenset(), ()),
                        engine.config.mask_token_id, 64)
    logits = ctx.forward("prefill", IDS, mask=bidirectional(T, 0, ctx.device))
    with torch.no_grad():
        want = llama_oracle(sd)(torch.tensor([IDS]), attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool)).logits[0]
    assert (logits - want).abs().max().item() <= 1e-4
    assert ctx.drain()[0]["role"] == "prefill"
    settings = Settings(max_new_tokens=4)
    for name in ("isd", "r-isd", "jacobi", "jacobi-mr"):
        with pytest.raises(BadInput, match=r"needs a causal model .* bidirectional attention; strategies that fit: "
                                           r"blockdiff, canvas, s2d2, simsd"):
            kv_length_needed(engine, make_strategy(name), settings, IDS[:3])
    with pytest.raises(BadInput, match=r"position-aligned logits: it has no AR mode .* strategies that fit: blockdiff"):
        kv_length_needed(engine, make_strategy("ar"), settings, IDS[:3])
    run = run_to_end(engine, make_strategy("blockdiff", {"block_size": 4}), settings, "", IDS[:3])
    assert run.footer["n_tokens"] == 4 and make_strategy("blockdiff").causal_kv(engine.config) is False


@pytest.mark.parametrize("change,needle", [({"alibi": True}, "alibi = True"),
                                           ({"attention_layer_norm": True}, "attention_layer_norm"),
                                           ({"d_model": None}, "missing required key 'd_model'")])
def test_a_llada_config_the_model_cannot_run_is_one_line(tmp_path, change, needle):
    llada_checkpoint(tmp_path / "llada")
    raw = {**LLADA_CONFIG, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    (tmp_path / "llada" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(BadInput, match=needle) as e:
        load_hf_dir(tmp_path / "llada")
    assert "\n" not in str(e.value)


def test_an_unknown_tensor_in_a_llada_checkpoint_is_one_line(tmp_path):
    sd = llada_checkpoint(tmp_path / "llada")
    save_file({**sd, "model.transformer.blocks.0.att_proj.weight": torch.zeros(2)}, str(tmp_path / "llada" / "model.safetensors"))
    with pytest.raises(BadInput, match="unexpected tensor 'model.transformer.blocks.0.att_proj.weight'"):
        load_hf_dir(tmp_path / "llada")


def test_models_info_names_the_family_attention_and_alignment_and_the_preset_agrees(tmp_path):
    from typer.testing import CliRunner

    from studio.cli import app
    from studio.presets import load_model_preset
    llada_checkpoint(tmp_path / "llada")
    out = CliRunner().invoke(app, ["models", "info", str(tmp_path / "llada")])
    assert out.exit_code == 0, out.output
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.stdout.splitlines() if ":" in line}
    assert lines["family"] == "llada (llama block)" and lines["attention"].startswith("bidirectional")
    assert lines["logit shift"].startswith("False") and "position-aligned" in lines["logit shift"]
    assert lines["mask token"] == "39"
    published = dict(LLADA_CONFIG, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
                     vocab_size=126464, embedding_size=126464, mask_token_id=126336)
    cfg, preset = read_config(published), load_model_preset("llada-8b-instruct")
    assert preset.overrides == {"mask_token_id": cfg.mask_token_id, "logit_shift": cfg.logit_shift, "block_size": 32}


# -- Dream ------------------------------------------------------------------------------------------
def dream_checkpoint(path):
    """A tiny Dream directory as published (Qwen2 keys and tensor names under DreamModel); returns the oracle:
    transformers' Qwen2 with the same weights."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf = tf.Qwen2ForCausalLM(cfg).eval()
    sd = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    for k in sd:   # random norms (transformers starts them at one, which would hide a mix-up)
        if k.endswith("norm.weight"):
            sd[k] = torch.rand_like(sd[k]) + 0.5
    hf.load_state_dict(sd)
    raw = dict(cfg.to_dict(), architectures=["DreamModel"], model_type="Dream", mask_token_id=39,
               use_sliding_window=False, eos_token_id=2)
    write_checkpoint(path, raw, sd)
    return hf


def test_dream_loads_as_published_and_matches_qwen2_run_bidirectionally(tmp_path):
    hf = dream_checkpoint(tmp_path / "dream")
    model = ours(tmp_path / "dream")
    cfg = model.config
    assert (cfg.family, cfg.arch, cfg.attention, cfg.logit_shift, cfg.mask_token_id) == \
        ("dream", "qwen2", "bidirectional", True, 39)
    T = len(IDS)
    with torch.no_grad():
        want = hf(torch.tensor([IDS]), attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool)).logits[0]
    assert (full_forward(model, IDS, bidirectional(T, 0)) - want).abs().max().item() <= 1e-4


# -- LLaDA-MoE --------------------------------------------------------------------------------------
LLADA_MOE_CONFIG = {   # inclusionAI/LLaDA-MoE-7B-A1B's config.json keys, tiny sizes
    "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 6, "num_experts_per_tok": 2,
    "expert_intermediate_size": 24, "dense_intermediate_size": 64, "moe_layer_freq": [1, 1], "vocab_size": 40,
    "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "qk_layernorm": True,
    "partial_rotary_factor": 1.0, "shared_expert_intermediate_size": None, "moe_router_enable_expert_bias": None,
    "norm_topk_prob": True, "tie_word_embeddings": False, "mask_token_id": 39, "eos_token_id": 2}


def llada_moe_checkpoint(path, seed=0):
    """A tiny LLaDA-MoE directory with one tensor per expert, as published; returns its tensors."""
    c = LLADA_MOE_CONFIG
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.3            # noqa: E731
    norm = lambda n: torch.rand(n, generator=g) + 0.5                       # noqa: E731
    d, f, v, hd = c["hidden_size"], c["expert_intermediate_size"], c["vocab_size"], c["hidden_size"] // c["num_attention_heads"]
    sd = {"model.embed_tokens.weight": rand(v, d), "model.norm.weight": norm(d), "lm_head.weight": rand(v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                   p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                   p + "mlp.gate.weight": rand(c["num_experts"], d)})
        for proj in "qkvo":
            sd[p + f"self_attn.{proj}_proj.weight"] = rand(d, d)
        sd.update(per_expert_tensors(p, c["num_experts"], f, d, rand))
    write_checkpoint(path, c, sd)
    return sd


def llada_moe_reference(sd, ids: list[int]) -> torch.Tensor:
    """LLaDA-MoE's forward written plainly from its description: no mask at all, per-head QK RMSNorm before
    rotate-half RoPE, and for each token separately its top-k experts by softmax probability (not renormalised)."""
    c = LLADA_MOE_CONFIG
    H, d = c["num_attention_heads"], c["hidden_size"]
    hd, eps, T = d // H, c["rms_norm_eps"], len(ids)

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(T).float()[:, None] * inv[None]                     # [T, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)

    def rope(x):                                                            # x [T, H, hd]
        half = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos[:, None] + half * sin[:, None]

    x = sd["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q, k, v = (h @ sd[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        q = rope(rms(q.view(T, H, hd), sd[p + "self_attn.q_norm.weight"]))
        k = rope(rms(k.view(T, H, hd), sd[p + "self_attn.k_norm.weight"]))
        v = v.view(T, H, hd)
        att = torch.softmax(torch.einsum("thd,shd->hts", q, k) / hd ** 0.5, -1)
        x = x + torch.einsum("hts,shd->thd", att, v).reshape(T, d) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        moe = torch.zeros_like(x)
        for t in range(T):
            probs = torch.softmax(h[t] @ sd[p + "mlp.gate.weight"].T, -1)
            top = probs.topk(c["num_experts_per_tok"])
            for w, e in zip(top.values, top.indices.tolist()):
                e_ = f"{p}mlp.experts.{e}."
                a = torch.nn.functional.silu(h[t] @ sd[e_ + "gate_proj.weight"].T) * (h[t] @ sd[e_ + "up_proj.weight"].T)
                moe[t] += w * (a @ sd[e_ + "down_proj.weight"].T)
        x = x + moe
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def test_llada_moe_loads_as_published_and_matches_a_plain_reference_forward(tmp_path):
    sd = llada_moe_checkpoint(tmp_path / "moe")
    model = ours(tmp_path / "moe")
    cfg = model.config
    assert (cfg.family, cfg.attention, cfg.logit_shift, cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_renormalize) == \
        ("llada-moe", "bidirectional", False, 6, 2, False)     # norm_topk_prob in config.json is dead in its code
    ids = [5, 17, 3, 39, 39, 39, 22, 39, 8, 11, 39]
    got = full_forward(model, ids, bidirectional(len(ids), 0))
    assert (got - llada_moe_reference(sd, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("change,needle", [({"moe_layer_freq": [0, 1]}, "dense layers"),
                                           ({"shared_expert_intermediate_size": 16}, "shared expert"),
                                           ({"partial_rotary_factor": 0.5}, "partial_rotary_factor")])
def test_a_llada_moe_variant_the_model_cannot_run_is_one_line(tmp_path, change, needle):
    llada_moe_checkpoint(tmp_path / "moe")
    (tmp_path / "moe" / "config.json").write_text(json.dumps({**LLADA_MOE_CONFIG, **change}))
    with pytest.raises(BadInput, match=needle):
        load_hf_dir(tmp_path / "moe")


# -- LLaDA2 -----------------------------------------------------------------------------------------
def llada2_reference(sd, ids: list[int], block: int) -> torch.Tensor:
    """LLaDA2's forward written plainly from its description: fused QKV split by heads, per-head QK norm, RoPE on
    the first rotary_dim dims only, block-causal attention on a grid from position 0, layer 0 dense, then for each
    token separately: sigmoid scores, +bias for the choice, the best groups by their top-2 sum, top k, the unbiased
    scores normalised and scaled, plus the shared expert."""
    c = LLADA2_CONFIG
    H, KV, hd, rd, T = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rotary_dim"], len(ids)
    silu = torch.nn.functional.silu

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + c["rms_norm_eps"]))

    def swiglu(h, prefix):
        return (silu(h @ sd[prefix + "gate_proj.weight"].T) * (h @ sd[prefix + "up_proj.weight"].T)) @ sd[prefix + "down_proj.weight"].T

    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, rd, 2).float() / rd)
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]

    def rope(x):   # x [T, heads, hd]: the first rd dims turn
        r, rest = x[..., :rd], x[..., rd:]
        half = torch.cat([-r[..., rd // 2:], r[..., :rd // 2]], -1)
        return torch.cat([r * cos + half * sin, rest], -1)

    blk = torch.arange(T) // block
    allowed = blk[None, :] <= blk[:, None]
    x = sd["model.word_embeddings.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        qkv = (h @ sd[p + "attention.query_key_value.weight"].T).view(T, H + 2 * KV, hd)
        q, k, v = qkv[:, :H], qkv[:, H:H + KV], qkv[:, H + KV:]
        q = rope(rms(q, sd[p + "attention.query_layernorm.weight"]))
        k = rope(rms(k, sd[p + "attention.key_layernorm.weight"]))
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
        att = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        x = x + torch.einsum("hts,shd->thd", att, v).reshape(T, H * hd) @ sd[p + "attention.dense.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        if i < c["first_k_dense_replace"]:
            x = x + swiglu(h, p + "mlp.")
            continue
        out = swiglu(h, p + "mlp.shared_experts.")
        for t in range(T):
            s = torch.sigmoid(h[t] @ sd[p + "mlp.gate.weight"].T)
            choice = (s + sd[p + "mlp.gate.expert_bias"]).view(c["n_group"], -1)
            groups = choice.topk(2, dim=-1).values.sum(-1).topk(c["topk_group"]).indices.tolist()
            candidates = [(choice[g, j].item(), g * choice.shape[1] + j) for g in groups for j in range(choice.shape[1])]
            chosen = [e for _, e in sorted(candidates, reverse=True)[:c["num_experts_per_tok"]]]
            w = s[chosen] / (s[chosen].sum() + 1e-20) * c["routed_scaling_factor"]
            for wt, e in zip(w, chosen):
                out[t] = out[t] + wt * swiglu(h[t], f"{p}mlp.experts.{e}.")
        x = x + out
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


LLADA2_IDS = [5, 17, 3, 8, 21, 30, 11, 4, 39, 39, 39, 39]   # three blocks of 4: prompt, prompt, canvas


def test_llada2_loads_as_published_and_matches_a_plain_reference_forward_block_causal_from_position_0(tmp_path):
    from studio.engine.masks import block_causal
    sd = llada2_checkpoint(tmp_path / "l2")
    model = ours(tmp_path / "l2")
    cfg = model.config
    assert (cfg.family, cfg.attention, cfg.logit_shift, cfg.rotary_dim, cfg.first_dense_layers, cfg.moe_router) == \
        ("llada2", "block", False, 4, 1, "sigmoid")
    T = len(LLADA2_IDS)
    got = full_forward(model, LLADA2_IDS, block_causal(T, 0, 4))
    assert (got - llada2_reference(sd, LLADA2_IDS, block=4)).abs().max().item() <= 1e-4
    # the block-causal prefix cached, the last block recomputed against it: the same logits
    kv = model.new_cache(64)
    with torch.inference_mode():
        model(torch.tensor(LLADA2_IDS[:8]), torch.arange(8), kv, mask=block_causal(8, 0, 4))
        kv.commit(8)
        last = model(torch.tensor(LLADA2_IDS[8:]), torch.arange(8, T), kv, mask=block_causal(4, 8, 4))[0]
    torch.testing.assert_close(last, got[8:], atol=1e-5, rtol=0)


def test_blockdiff_decodes_a_tiny_llada2_end_to_end_with_block_attention(tmp_path):
    llada2_checkpoint(tmp_path / "l2")
    engine = Engine.load(str(tmp_path / "l2"), device="cpu")
    strategy = make_strategy("blockdiff", {"block_size": 4})
    assert strategy.causal_kv(engine.config) is False           # auto: the block cache on a block-trained model
    result = run_to_end(engine, strategy, Settings(max_new_tokens=8), "", LLADA2_IDS[:6])
    assert result.footer["n_tokens"] == 8 and result.footer["forwards"] >= 2
    assert {e["role"] for e in result.events if e["t"] == "forward"} >= {"prefill", "draft", "commit"}
    with pytest.raises(BadInput, match="block attention; strategies that fit"):
        kv_length_needed(engine, make_strategy("isd"), Settings(max_new_tokens=4), LLADA2_IDS[:3])


def test_a_llada2_checkpoint_whose_fused_qkv_disagrees_with_its_config_is_one_line(tmp_path):
    sd = llada2_checkpoint(tmp_path / "l2")
    sd["model.layers.0.attention.query_key_value.weight"] = torch.zeros(10, 32)
    save_file(sd, str(tmp_path / "l2" / "model.safetensors"))
    with pytest.raises(BadInput, match="query_key_value has 10 rows, the config implies 64"):
        load_hf_dir(tmp_path / "l2")


def test_an_moe_step_streams_only_its_active_experts_and_is_timed_against_a_dense_twin(tmp_path):
    from studio.engine.forward_cost import moe_vs_dense, weight_bytes
    llada2_checkpoint(tmp_path / "l2")
    engine = Engine.load(str(tmp_path / "l2"), device="cpu")
    c = LLADA2_CONFIG
    every = sum(p.numel() * 4 for p in engine.model.parameters())
    n_moe = c["num_hidden_layers"] - c["first_k_dense_replace"]
    unread = n_moe * 3 * c["moe_intermediate_size"] * c["hidden_size"] * (c["num_experts"] - c["num_experts_per_tok"]) * 4
    assert weight_bytes(engine) == every - unread
    assert moe_vs_dense(engine, repeats=3) > 0


def peft_adapter(path, sd, keys, r, alpha, targets, g):
    """A PEFT LoRA directory on the checkpoint weights `keys` of `sd` (their published names); returns it and the
    merged weights W + alpha/r·B·A the adapted forward must equal."""
    lora, merged = {}, dict(sd)
    for key in keys:
        A, B = torch.randn(r, sd[key].shape[1], generator=g) * 0.1, torch.randn(sd[key].shape[0], r, generator=g) * 0.1
        lora[f"base_model.model.{key.removesuffix('.weight')}.lora_A.weight"] = A
        lora[f"base_model.model.{key.removesuffix('.weight')}.lora_B.weight"] = B
        merged[key] = sd[key] + alpha / r * B @ A
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                         "target_modules": targets}))
    save_file(lora, str(path / "adapter_model.safetensors"))
    return str(path), merged


def test_a_peft_adapter_trained_on_llada_loads_under_its_module_names(tmp_path):
    """An adapter for LLaDA names LLaDA's modules (`model.transformer.blocks.{i}.attn_out`, target `ff_proj`...): it
    attaches, and the adapted forward equals the base forward of merged weights W + scale·B·A."""
    sd = llada_checkpoint(tmp_path / "llada")
    g = torch.Generator().manual_seed(3)
    r, alpha, targets = 4, 8, ["q_proj", "attn_out", "ff_proj", "ff_out"]
    keys = [f"model.transformer.blocks.{i}.{t}.weight" for i in range(LLADA_CONFIG["n_layers"]) for t in targets]
    adapter, merged = peft_adapter(tmp_path / "ad", sd, keys, r, alpha, targets, g)
    engine = Engine.load(str(tmp_path / "llada"), adapter=adapter, device="cpu")
    T = len(IDS)
    with torch.inference_mode():
        got = engine.model(torch.tensor(IDS), torch.arange(T), engine.model.new_cache(64), mask=bidirectional(T, 0),
                           lora_gate=torch.ones(T, dtype=torch.bool))[0]
        want = llama_oracle(merged)(torch.tensor([IDS]), attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool)).logits[0]
    assert (got - want).abs().max().item() <= 1e-4


def test_a_peft_adapter_on_llada2s_fused_qkv_attaches_as_q_k_v_loras(tmp_path):
    """LLaDA2's LoRA on `attention.query_key_value` (one A, B over the fused q|k|v rows), on `attention.dense` and on
    the dense layer's MLP: the adapted forward equals the reference forward of the merged weights W + scale·B·A."""
    from studio.engine.masks import block_causal
    sd = llada2_checkpoint(tmp_path / "l2")
    g = torch.Generator().manual_seed(5)
    r, alpha, targets = 2, 4, ["query_key_value", "dense", "gate_proj"]
    keys = [k for k in sd if k.endswith(("query_key_value.weight", "dense.weight"))] + ["model.layers.0.mlp.gate_proj.weight"]
    adapter, merged = peft_adapter(tmp_path / "ad", sd, keys, r, alpha, targets, g)
    engine = Engine.load(str(tmp_path / "l2"), adapter=adapter, device="cpu")
    T = len(LLADA2_IDS)
    with torch.inference_mode():
        got = engine.model(torch.tensor(LLADA2_IDS), torch.arange(T), engine.model.new_cache(64),
                           mask=block_causal(T, 0, 4), lora_gate=torch.ones(T, dtype=torch.bool))[0]
    want = llada2_reference(merged, LLADA2_IDS, block=4)
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - llada2_reference(sd, LLADA2_IDS, block=4)).abs().max().item() > 1e-2   # the adapter matters


def test_forward_events_of_an_moe_model_say_how_many_experts_each_layer_ran(tmp_path):
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies.base import DecodeContext, Output
    from studio.events import validate_event
    llada_moe_checkpoint(tmp_path / "moe")
    engine = Engine.load(str(tmp_path / "moe"), device="cpu")
    ctx = DecodeContext(engine.model, engine.tokenizer, SamplingParams(), 0, Output(engine.tokenizer, 8, frozenset(), ()),
                        engine.config.mask_token_id, 64)
    ctx.forward("prefill", IDS, mask=bidirectional(len(IDS), 0))
    ctx.commit(len(IDS))
    ctx.forward("draft", [39], mask=bidirectional(1, len(IDS)))
    wide, one = [e for e in ctx.drain() if e["t"] == "forward"]
    c = LLADA_MOE_CONFIG
    assert len(one["experts"]) == c["num_hidden_layers"] and all(n == c["num_experts_per_tok"] for n in one["experts"])
    assert all(c["num_experts_per_tok"] <= n <= c["num_experts"] for n in wide["experts"]) and sum(wide["experts"]) > sum(one["experts"])
    validate_event(wide)

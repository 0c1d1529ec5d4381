"""The DFlash drafter: the published layout read natively, its forward against a plainly written reference of the
published algorithm (the context's K/V kept across two steps), the taps against Hugging Face's hidden states."""
import json

import pytest
import torch

from studio.engine.dflash import DrafterConfig, default_taps, is_drafter_dir, load_drafter, save_drafter
from studio.engine.taps import LayerTaps
from studio.errors import BadInput
from tests.support.dflash import tiny_drafter
from tests.support.tiny import hf_pair, tiny_engine


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, pos, theta, hd):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference(w: dict, cfg: DrafterConfig, context, noise, positions):
    """The published forward, plainly: context [C, taps*D] -> fc -> hidden_norm gives every layer's context keys and
    values; the block's rows [T, D] give queries, keys and values; no mask; the final norm."""
    m = cfg.layers
    C, T = context.shape[0], noise.shape[0]
    ctx = _rms(context @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = noise
    for i in range(m.n_layers):
        p = lambda name: w[f"layers.{i}.{name}.weight"]   # noqa: E731
        x = _rms(h, p("input_layernorm"))
        rows = torch.cat([ctx, x])
        q = (x @ p("self_attn.q_proj").T).view(T, m.n_heads, m.head_dim)
        k = (rows @ p("self_attn.k_proj").T).view(C + T, m.n_kv_heads, m.head_dim)
        v = (rows @ p("self_attn.v_proj").T).view(C + T, m.n_kv_heads, m.head_dim)
        q, k = _rms(q, p("self_attn.q_norm")), _rms(k, p("self_attn.k_norm"))
        group = m.n_heads // m.n_kv_heads
        out = []
        for head in range(m.n_heads):
            qh = _rotate(q[:, head], positions[C:], m.rope_theta, m.head_dim)
            kh = _rotate(k[:, head // group], positions, m.rope_theta, m.head_dim)
            att = torch.softmax(qh @ kh.T / m.head_dim ** 0.5, -1)
            out.append(att @ v[:, head // group])
        h = h + torch.cat(out, -1) @ p("self_attn.o_proj").T
        x = _rms(h, p("post_attention_layernorm"))
        h = h + (torch.nn.functional.silu(x @ p("mlp.gate_proj").T) * (x @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    return _rms(h, w["norm.weight"])


def test_the_published_layout_loads_and_matches_the_reference_forward_across_two_steps(tmp_path):
    from safetensors.torch import load_file

    engine = tiny_engine("qwen3", vocab=16)
    tiny_drafter(engine, tmp_path / "d", layers=2, block=4)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["dflash_config"] == {"target_layer_ids": [0, 1], "mask_token_id": 15} and is_drafter_dir(tmp_path / "d")
    drafter = load_drafter(tmp_path / "d")
    w = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "fc.weight" in w and "layers.1.self_attn.k_norm.weight" in w and "norm.weight" in w
    torch.manual_seed(0)
    D = engine.config.dim
    context = torch.randn(8, 2 * D)
    kv = drafter.new_cache(32)
    B = drafter.config.block_size
    with torch.no_grad():
        for seen, upto in ((0, 5), (5, 8)):   # the second step sends only the new context rows
            noise = torch.randn(B, D)
            positions = torch.arange(upto + B)
            got = drafter(context[None, seen:upto], noise[None], positions[None, seen:], kv=kv)[0]
            want = reference(w, drafter.config, context[:upto], noise, positions)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert kv.length == upto   # the context kept, the block not


def test_taps_are_hugging_face_s_hidden_states_after_each_layer():
    hf, ours = hf_pair("qwen3", num_hidden_layers=3)   # (HF's last hidden state is after the final norm: not a tap)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    want = hf(ids, output_hidden_states=True).hidden_states
    with LayerTaps(ours, [0, 1]) as taps, torch.no_grad():
        ours(ids[0], torch.arange(8), ours.new_cache(16))
        got = taps.take()
    torch.testing.assert_close(got, torch.cat([want[1], want[2]], -1), atol=1e-4, rtol=1e-4)


def test_default_taps_follow_the_published_rule():
    assert default_taps(36, 5) == [1, 9, 17, 25, 33]   # Qwen3-8B's five-layer drafter
    assert default_taps(30, 1) == [15]


def test_bad_drafters_are_one_line(tmp_path):
    engine = tiny_engine("qwen3", vocab=16)
    tiny_drafter(engine, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    cases = {"no mask": ({**raw, "dflash_config": {"target_layer_ids": [0]}}, "no 'mask_token_id'"),
             "sliding": ({**raw, "layer_types": ["sliding_attention"]}, "sliding-window"),
             "not dflash": ({**raw, "architectures": ["LlamaForCausalLM"]}, "not a DFlash drafter")}
    for name, (config, needle) in cases.items():
        (tmp_path / "d" / "config.json").write_text(json.dumps(config))
        with pytest.raises(BadInput, match=needle):
            load_drafter(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    with pytest.raises(BadInput, match="missing tensor 'layers.1"):
        load_drafter(tmp_path / "d")
    with pytest.raises(BadInput, match="needs config.json and model.safetensors"):
        load_drafter(tmp_path)
    wide = DrafterConfig.from_json({**raw, "hidden_size": 64})
    with pytest.raises(BadInput, match="64 wide"):
        wide.check_target(engine.config, "tiny")
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    for vocab, needle in ((torch.tensor([3, 1, 3]), "distinct"), (torch.tensor([[1, 2]]), "1-D tensor of token ids"),
                          (torch.tensor([2, 16]), "token 16, outside 'tiny'")):
        drafter = tiny_drafter(engine, tmp_path / "v")
        drafter.vocab = vocab   # written as it is
        save_drafter(drafter, tmp_path / "v", engine.config.n_layers)
        with pytest.raises(BadInput, match=needle):
            loaded = load_drafter(tmp_path / "v")
            loaded.config.check_target(engine.config, "tiny", loaded.vocab)


def test_a_draft_vocabulary_is_saved_and_read_back_sorted(tmp_path):
    engine = tiny_engine("qwen3", vocab=16)
    tiny_drafter(engine, tmp_path / "d", vocab=[9, 2, 5])
    assert load_drafter(tmp_path / "d").vocab.tolist() == [2, 5, 9]
    tiny_drafter(engine, tmp_path / "all")
    assert load_drafter(tmp_path / "all").vocab is None

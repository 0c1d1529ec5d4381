"""--device / --dtype and the shape-only `random:` models, on tiny models (the CUDA tests run only where torch
sees a GPU)."""
from __future__ import annotations

import sys

import pytest
import torch

from studio.cli import main
from studio.engine.device import available_cores, cpu_threads, resolve_device, resolve_dtype
from studio.engine.engine import Engine, to_device
from studio.engine.model import Transformer, rope_inv_freq
from studio.engine.random_models import SHAPES, build_random, random_config
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.errors import BadInput
from studio.events import read_trace
from studio.run.session import Run, Settings, prepare, run_to_end
from tests.support.adapters import random_mask_adapter
from tests.support.dlm import generate
from tests.support.tiny import tiny_dlm, tiny_engine

# a qwen3 (q/k norms, explicit head_dim, tied head) small enough to build and run in milliseconds
TINY_SHAPE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
              "rope_theta": 1000000.0, "tie_word_embeddings": True, "max_position_embeddings": 512}


def cuda_only(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@pytest.fixture
def tiny_random(monkeypatch):
    """`random:tiny` = TINY_SHAPE, for this test only."""
    monkeypatch.setitem(SHAPES, "tiny", TINY_SHAPE)
    return "random:tiny"


def _unique_params(model) -> list[torch.Tensor]:
    return list({id(p): p for p in model.parameters()}.values())


# -- resolving the flags -------------------------------------------------------------------------------
def test_auto_picks_cpu_fp32_without_cuda_and_bf16_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp16", torch.device("cpu")) == torch.float16
    for bad in (lambda: resolve_device("cuda"), lambda: resolve_device("tpu"),
                lambda: resolve_dtype("fp8", torch.device("cpu"))):
        with pytest.raises(BadInput):
            bad()


@pytest.mark.parametrize("args, needle", [
    (["--device", "cuda"], "no CUDA device"),
    (["--dtype", "fp8"], "--dtype must be one of"),
    (["--model", "random:gpt-9"], "random:smollm2-135m, random:qwen3-0.6b, random:qwen3-8b, random:llama3-8b"),
])
def test_bad_device_dtype_or_random_name_is_one_line_exit_2(monkeypatch, capsys, args, needle):
    """Checked before any weights load (none of these reads a model file)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["dlm-studio", "run", "hi", "-s", "ar", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


# -- moving and casting a loaded model -----------------------------------------------------------------
def test_to_device_casts_the_weights_keeps_rope_fp32_and_the_tied_head(tmp_path):
    engine = tiny_engine("llama", vocab=16, tie_embeddings=True)
    rope = engine.model.inv_freq.clone()
    to_device(engine.model, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.model.inv_freq.dtype == torch.float32 and torch.equal(engine.model.inv_freq, rope)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    # an adapter attaches in the model's dtype, and a run with it works
    view = engine.with_adapter(str(random_mask_adapter(tmp_path / "a", engine.model)))
    assert view.lora.modules["model.layers.0.self_attn.q_proj"][0].dtype == torch.bfloat16
    assert view.lora.rows.dtype == torch.bfloat16
    r = run_to_end(view, make_strategy("r-isd", {"stride": 3}), Settings(max_new_tokens=12), "", [1, 2, 3])
    assert r.footer["n_tokens"] == 12


@pytest.mark.parametrize("dtype, recorded", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_trace_header_records_device_and_dtype_of_a_greedy_ar_run(tiny_random, tmp_path, dtype, recorded):
    engine = Engine.load(tiny_random, device="cpu", dtype=dtype)
    assert {p.dtype for p in engine.model.parameters()} == {getattr(torch, recorded)}
    trace = tmp_path / "t.jsonl"
    r = run_to_end(engine, make_strategy("ar"), Settings(max_new_tokens=10), "hi", engine.tokenizer.encode("hi"),
                                                                            trace_path=str(trace))
    model = read_trace(trace).header["model"]
    assert (model["device"], model["dtype"], model["name"]) == ("cpu", recorded, "random:tiny")
    # no EOS: the run goes to the limit; ids read back as <id>
    assert r.footer["n_tokens"] == 10 and r.footer["text"] == "".join(f"<{t}>" for t in r.token_ids)


# -- random: models ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, n_params", [("smollm2-135m", 134_515_008), ("qwen3-0.6b", 596_049_920),
                                            ("qwen3-8b", 8_190_735_360), ("llama3-8b", 8_030_261_248),
                                            ("llada-8b", 16_031_162_368 // 2),   # its index's bf16 total_size
                                            ("dream-7b", 7_615_616_512)])         # Qwen2.5-7B's
def test_random_shapes_have_the_published_parameter_counts(name, n_params):
    with torch.device("meta"):   # shapes only: nothing is allocated
        model = Transformer(random_config(f"random:{name}"))
    assert sum(p.numel() for p in _unique_params(model)) == n_params


def test_a_random_shape_may_keep_only_its_first_layers():
    with torch.device("meta"):   # the whole 100B-class shape exists; @L is how it fits a machine
        assert sum(p.numel() for p in _unique_params(Transformer(random_config("random:llada2-flash")))) > 100e9
    c = random_config("random:llada2-mini@2")
    assert (c.n_layers, c.n_experts, c.first_dense_layers, c.name) == (2, 256, 1, "random:llada2-mini@2")
    with pytest.raises(BadInput, match="the layer count after @ must be 1..20"):
        random_config("random:llada2-mini@0")


def test_random_smollm2_is_the_embedded_models_shape():
    c = random_config("random:smollm2-135m")
    assert (c.arch, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        ("llama", 576, 30, 9, 3, 64, 1536, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert c.eos_ids == [] and c.mask_token_id == c.vocab_size - 1


def test_build_random_places_seeded_small_weights(tiny_random):
    cfg = random_config(tiny_random)
    model = build_random(cfg, torch.device("cpu"), torch.bfloat16, seed=0)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, rope_inv_freq(cfg))
    assert all(bool((p == 1).all()) for n, p in params.items() if p.dim() == 1)   # norm gains (and q/k norms)
    assert abs(params["model.layers.0.mlp.up_proj.weight"].float().std().item() - 0.02) < 0.002
    again = build_random(cfg, torch.device("cpu"), torch.bfloat16, seed=0)
    other = build_random(cfg, torch.device("cpu"), torch.bfloat16, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_random_model_runs_every_kind_of_strategy(tiny_random):
    """The MASK id lets isd run; the byte tokenizer encodes any prompt."""
    engine = Engine.load(tiny_random, device="cpu", dtype="bf16")
    ids = engine.tokenizer.encode("héllo")
    assert ids == list("héllo".encode()) and engine.eos_ids() == []
    for name in ("ar", "isd", "jacobi"):
        r = run_to_end(engine, make_strategy(name), Settings(max_new_tokens=9, sampling=SamplingParams(1.0)), "", ids)
        assert r.footer["n_tokens"] == 9 and all(0 <= t < 300 for t in r.token_ids)


# -- CUDA ----------------------------------------------------------------------------------------------
@cuda_only
def test_cuda_runs_keep_the_run_on_the_gpu(tiny_random, tmp_path):
    engine = Engine.load(tiny_random, device="cuda")
    assert engine.model_meta()["device"].startswith("cuda") and engine.model_meta()["dtype"] == "bfloat16"
    for name, temperature in (("ar", 1.0), ("isd", 0.0), ("isd", 1.0), ("jacobi-mr", 0.0), ("jacobi", 1.0)):
        settings = Settings(max_new_tokens=16, sampling=SamplingParams(temperature))
        assert run_to_end(engine, make_strategy(name), settings, "", [1, 2, 3]).footer["n_tokens"] == 16, name


@cuda_only
@pytest.mark.parametrize("name, params", [("blockdiff", {}), ("s2d2", {"policy": "always"}), ("simsd", {})])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_block_strategies_build_masks_and_gates_on_the_gpu(name, params, temperature):
    engine = tiny_dlm("qwen3")
    to_device(engine.model, torch.device("cuda"), torch.float32)
    r = generate(engine, name, params, n=12, temperature=temperature)
    assert r.header["model"]["device"].startswith("cuda") and r.footer["n_tokens"] == 12


@cuda_only
def test_cuda_sampler_generator_lives_on_the_gpu(tiny_random):
    engine = Engine.load(tiny_random, device="cuda")
    run = Run(prepare(engine, make_strategy("ar")), Settings(max_new_tokens=4), "", [1, 2, 3])
    assert run.ctx.gen.device.type == "cuda" and run.ctx.kv.k.device.type == "cuda"


@pytest.mark.parametrize("env, expected", [("3", 3), (" 1 ", 1), ("0", None), ("lots", None), (None, None)])
def test_cpu_threads_follow_omp_num_threads_when_set(monkeypatch, env, expected):
    """A user (or a test runner sharing the cores between workers) who sets OMP_NUM_THREADS gets that many threads;
    otherwise, or when it is no positive count, the cores this process may run on."""
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert cpu_threads() == (expected or available_cores())

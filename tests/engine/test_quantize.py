"""Weight-only int8 and fp8 (studio.engine.quantize): the quantisation's rounding, the int8 kernels against the
dequantised model (the same numbers in float), a row's bits at any row count, the strategies exact to the int8 model,
and a model quantised layer by layer as it is made or placed. The Triton kernel CUDA runs: test_quant_kernel.py."""
from __future__ import annotations

import pytest
import torch

from studio.engine.kernels import cpu as cpu_kernel
from studio.engine.lora import LoadedAdapter, attach_adapter, install
from studio.engine.model import Linear, fuse_projections
from studio.engine.quantize import dequantized, is_quantized, quantize
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.run.session import Settings, run_to_end
from tests.support.lora import random_adapter, random_lora
from tests.support.tiny import FAMILIES, tiny_engine, tiny_model

V = 16
# the int8 model against its dequantised twin: the same products summed in another order (our kernel's fixed one,
# F.linear's), a few ulps of logits of order 1
BOUND = 1e-5


def test_each_weight_rounds_to_the_nearest_step_of_its_rows_scale():
    model = tiny_model("qwen2", vocab=V)
    floats = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, Linear)}
    quantize(model, "int8")
    assert is_quantized(model)
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            w, q, s = floats[name], m.weight, m.scale
            assert q.dtype == torch.int8 and s.shape == (w.shape[0],) and q.abs().max() == 127
            assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    head, q, s = model.lm_head.weight, model.head_quant, model.head_scale   # the head's int8 copy, beside it
    assert q.dtype == torch.int8 and ((q.float() * s[:, None] - head).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()


def test_a_rows_int8_product_is_the_same_bits_at_any_row_count():
    if not cpu_kernel.available():
        pytest.skip("no C compiler: the int8 products run through torch")
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (37, 83), generator=g, dtype=torch.int8)   # sizes off the kernel's 16-wide blocks
    scale = torch.rand(37, generator=g) / 100
    x = torch.randn(16, 83, generator=g)
    alone = cpu_kernel.skinny_int8(w, scale, x[:1])
    for rows in range(2, 17):
        assert torch.equal(cpu_kernel.skinny_int8(w, scale, x[:rows])[:1], alone)
    exact = (x.double() @ (w.double() * scale.double()[:, None]).T)
    assert (cpu_kernel.skinny_int8(w, scale, x) - exact).abs().max() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 3, 7, 20])
@pytest.mark.parametrize("fuse, tie", [(False, False), (True, False), (True, True)])
def test_the_int8_model_equals_its_dequantised_twin(family, T, fuse, tie):
    """Rows through our int8 kernel (up to 16), the widened weight (a prefill), an adapter gated on the tail rows;
    a tied head's int8 copy beside the float table the embedding reads."""
    model = tiny_model(family, vocab=V, seed=3, tie_embeddings=tie)
    quantize(model, "int8")
    twin = dequantized(model)
    if fuse:
        fuse_projections(model)
    for m in (model, twin):
        install(m, LoadedAdapter("random", random_lora(twin, seed=4), 1.0, None, None))
    tokens = torch.randint(0, V, (5 + T,), generator=torch.Generator().manual_seed(T))
    gate = torch.arange(T) >= T // 2
    out = []
    for m in (model, twin):
        kv = m.new_cache(64)
        with torch.inference_mode():
            m(tokens[:5], torch.arange(5), kv)
            kv.commit(5)
            out.append(m(tokens[5:], torch.arange(5, 5 + T), kv, lora_gate=gate))
    assert (out[0] - out[1]).abs().max().item() <= BOUND


@pytest.mark.parametrize("name, params", [("isd", {"stride": 4}), ("r-isd", {"stride": 3}),
                                          ("jacobi", {"block_size": 4}), ("jacobi-mr", {"block_size": 3, "blocks": 2})])
def test_a_lossless_strategy_on_the_int8_model_equals_its_ar(tmp_path, name, params):
    """Exact to the model it runs: greedy on the int8 model, KV rollback and an adapter's gated rows included, its
    tokens are that model's greedy `ar`'s."""
    engine = tiny_engine("llama", vocab=V, seed=6)
    quantize(engine.model, "int8")
    fuse_projections(engine.model)
    if name == "r-isd":
        attach_adapter(engine, random_adapter(tmp_path / "ad", dequantized(engine.model), seed=6))
    settings = Settings(max_new_tokens=32, sampling=SamplingParams(0.0))
    ar = run_to_end(engine.with_adapter(None), make_strategy("ar"), settings, "", [1, 2, 3])
    run = run_to_end(engine, make_strategy(name, params), settings, "", [1, 2, 3])
    assert run.token_ids == ar.token_ids and len(set(ar.token_ids)) > 2
    assert any(e["t"] == "reject" for e in run.events)   # drafts refused: their K/V written and not committed


def test_run_quant_int8_on_the_embedded_model(tmp_path):
    """--quant int8 on the default model: a run whose header and trace say int8, its ar and r-isd identical (the
    shipped adapter on the int8 model); an unknown scheme refused in one line."""
    from studio.events import read_trace
    from tests.support.cli import assert_one_line_error, cli
    traces = {}
    for strategy in ("ar", "r-isd"):
        path = tmp_path / f"{strategy}.jsonl"
        r = cli("run", "Name three colours.", "-s", strategy, "--quant", "int8", "--max-new-tokens", "12",
                "--trace", str(path), check_rc=0)
        assert "int8" in r.stdout + r.stderr
        traces[strategy] = read_trace(str(path))
    assert all(t.header["model"]["quant"] == "int8" for t in traces.values())
    assert traces["r-isd"].footer["text"] == traces["ar"].footer["text"]
    assert_one_line_error(cli("run", "hi", "--quant", "int4"), "--quant must be one of none, int8")


def test_fp8_rounds_each_weight_to_the_nearest_e4m3_value_of_its_rows_scale():
    from studio.engine.moe import Experts
    from tests.support.parallel import SOFTMAX_MOE
    model = tiny_model("llama", vocab=V, **SOFTMAX_MOE)
    floats = {n: p.detach().clone() for n, p in model.named_parameters()}
    quantize(model, "fp8")
    checked = 0
    for name, m in model.named_modules():
        pairs = [("weight", m.scale)] if isinstance(m, Linear) else \
            [(p, m.scales[p]) for p in m.PROJECTIONS] if isinstance(m, Experts) else []
        for attr, s in pairs:
            w, q = floats[f"{name}.{attr}"], getattr(m, attr)
            assert q.dtype == torch.float8_e4m3fn and s.shape == w.shape[:-1]
            assert (q.float().abs().amax(-1) == 448).all()   # each row's largest weight at e4m3's top
            scaled = w / s[..., None]   # e4m3 keeps 3 mantissa bits: nearest within half a step, 2^-4 of the value
            assert ((q.float() - scaled).abs() <= scaled.abs() * 2 ** -4 + 2 ** -10).all()
            checked += 1
    assert checked == 2 * (4 + 3)   # two layers: q/k/v/o and the three stacked expert weights


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_model_quantised_as_it_is_made_or_placed_is_the_whole_model_quantised(kind):
    """A random model made layer by layer, each quantised at once (so the float model is never whole in memory), and
    a loaded model placed layer by layer the same way, hold exactly what quantising the whole float model gives."""
    import dataclasses
    from studio.engine.engine import to_device
    from studio.engine.random_models import build_random, random_config
    from studio.engine.families import read_config
    from tests.support.tiny import GEMMA_TEXT
    cfg = dataclasses.replace(random_config("random:llada2-mini@2"), dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                              ffn_dim=96, moe_ffn_dim=32, moe_shared_ffn_dim=32, n_experts=8, n_experts_per_tok=2,
                              moe_groups=4, moe_topk_groups=2, vocab_size=50, rotary_dim=8)
    whole = build_random(cfg, torch.device("cpu"), torch.float32, seed=3)
    placed = build_random(cfg, torch.device("cpu"), torch.float32, seed=3)
    streamed = build_random(cfg, torch.device("cpu"), torch.float32, seed=3, quant=kind)
    quantize(whole, kind)
    to_device(placed, torch.device("cpu"), torch.float32, quant=kind)
    tensors = lambda m: {**dict(m.state_dict()), "head": m.head_quant, "head scale": m.head_scale,
                         **{f"{n}.scales.{k}": v for n, e in m.named_modules() if getattr(e, "scales", None)
                            for k, v in e.scales.items()}}
    for other in (streamed, placed):
        a, b = tensors(whole), tensors(other)
        assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
    assert any(v.dtype in (torch.int8, torch.float8_e4m3fn) for v in tensors(streamed).values())
    gemma = read_config({"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
                         "canvas_length": 8, "text_config": dict(GEMMA_TEXT, vocab_size=24)})
    assert is_quantized(build_random(gemma, torch.device("cpu"), torch.float32, quant=kind))   # its layer buffers too


def test_each_scheme_is_refused_in_one_line_where_it_has_no_kernel(monkeypatch):
    from studio.engine.quantize import check_quant
    from studio.errors import BadInput
    check_quant("int8", torch.device("cpu"))
    with pytest.raises(BadInput, match="--quant fp8 needs an NVIDIA GPU of compute capability 8.9"):
        check_quant("fp8", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))   # an A100
    with pytest.raises(BadInput, match="compute capability 8.9 or newer"):
        check_quant("fp8", torch.device("cuda"))
    check_quant("int8", torch.device("cuda"))


def test_bench_and_compare_name_an_int8_model():
    from studio.run.bench import report_title
    from studio.run.compare import render_table
    report = {"oracle_accept": None, "concurrency": 1, "prompts": ["a"], "repeats": 1, "model": {"quant": "int8"}}
    assert "int8 weights (transformers left out" in report_title(report)
    assert "weights" not in report_title({**report, "model": {}})   # a float model's title as it was
    assert render_table([], sampled=False, model="tiny · int8").title == "compare on tiny · int8"

"""The fused projections (studio.engine.model.Fused: q/k/v and gate/up as one product each) against the plain
projections they replace, the oracle: the same logits within BOUND at every row count the strategies use, with an
adapter gated on some rows, and every strategy's greedy tokens unchanged."""
from __future__ import annotations

import copy

import pytest
import torch

from studio.engine.lora import LoadedAdapter, attach_adapter, install
from studio.engine.model import Fused, fuse_projections
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.run.session import Settings, run_to_end
from tests.support.lora import random_adapter, random_lora
from tests.support.tiny import FAMILIES, tiny_dlm, tiny_engine, tiny_gemma, tiny_mdm, tiny_model

V = 16
# logits of fp32 models with O(1) entries: a fused product may sum in another order than its parts (a GEMM's
# blocking depends on its width), which moves a logit by a few ulps, never more
BOUND = 1e-5


def twins(family: str, adapter: bool):
    plain = tiny_model(family, vocab=V, seed=3)
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    if adapter:
        for m in (plain, fused):
            install(m, LoadedAdapter("random", random_lora(plain, seed=4), 1.0, None, None))
    return plain, fused


def logits(model, tokens, gate):
    n = len(tokens) - 5   # five committed tokens, then the forward under test
    kv = model.new_cache(64)
    with torch.inference_mode():
        model(tokens[:5], torch.arange(5), kv)
        kv.commit(5)
        return model(tokens[5:], torch.arange(5, 5 + n), kv, lora_gate=gate)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 3, 4, 7, 20])
@pytest.mark.parametrize("gate", ["none", "tail", "scattered", "all"])
def test_fused_forward_equals_the_plain_one(family, T, gate):
    """Rows through our CPU kernel (1-4), oneDNN (5-16) and F.linear (a prefill), the adapter on no row, a tail run
    (R-ISD's MASK rows), scattered rows or all: each logit within BOUND of the plain model's."""
    plain, fused = twins(family, adapter=gate != "none")
    tokens = torch.randint(0, V, (5 + T,), generator=torch.Generator().manual_seed(T))
    g = {"none": None, "tail": torch.arange(T) >= T // 2, "scattered": torch.arange(T) % 2 == 1,
         "all": torch.ones(T, dtype=torch.bool)}[gate]
    a, b = logits(plain, tokens, g), logits(fused, tokens, g)
    assert a.shape == b.shape and (a - b).abs().max().item() <= BOUND
    if g is not None and g.any():   # the adapter changed the model: the test would see a LoRA the fused path dropped
        base = copy.deepcopy(plain)
        install(base, None)
        assert (logits(base, tokens, g) - a).abs().max().item() > 100 * BOUND


def test_the_parts_weights_are_views_of_the_fused_product():
    """One copy of the weights in memory, an in-place write to a part reaches the product, and the packed copies
    (`projection_weights`) are made of the products and the unfused projections only."""
    model = tiny_model("qwen2", vocab=V)
    before = sum(p.numel() for p in model.parameters())
    fuse_projections(model)
    fuse_projections(model)   # a second call fuses nothing twice
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert sum(p.numel() for p in model.parameters()) == before
    with torch.no_grad():
        attn.k_proj.weight[0, 0] = 7.0
        mlp.up_proj.weight[1, 2] = -3.0
    assert attn.qkv.weight[attn.q_proj.out_features, 0] == 7.0 and attn.qkv.bias is not None
    assert mlp.gate_up.weight[mlp.gate_proj.out_features + 1, 2] == -3.0
    weights = model.projection_weights()
    fused = [m for m in model.modules() if isinstance(m, Fused)]
    assert len(fused) == 2 * model.config.n_layers and len(weights) == len(fused) + 2 * model.config.n_layers
    assert all(w.data_ptr() != attn.k_proj.weight.data_ptr() for w in weights)


def _risd(tmp_path, seed):
    engine = tiny_engine("llama", vocab=V, seed=seed)
    attach_adapter(engine, random_adapter(tmp_path / f"ad-{seed}", engine.model, seed=seed))
    return engine


# strategy -> (an engine builder taking a seed, params)
CASES = {
    "ar": (lambda tmp, s: tiny_engine("qwen3", vocab=V, seed=s), {}),
    "isd": (lambda tmp, s: tiny_engine("qwen2", vocab=V, seed=s), {"stride": 4}),
    "r-isd": (_risd, {"stride": 3}),
    "jacobi": (lambda tmp, s: tiny_engine("llama", vocab=V, seed=s), {"block_size": 4}),
    "jacobi-mr": (lambda tmp, s: tiny_engine("llama", vocab=V, seed=s), {"block_size": 3, "blocks": 2}),
    "blockdiff": (lambda tmp, s: tiny_dlm("llama", vocab=V, seed=s), {}),
    "s2d2": (lambda tmp, s: tiny_dlm("llama", True, vocab=V, seed=s), {"block_size": 4, "steps": 4}),
    "simsd": (lambda tmp, s: tiny_dlm("llama", vocab=V, seed=s), {"block_size": 4}),
    "canvas": (lambda tmp, s: tiny_mdm(vocab=V, seed=s), {"block_size": 4}),
    # four denoising steps, as the tensor-parallel tests run it: more steps of self-conditioning amplify a summation
    # order's rounding until a draw flips (its floats against float64: tests/parallel)
    "gemma-canvas": (lambda tmp, s: tiny_gemma(seed=s), {"max_denoising_steps": 4}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_strategy_decodes_the_same_tokens_on_the_fused_path(tmp_path, name):
    build, params = CASES[name]
    runs = []
    for fuse in (False, True):
        engine = build(tmp_path / str(fuse), 5)
        if fuse:
            fuse_projections(engine.model)
        settings = Settings(max_new_tokens=24, sampling=SamplingParams(0.0), seed=1)
        runs.append(run_to_end(engine, make_strategy(name, params), settings, "", [1, 2, 3, 4, 5]))
    plain, fused = runs
    assert fused.token_ids == plain.token_ids and len(plain.token_ids) == 24
    forwards = lambda r: [e["n_tokens"] for e in r.events if e["t"] == "forward"]
    assert forwards(fused) == forwards(plain)


def test_bench_forwards_times_the_fused_path_against_the_plain_one():
    from studio.engine.forward_cost import fused_vs_plain
    engine = tiny_engine("qwen3", vocab=V)
    assert fused_vs_plain(engine, repeats=2) is None   # nothing fused: nothing to compare
    fuse_projections(engine.model)
    ratios = fused_vs_plain(engine, repeats=2)
    assert list(ratios) == ["1-token step", "7-token extend"] and all(r > 0 for r in ratios.values())
    assert all(getattr(m, name) is not None for m in engine.model.modules() for name in ("qkv", "gate_up")
               if hasattr(m, name))   # the plain path was lent, and the fused one is back


def test_a_cast_after_fusing_casts_the_product_and_keeps_the_parts_views_of_it():
    """The tensor-parallel tests measure a run against the same model in float64 (`model.double()` after load)."""
    plain, fused = twins("qwen2", adapter=False)
    plain.double(), fused.double()
    attn = fused.model.layers[0].self_attn
    assert attn.qkv.weight.dtype == torch.float64 and attn.qkv.bias.dtype == torch.float64
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.qkv.weight.untyped_storage().data_ptr()
    tokens = torch.arange(9) % V
    a, b = logits(plain, tokens, None), logits(fused, tokens, None)
    assert (a - b).abs().max().item() <= 1e-6   # float64 sums, rounded to the float logits the model returns

"""The mixture-of-experts layer's two expert paths: the per-expert loop (the oracle) and the grouped GEMMs CUDA runs
(and captures in its graphs)."""
from __future__ import annotations

import pytest
import torch

from studio.engine.config import ModelConfig
from studio.engine.moe import MoE

CFG = dict(arch="llama", vocab_size=32, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=96,
           n_experts=8, n_experts_per_tok=2, moe_ffn_dim=32, moe_renormalize=True)


def layer(router: str, act: str, device="cpu", dtype=torch.float32) -> MoE:
    torch.manual_seed(0)
    moe = MoE(ModelConfig(**CFG, moe_router=router, hidden_act=act))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2 if p.dim() > 1 else 1 + 0.3 * torch.randn_like(p))
    return moe.to(device, dtype)


def both_paths(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for path in ("loop", "grouped"):
        moe.experts.path = path
        with torch.no_grad():
            outs.append(moe(x))
    moe.experts.path = "auto"
    return outs[0], outs[1]


@pytest.mark.parametrize("router, act", [("softmax", "silu"), ("gemma", "gelu_tanh")])
@pytest.mark.parametrize("tokens", [1, 3, 40])   # most experts idle, some, every one
def test_the_grouped_gemm_path_equals_the_expert_loop(router, act, tokens):
    moe = layer(router, act)
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens))
    loop, grouped = both_paths(moe, x)
    ran = int(moe.experts_run)
    assert 1 <= ran <= 8 and (ran < 8 or tokens == 40)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)
    assert moe.experts.path_on(x.device, x.dtype) == "loop"   # on the CPU, auto keeps the loop (faster there)


@pytest.mark.parametrize("path", ["loop", "grouped"])
def test_expert_parallel_shards_add_up_to_the_whole_layer_on_either_path(path):
    """Each rank holds a slice of the experts; the other ranks' assignments sort last and contribute nothing (on the
    grouped path those rows hold whatever the GEMMs left there), so the shards' outputs add up to the whole layer."""
    moe = layer("softmax", "silu")
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(3))
    moe.experts.path = "loop"
    with torch.no_grad():
        whole = moe(x)
    full = {name: p.detach().clone() for name, p in moe.experts.named_parameters()}
    parts = []
    for held in (slice(0, 3), slice(3, 8)):
        with torch.no_grad():
            for name, p in moe.experts.named_parameters():
                p.data = full[name][held].clone()
            moe.experts.held, moe.experts.path = held, path
            parts.append(moe(x))
    moe.experts.held = None
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)
    assert parts[0].abs().sum() > 0 and parts[1].abs().sum() > 0


@pytest.mark.parametrize("held", [None, slice(2, 6)])
def test_the_grouped_path_reads_nothing_on_the_host_and_the_loop_does(held):
    """What a CUDA graph needs: the grouped path's shapes follow the input's alone. Under FakeTensorMode (tensors with
    shapes and no data) any read of a value on the host raises: the grouped path runs through, the loop does not."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    moe = layer("gemma", "gelu_tanh", dtype=torch.bfloat16)   # grouped_mm's shape rules want bf16
    moe.experts.held = held
    if held is not None:
        for p in moe.experts.parameters():
            p.data = p.data[held]
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
        x = fake.from_tensor(torch.randn(1, 5, 64, dtype=torch.bfloat16))
        moe.experts.path = "grouped"
        assert moe(x).shape == x.shape and moe.experts_run.shape == ()
        moe.experts.path = "loop"
        with pytest.raises(DataDependentOutputException):
            moe(x)


@pytest.mark.parametrize("router", ["softmax", "sigmoid", "gemma"])
def test_a_bf16_layer_stays_in_bf16_whatever_dtype_its_router_weighs_in(router):
    """Routers weigh in fp32; the weighted expert outputs go back into the bf16 stream (the GPU's dtype: this once
    failed there alone)."""
    extra = dict(moe_groups=4, moe_topk_groups=2) if router == "sigmoid" else {}
    moe = MoE(ModelConfig(**CFG, moe_router=router, hidden_act="silu", **extra)).to(torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        y = moe(torch.randn(1, 5, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_in_bf16_the_grouped_gemms_run_and_agree_with_the_loop():
    moe = layer("gemma", "gelu_tanh", "cuda", torch.bfloat16)
    x = torch.randn(1, 256, 64, device="cuda", dtype=torch.bfloat16)
    assert moe.experts.path_on(x.device, x.dtype) == "grouped"
    loop, grouped = both_paths(moe, x)
    torch.testing.assert_close(grouped.float(), loop.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_captured_moe_layer_replays_what_it_computes_eagerly():
    moe = layer("softmax", "silu", "cuda", torch.bfloat16)
    x = torch.randn(1, 4, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe(x)   # warm-up outside the capture (cuBLAS handles, kernel choice)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        for seed in (1, 2):
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
            graph.replay()
            torch.testing.assert_close(out.float(), moe(x).float(), atol=1e-2, rtol=1e-2)


def test_the_sigmoid_router_and_its_mixture_are_transformers_deepseek_v3_moe():
    """LLaDA2's routing (sigmoid scores, expert bias for the choice only, best groups by their top-2 sum, top k of the
    unbiased scores renormalised and scaled, a shared expert) is DeepSeek-V3's: transformers' DeepseekV3MoE with the
    same weights gives the same layer output."""
    tf = pytest.importorskip("transformers")
    theirs = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(tf.DeepseekV3Config(
        hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1, hidden_act="silu")).eval()
    mine = MoE(ModelConfig(**dict(CFG, n_experts=16, n_experts_per_tok=4), moe_router="sigmoid", moe_groups=4,
                           moe_topk_groups=2, moe_expert_bias=True, moe_scale=2.5, moe_shared_ffn_dim=32))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        theirs.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
        gate, up = theirs.experts.gate_up_proj.chunk(2, dim=1)
        mine.load_state_dict({"gate.weight": theirs.gate.weight, "gate.expert_bias": theirs.gate.e_score_correction_bias,
                              "experts.gate_proj": gate, "experts.up_proj": up, "experts.down_proj": theirs.experts.down_proj,
                              **{f"shared_experts.{k}": v for k, v in theirs.shared_experts.state_dict().items()}})
        x = torch.randn(1, 24, 64, generator=g)
        torch.testing.assert_close(mine(x), theirs(x), atol=1e-5, rtol=1e-5)

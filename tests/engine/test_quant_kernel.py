"""The Triton kernel for 1-byte weights (studio.engine.kernels.quant_triton): the dense product and the experts' blocked
layout against the dequantised weights' product, int8 and fp8.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET is read when a kernel is defined, so it is
set before the module is imported); the interpreter computes in fp32 here, bf16 only on a GPU (`make gpu-numbers`).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from studio.engine.kernels import _triton_installed  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _triton_installed(), reason="needs Triton")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["int8", "fp8"]


def quantized(shape, kind: str, seed: int):
    from studio.engine.quantize import quantized_rows
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    q, scale = quantized_rows(w, kind)
    return q.to(DEVICE), scale.to(DEVICE), (q.float() * scale[..., None]).to(DEVICE)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows, n, k", [(1, 40, 64), (3, 70, 200), (16, 64, 96)])   # N, K off the kernel's tiles
def test_the_dense_product_is_the_dequantised_weights_product(kind, rows, n, k):
    from studio.engine.kernels.quant_triton import quant_mm
    q, scale, widened = quantized((n, k), kind, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    y = quant_mm(x, q, scale)
    assert y.shape == (rows, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, x @ widened.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n_experts, held", [(8, None), (8, 5), (3, None)])
@pytest.mark.parametrize("A", [1, 6, 50])
def test_the_blocked_layout_puts_every_assignment_once_in_a_block_of_its_expert(n_experts, held, A):
    from studio.engine.kernels.quant_triton import BLOCK_M, expert_blocks
    assignment = torch.randint(0, n_experts, (A,), generator=torch.Generator().manual_seed(A))
    if held is not None:   # another rank's experts: ids past this rank's
        assignment = torch.where(assignment < held, assignment, held)
    n = held or n_experts
    slot, rows, blocks = expert_blocks(assignment, n)
    mine = (assignment < n).nonzero().squeeze(1)
    assert (slot[assignment >= n] == -1).all() and (rows >= 0).sum() == len(mine)
    assert torch.equal(rows[slot[mine]], mine)                                # each of this rank's, once
    assert torch.equal(blocks[slot[mine] // BLOCK_M], assignment[mine])       # in a block of its expert
    assert (blocks[torch.unique(slot[mine] // BLOCK_M)] >= 0).all() and (rows.view(-1, BLOCK_M)[blocks < 0] == -1).all()
    within = [slot[mine][assignment[mine] == e] for e in range(n)]            # in order within an expert
    assert all(torch.equal(s, s.sort().values) for s in within)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_quantised_experts_through_the_kernel_equal_the_loop_over_the_widened_weights(kind, tokens):
    """The MoE layer's blocked path (what CUDA runs for 1-byte experts, and captures) against its oracle, the loop
    over each expert's weight widened and scaled; both against the dequantised layer."""
    from studio.engine.quantize import dequantized, quantize_layers
    from tests.engine.test_moe import layer
    moe = layer("softmax", "silu", DEVICE)
    quantize_layers(moe, kind)
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    outs = {}
    for path in ("loop", "blocked"):
        moe.experts.path = path
        with torch.no_grad():
            outs[path] = moe(x)
        outs[path + " ran"] = int(moe.experts_run)
    moe.experts.path = "auto"
    with torch.no_grad():
        twin = dequantized(moe)(x)
    torch.testing.assert_close(outs["blocked"], outs["loop"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["loop"], twin, atol=1e-5, rtol=1e-5)
    assert outs["blocked ran"] == outs["loop ran"] and 1 <= outs["loop ran"] <= 8


def test_the_blocked_path_reads_nothing_on_the_host():
    """What a CUDA graph needs of the experts with 1-byte weights: under FakeTensorMode (no data) the layout and the
    launches' shapes follow from the input's shape alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from studio.engine.kernels.quant_triton import expert_blocks
    with FakeTensorMode():
        slot, rows, blocks = expert_blocks(torch.randint(0, 8, (12,)), 8)
    assert slot.shape == (12,) and rows.shape == (blocks.shape[0] * 16,)

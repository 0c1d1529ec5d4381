"""The fused residual add + RMSNorm (studio.engine.kernels.norm): its torch path against the Llama norm written out
(the plain path it replaced), and the Triton kernel against the torch path -- in Triton's CPU interpreter without
CUDA (TRITON_INTERPRET is read when a kernel is defined, so it is set before the kernel module is imported)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from studio.engine.kernels import _triton_installed  # noqa: E402
from studio.engine.kernels.norm import add_rms_norm  # noqa: E402

EPS = 1e-5


def written_out(x, delta, weight, eps=EPS):
    """The plain path: the add in x's dtype, then weight * (h / rms(h) in fp32, cast back)."""
    h = x if delta is None else x + delta
    f = h.float()
    return h, weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def inputs(rows, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(rows, D, generator=g) * 3).to(dtype), torch.randn(rows, D, generator=g).to(dtype)
    return x, delta, (1 + torch.randn(D, generator=g) / 4).to(dtype)


TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_the_torch_path_is_the_norm_written_out(dtype, with_delta):
    x, delta, w = inputs(7, 576, dtype)
    delta = delta if with_delta else None
    (h, y), (h0, y0) = add_rms_norm(x, delta, w, EPS), written_out(x, delta, w)
    assert torch.equal(h, h0) and y.dtype == y0.dtype
    torch.testing.assert_close(y, y0, **TOL[dtype])


# the interpreter computes bf16 as garbage (numpy has no bf16): bf16 is checked on a GPU (`make gpu-numbers`)
BF16 = pytest.param(torch.bfloat16, marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="bf16 needs CUDA")])


@pytest.mark.cuda   # on a GPU in `make gpu-numbers`; here in the interpreter
@pytest.mark.skipif(not _triton_installed(), reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (2, 3, 100)])   # 576 and 100: a row that is not a power of two
def test_the_kernel_equals_the_torch_path(dtype, with_delta, shape):
    from studio.engine.kernels.norm_triton import add_rms_norm_fused
    x, delta, w = inputs(int(torch.tensor(shape[:-1]).prod()), shape[-1], dtype, seed=len(shape))
    x, delta = x.view(shape), delta.view(shape)
    delta = delta if with_delta else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w = x.to(device), w.to(device)
    delta = None if delta is None else delta.to(device)
    (h, y), (h0, y0) = add_rms_norm_fused(x, delta, w, EPS), written_out(x, delta, w)
    assert h.shape == y.shape == x.shape and torch.equal(h, h0)   # the add rounds as torch's does
    torch.testing.assert_close(y, y0, **TOL[dtype])

"""The CPU's decode-sized projection kernel (studio/engine/kernels/skinny.c): the product torch computes, a row's
result the same bits at any row count it takes, and torch's kernels where it cannot be built."""
import pytest
import torch

import studio.engine.model as model
from studio.engine.kernels import cpu

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="no C compiler built the CPU kernel here")


@needs_kernel
@pytest.mark.parametrize("n, k", [(96, 64), (37, 40), (5, 7)])   # K a multiple of 16, with a tail, under one chunk
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_kernel_computes_x_times_w_transposed(n, k, rows):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    got = cpu.skinny(w, x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_rows_result_is_the_same_bits_whatever_rows_share_the_call():
    """A draft forward's rows through the kernel equal the same rows alone: the AR step and a verify's clean row
    agree bit for bit in every projection."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 576, generator=g), torch.randn(4, 576, generator=g)
    alone = torch.cat([cpu.skinny(w, x[i:i + 1].contiguous()) for i in range(4)])
    for rows in (2, 3, 4):
        assert torch.equal(cpu.skinny(w, x[:rows].contiguous()), alone[:rows])


@needs_kernel
def test_decode_sized_projections_take_the_kernel_and_wider_ones_do_not(monkeypatch):
    calls = []
    real = cpu.skinny
    monkeypatch.setattr(cpu, "skinny", lambda w, x: calls.append(x.shape[0]) or real(w, x))
    w = torch.randn(64, 32)
    with torch.no_grad():
        for rows in (1, 4, 5, 16):
            x = torch.randn(1, rows, 32)
            torch.testing.assert_close(model.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert calls == [1, 4]


def test_without_a_compiler_the_projections_keep_torchs_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")      # a compiler that fails
    cpu._library.cache_clear()
    try:
        assert not cpu.available() and cpu.skinny(torch.randn(8, 16), torch.randn(2, 16)) is None
        w, x = torch.randn(64, 32), torch.randn(1, 2, 32)
        with torch.no_grad():
            torch.testing.assert_close(model.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
        assert not list(tmp_path.rglob("*.so"))   # nothing half-built left behind
    finally:
        cpu._library.cache_clear()

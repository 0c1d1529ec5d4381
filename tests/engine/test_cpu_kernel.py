"""The CPU's decode-sized projection kernel (studio/engine/kernels/skinny.c): the product torch computes, a row's
result the same bits at any row count it takes, and torch's kernels where it cannot be built."""
import pytest
import torch

import studio.engine.model as model
from studio.engine.gated_lora import RowGate
from studio.engine.kernels.projection import linear
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
            torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert calls == [1, 4]


def test_without_a_compiler_the_projections_keep_torchs_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")      # a compiler that fails
    cpu._library.cache_clear()
    try:
        assert not cpu.available() and cpu.skinny(torch.randn(8, 16), torch.randn(2, 16)) is None
        w, x = torch.randn(64, 32), torch.randn(1, 2, 32)
        with torch.no_grad():
            torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
        assert not list(tmp_path.rglob("*.so"))   # nothing half-built left behind
    finally:
        cpu._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("isa", ["x86-64-v3", "x86-64-v2"])
def test_a_baseline_isa_build_computes_the_same_product(monkeypatch, tmp_path, isa):
    """DLM_STUDIO_CPU_ISA builds the kernel for a named baseline (the AVX2 of a machine without AVX-512, or SSE4):
    its own library, the same product, and a row's bits the same at every row count there too."""
    if cpu.platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86-64 baseline")
    if isa == "x86-64-v3" and " avx2" not in cpu._cpu_id():
        pytest.skip("x86-64-v3 needs AVX2, which this CPU lacks")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("DLM_STUDIO_CPU_ISA", isa)
    cpu._library.cache_clear()
    try:
        g = torch.Generator().manual_seed(1)
        w, x = torch.randn(96, 200, generator=g), torch.randn(4, 200, generator=g)
        got = cpu.skinny(w, x)
        torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(cpu.skinny(w, x[i:i + 1].contiguous())[0], got[i]) for i in range(4))
        # the int8 kernel's widening is written per instruction set (AVX2, SSE4.1): each build checked
        q, scale = torch.randint(-127, 128, (96, 200), generator=g, dtype=torch.int8), torch.rand(96, generator=g)
        got = cpu.skinny_int8(q, scale, x)
        exact = x.double() @ (q.double() * scale.double()[:, None]).T   # entries in the hundreds: fp32 sums of 200
        torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)
        assert all(torch.equal(cpu.skinny_int8(q, scale, x[i:i + 1].contiguous())[0], got[i]) for i in range(4))
        assert len(list(tmp_path.rglob("skinny-*.so"))) == 1
    finally:
        cpu._library.cache_clear()


def test_a_bad_isa_name_is_one_clear_error(monkeypatch):
    from studio.errors import BadInput
    monkeypatch.setenv("DLM_STUDIO_CPU_ISA", "native; rm -rf ~")
    with pytest.raises(BadInput, match="DLM_STUDIO_CPU_ISA must be an -march name"):
        cpu._flags()


@needs_kernel
@pytest.mark.parametrize("rows, rank", [(1, 16), (3, 8), (4, 64)])
def test_the_lora_kernel_adds_the_low_rank_term_in_place(rows, rank):
    g = torch.Generator().manual_seed(rows + rank)
    x, y = torch.randn(rows, 40, generator=g), torch.randn(rows, 24, generator=g)
    a, b = torch.randn(rank, 40, generator=g), torch.randn(24, rank, generator=g)
    want = y.double() + 0.5 * (x.double() @ a.double().T) @ b.double().T
    assert cpu.lora_rows(x, y, a, b, 0.5)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    assert not cpu.lora_rows(x, y, torch.randn(65, 40), torch.randn(24, 65), 0.5)   # past the kernel's rank


@needs_kernel
@pytest.mark.parametrize("gate", [[False, False, True, True, True], [True] * 5, [True, False, True, False, False]])
def test_a_gated_lora_forward_through_the_kernel_matches_torchs(monkeypatch, gate):
    """A projection with an adapter: the gated rows (a run of them, or every row) take the kernel, the others keep the
    exact base projection; scattered rows keep torch's ops. Either way what torch computes."""
    lin = model.Linear(32, 48, bias=False)
    g = torch.Generator().manual_seed(1)
    lin.lora_A, lin.lora_B, lin.lora_scale = torch.randn(8, 32, generator=g), torch.randn(48, 8, generator=g), 2.0
    x, row_gate = torch.randn(1, 5, 32, generator=g), RowGate(torch.tensor([gate]))
    calls, real = [], cpu.lora_rows
    monkeypatch.setattr(cpu, "lora_rows", lambda x, *rest: calls.append(x.shape[0]) or real(x, *rest))
    with torch.no_grad():
        got = lin(x, row_gate)
        monkeypatch.setattr(cpu, "lora_rows", lambda *args: False)
        want = lin(x, row_gate)
    assert calls == ([] if row_gate.rows is not None and row_gate.span is None else [sum(gate)])
    # the LoRA term sums products of N(0, 1) entries (terms up to ~30): summed in another order, as torch's threads
    # may after an earlier test changed their count, an entry near 0 moves by ~1e-5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    off = [i for i, on in enumerate(gate) if not on]
    assert torch.equal(got[0, off], linear(x, lin.weight)[0, off])


@needs_kernel
def test_the_c_function_takes_any_row_count_in_blocks_of_four():
    """cpu.py sends it 1-4 rows; a wider call (a larger MAX_ROWS) must still compute every row, not the first four."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(33, 48, generator=g), torch.randn(7, 48, generator=g)
    y = torch.full((7, 33), float("nan"))
    cpu._library().skinny(w.data_ptr(), x.data_ptr(), y.data_ptr(), 33, 48, 7, 1)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[4:], cpu.skinny(w, x[4:].contiguous()))   # the second block is the same sums

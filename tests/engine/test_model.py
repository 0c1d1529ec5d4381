"""Our model against transformers (the oracle), and KV extend/rollback against one full forward."""
import pytest
import torch

from studio.engine.masks import causal
from studio.engine.kernels.projection import forgo_packed_copies, linear
from tests.support.tiny import FAMILIES, hf_pair, tiny_model


def _prefill(model, ids):
    kv = model.new_cache(64)
    with torch.inference_mode():
        logits = model(ids, torch.arange(len(ids)), kv)
    kv.commit(len(ids))
    return logits[0], kv


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_logit_parity_with_transformers(family, tied):
    hf, ours = hf_pair(family, tie_word_embeddings=tied)
    ids = torch.randint(0, 96, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids).logits[0]
    got, _ = _prefill(ours, ids[0])
    assert (got - ref).abs().max().item() <= 1e-4


def test_logit_parity_llama3_rope_scaling():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
    hf, ours = hf_pair("llama", rope_scaling=scaling)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = hf(ids).logits[0]
    got, _ = _prefill(ours, ids[0])
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_extend_rollback_extend_equals_full_forward(family):
    model = tiny_model(family, vocab=50)
    ids = torch.randint(0, 50, (20,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full, _ = _prefill(model, ids)
        _, kv = _prefill(model, ids[:8])
        # extend with junk, keep 2 of it, then roll those back
        junk = torch.randint(0, 50, (5,))
        model(junk, torch.arange(8, 13), kv)
        kv.commit(2)
        kv.rollback(8)
        # the real tokens, in two extends (the second after a discarded, uncommitted forward)
        a = model(ids[8:14], torch.arange(8, 14), kv)[0]
        kv.commit(6)
        model(junk[:3], torch.arange(14, 17), kv)
        b = model(ids[14:], torch.arange(14, 20), kv)[0]
        kv.commit(6)
    got = torch.cat([a, b])
    assert (got - full[8:]).abs().max().item() <= 1e-5
    assert kv.length == 20


def test_keep_moves_selected_slots():
    model = tiny_model("llama", vocab=50)
    ids = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        full, _ = _prefill(model, ids)
        _, kv = _prefill(model, ids[:6])
        # write [x6, junk, x7] at positions 6, (7), 7 with a mask that hides the junk from x7
        toks = torch.stack([ids[6], torch.tensor(3), ids[7]])
        mask = causal(3, 6)
        mask[2, 6 + 1] = False
        model(toks, torch.tensor([6, 7, 7]), kv, mask=mask)
        kv.keep([0, 2])
        rest = model(ids[8:], torch.arange(8, 12), kv)[0]
    assert (rest - full[8:]).abs().max().item() <= 1e-5


def test_logits_rows_selects_rows():
    model = tiny_model("qwen3", vocab=40)
    ids = torch.randint(0, 40, (9,))
    with torch.inference_mode():
        allrows, _ = _prefill(model, ids)
        kv = model.new_cache(32)
        some = model(ids, torch.arange(9), kv, logits_rows=[2, 8])[0]
    assert torch.allclose(some, allrows[[2, 8]], atol=1e-5, rtol=0)


def test_cpu_projections_by_row_count_compute_x_at_w_t():
    """Decode-sized products take MKL's W @ x.T (1-2 rows) or oneDNN on a packed copy of W (3-16 rows): all of them
    x @ W.T, the packed copy remade after W changes in place (an adapter's rows, a training step), and none made for
    a model whose memory cannot spare it."""
    w, x = torch.randn(48, 32), torch.randn(16, 32)
    with torch.no_grad():
        for rows in (1, 2, 3, 7, 16):
            assert torch.allclose(linear(x[:rows], w), x[:rows] @ w.T, atol=1e-5), rows
        assert isinstance(w._onednn, tuple)   # the 3-16 row products used a packed copy
        w.mul_(-2)
        assert torch.allclose(linear(x[:7], w), x[:7] @ w.T, atol=1e-5)
    model = tiny_model("llama", vocab=40)
    forgo_packed_copies(model)
    with torch.no_grad():
        model(torch.randint(0, 40, (7,)), torch.arange(7), model.new_cache(16))
    assert all(p._onednn is False for p in model.parameters())

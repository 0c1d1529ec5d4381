"""R-ISD: ISD with the adapter gated on at MASK rows only, so the output follows the BASE model exactly
(greedy token for token, sampled in law) and the committed KV is base-only. ISD with the same adapter
applies it on clean rows too, i.e. decodes a different model."""
import dataclasses

import pytest
import torch

from studio.engine.lora import attach_adapter, merge_adapter_weights
from studio.engine.model import Transformer
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import DecodeContext, Output, make_strategy
from studio.run.session import Session, Settings
from tests.support.exact import chi_square_pvalue, exact_sequence_law
from tests.support.lora import merged_model, random_adapter
from tests.support.tiny import FAMILIES, tiny_engine

PROMPT = [1, 2, 3, 4]


def generate(engine, name, params=None, n=40, temperature=0.0, seed=0):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=seed)
    return Session(engine, make_strategy(name, params), s).run("", PROMPT)


def adapted_and_base(tmp_path, family="llama", seed=5, **kw):
    """(engine with a random adapter, the same model without one)."""
    engine = tiny_engine(family, seed=seed, **kw)
    attach_adapter(engine, random_adapter(tmp_path / "ad", engine.model, seed=seed))
    return engine, tiny_engine(family, seed=seed, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stride", [2, 4])
def test_greedy_risd_equals_greedy_ar_of_the_base_model(tmp_path, family, stride):
    engine, base = adapted_and_base(tmp_path, family, vocab=24)
    ar = generate(base, "ar", n=60)
    risd = generate(engine, "r-isd", {"stride": stride}, n=60)
    assert risd.token_ids == ar.token_ids
    assert risd.header["model"]["adapter"] == str(tmp_path / "ad")


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_rows_isd_every_row_risd_mask_rows_only(tmp_path, family):
    engine, base = adapted_and_base(tmp_path, family, vocab=24)
    stride = 3
    isd = generate(engine, "isd", {"stride": stride}, n=40)
    risd = generate(engine, "r-isd", {"stride": stride}, n=40)
    fwd_isd = [e for e in isd.events if e["t"] == "forward"]
    fwd_risd = [e for e in risd.events if e["t"] == "forward"]
    assert all(f["lora_rows"] == f["n_tokens"] for f in fwd_isd)
    assert all(f["lora_rows"] == stride - 1 for f in fwd_risd)
    assert any(f["n_tokens"] > stride for f in fwd_risd)          # verify rounds ran: clean rows stayed off
    # isd decodes the adapted (merged) model, not the base one: greedy, token for token (an I-DLM adapter
    # changes the model, and ISD is lossless with respect to that model)
    assert isd.token_ids != generate(base, "ar", n=40).token_ids
    # without an adapter no row is gated
    plain = generate(base, "r-isd", {"stride": stride}, n=10)
    assert all(e["lora_rows"] == 0 for e in plain.events if e["t"] == "forward")
    base.model = merged_model(engine.model)
    assert isd.token_ids == generate(base, "ar", n=40).token_ids


def test_risd_with_an_adapter_that_adds_the_mask_token(tmp_path):
    """The real use: a base AR model without MASK + an adapter that brings one (input-only row)."""
    base = tiny_engine("llama", vocab=24, seed=7)
    engine = tiny_engine("llama", vocab=24, seed=7)
    engine.config = engine.model.config = dataclasses.replace(engine.config, mask_token_id=None)
    path = random_adapter(tmp_path / "ad", engine.model, mask_token_id=24,
                          mask_embedding=torch.randn(1, engine.config.dim, generator=torch.Generator().manual_seed(0)))
    attach_adapter(engine, path)
    assert engine.config.mask_token_id == 24
    for stride in (2, 4):
        assert generate(engine, "r-isd", {"stride": stride}, n=60).token_ids == generate(base, "ar", n=60).token_ids


# -------------------------------------------------------------------------------------------------
# sampled: the law of whole short continuations is the BASE model's
# -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def law_pair(tmp_path_factory):
    engine, base = adapted_and_base(tmp_path_factory.mktemp("risd"), "llama", seed=11, vocab=6, dim=16, layers=1)
    sampling = SamplingParams(temperature=1.0)
    law = exact_sequence_law(base.model, PROMPT, 3, sampling)
    merged = Transformer(engine.config).eval()
    merged.load_state_dict(merge_adapter_weights(engine.model))
    merged_law = exact_sequence_law(merged, PROMPT, 3, sampling)
    return engine, law, merged_law


def test_the_adapter_moves_the_law_far_enough_to_be_seen(law_pair):
    """Power check: if R-ISD leaked the adapter into clean rows, the chi-square below would see it."""
    _, law, merged_law = law_pair
    tv = 0.5 * sum(abs(law[s] - merged_law[s]) for s in law)
    assert tv > 0.1


@pytest.fixture
def one_thread():
    """20k tiny forwards: intra-op threads only add overhead (and contend on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_sampled_risd_matches_the_base_ar_distribution(law_pair, one_thread):
    engine, law, _ = law_pair
    samples = [tuple(generate(engine, "r-isd", {"stride": 3, "proposal": "sample"}, n=3, temperature=1.0,
                              seed=seed).token_ids) for seed in range(20_000)]
    assert chi_square_pvalue(samples, law) > 0.01


# -------------------------------------------------------------------------------------------------
# the committed KV is the base model's
# -------------------------------------------------------------------------------------------------
def _prefill_kv(model, ids):
    kv = model.new_cache(64)
    with torch.inference_mode():
        model(torch.tensor(ids), torch.arange(len(ids)), kv)
    return kv


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_committed_kv_is_the_base_models_kv_of_the_clean_tokens(tmp_path, temperature):
    engine, base = adapted_and_base(tmp_path, "qwen3", seed=3, vocab=12)
    stride = 3
    out = Output(engine.tokenizer, 25, frozenset())
    ctx = DecodeContext(engine.model, engine.tokenizer, SamplingParams(temperature), 7, out,
                        engine.config.mask_token_id, 64)
    strat = make_strategy("r-isd", {"stride": stride})
    strat.start(ctx, PROMPT)
    while not out.finished:
        strat.step(ctx)
    ids = PROMPT + out.token_ids
    n = min(ctx.kv.length, len(ids) - 1)
    assert ctx.kv.length >= len(ids) - 2 * stride
    fresh = _prefill_kv(base.model, ids[:n])
    assert torch.allclose(ctx.kv.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(ctx.kv.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-5)
    # ... and not the adapted model's (the check can fail)
    merged = Transformer(engine.config).eval()
    merged.load_state_dict(merge_adapter_weights(engine.model))
    leaked = _prefill_kv(merged, ids[:n])
    assert (ctx.kv.k[:, :, :, :n] - leaked.k[:, :, :, :n]).abs().max() > 0.1

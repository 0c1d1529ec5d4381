"""R-ISD: ISD with the adapter gated on at MASK rows only, so the output follows the BASE model exactly
(greedy token for token, sampled in law) and the committed KV is base-only. ISD with the same adapter
applies it on clean rows too, i.e. decodes a different model. Every other strategy decodes the model an
adapter makes (the LoRA on the rows it records: `adapted_rows`), so greedy isd equals greedy ar on it."""
import dataclasses

import pytest
import torch

from studio.engine.lora import attach_adapter, merge_adapter_weights
from studio.engine.model import Transformer
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import DecodeContext, Output, make_strategy
from studio.run.session import Settings, run_to_end
from tests.support.exact import assert_law, chi_square_pvalue, exact_sequence_law
from tests.support.lora import merged_model, random_adapter
from tests.support.plans import ISD_MIXED, plan_with, planned
from tests.support.tiny import FAMILIES, tiny_engine

PROMPT = [1, 2, 3, 4]


def generate(engine, name, params=None, n=40, temperature=0.0, seed=0):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=seed)
    return run_to_end(engine, make_strategy(name, params), s, "", PROMPT)


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
    isd = generate(engine, "isd", {"stride": stride, "drafting": "fixed"}, n=40)
    risd = generate(engine, "r-isd", {"stride": stride, "drafting": "fixed"}, n=40)
    fwd_isd = [e for e in isd.events if e["t"] == "forward"]
    fwd_risd = [e for e in risd.events if e["t"] == "forward"]
    assert all(f["lora_rows"] == f["n_tokens"] for f in fwd_isd)
    assert all(f["lora_rows"] == stride - 1 for f in fwd_risd)
    assert any(f["n_tokens"] > stride for f in fwd_risd)          # verify rounds ran: clean rows stayed off
    # isd decodes the adapted (merged) model, not the base one: greedy, token for token (an I-DLM adapter
    # changes the model, and ISD is lossless with respect to that model)
    assert isd.token_ids != generate(base, "ar", n=40).token_ids
    # without an adapter no row is gated
    plain = generate(base, "r-isd", {"stride": stride, "drafting": "fixed"}, n=10)
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
# the model an adapter makes: the LoRA on the rows it adapts (adapter_config.json's adapted_rows)
# -------------------------------------------------------------------------------------------------
DECODERS = [("ar", None), ("jacobi", {"block_size": 4}), ("jacobi-mr", {"block_size": 4}), ("isd", {"stride": 3, "drafting": "fixed"})]


def with_rows(tmp_path, rows, family="llama", seed=5):
    """A tiny engine with a random adapter that records `rows` as its adapted rows."""
    engine = tiny_engine(family, seed=seed, vocab=24)
    attach_adapter(engine, random_adapter(tmp_path / rows, engine.model, seed=seed, adapted_rows=rows))
    return engine


@pytest.mark.parametrize("family", FAMILIES)
def test_every_strategy_decodes_the_model_an_adapter_of_every_row_makes(tmp_path, family):
    """adapted_rows = "all": greedy ar is the merged model's, and jacobi, jacobi-mr and isd equal it token for
    token (the LoRA on every clean row); the base model writes something else, which r-isd follows."""
    engine = with_rows(tmp_path, "all", family)
    base = tiny_engine(family, seed=5, vocab=24)
    ar = generate(engine, "ar", n=40)
    assert all(e["lora_rows"] == e["n_tokens"] for e in ar.events if e["t"] == "forward")
    base_ar = generate(base, "ar", n=40).token_ids
    assert ar.token_ids != base_ar
    for name, params in DECODERS[1:]:
        assert generate(engine, name, params, n=40).token_ids == ar.token_ids, name
    assert generate(engine, "r-isd", {"stride": 3}, n=40).token_ids == base_ar
    base.model = merged_model(engine.model)
    assert generate(base, "ar", n=40).token_ids == ar.token_ids


def test_a_mask_row_adapter_leaves_the_clean_rows_to_the_base_model(tmp_path):
    """adapted_rows = "mask": on clean tokens the model is the base model, so greedy ar, jacobi, jacobi-mr and isd
    equal the base model's greedy ar, isd reading the LoRA on its MASK rows only (as r-isd does)."""
    engine = with_rows(tmp_path, "mask")
    want = generate(tiny_engine("llama", seed=5, vocab=24), "ar", n=40).token_ids
    assert generate(with_rows(tmp_path, "all"), "ar", n=40).token_ids != want   # the same LoRA on every row differs
    for name, params in DECODERS:
        got = generate(engine, name, params, n=40)
        assert got.token_ids == want, name
        lora_rows = {e["lora_rows"] for e in got.events if e["t"] == "forward"}
        assert lora_rows == ({2} if name == "isd" else {0}), name


@pytest.mark.slow
def test_embedded_isd_equals_greedy_ar_on_its_shipped_adapter(default_engine):
    """On the embedded model isd reads smollm2-isd, an adapter of every row: greedy isd equals greedy ar on that
    adapter (`run -s ar --adapter smollm2-isd`) token for token on the demo prompt, while the base model writes
    other tokens (so the demo names `ar · smollm2-isd` as isd's reference)."""
    from studio.engine.engine import Engine
    from studio.run.demo import DEMO_PROMPT
    from studio.run.session import encode_prompt
    engine = Engine.load("default").for_strategy("isd")
    assert engine.adapter.endswith("smollm2-isd") and engine.lora.adapted_rows == "all"
    ids = encode_prompt(engine, DEMO_PROMPT)
    settings = Settings(max_new_tokens=64, sampling=SamplingParams(0.0))
    isd = run_to_end(engine, make_strategy("isd"), settings, "", ids).token_ids
    assert isd == run_to_end(engine, make_strategy("ar"), settings, "", ids).token_ids
    assert isd != run_to_end(default_engine, make_strategy("ar"), settings, "", ids).token_ids


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


def test_sampled_risd_matches_the_base_ar_distribution(monkeypatch, law_pair, one_thread):
    """In auto drafting, with costs under which the plans vary with the verdicts (ISD's fixed plan: test_isd)."""
    engine, law, _ = law_pair
    plan_with(monkeypatch, ISD_MIXED)
    batches = []

    def pvalue(seeds: range) -> float:
        batches.append([generate(engine, "r-isd", {"stride": 3, "proposal": "sample"}, n=3, temperature=1.0, seed=seed)
                        for seed in seeds])
        return chi_square_pvalue([tuple(r.token_ids) for r in batches[-1]], law)

    assert_law(pvalue, 20_000)
    assert {0, 1} <= {d for r in batches[0][:100] for d in planned(r)}


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

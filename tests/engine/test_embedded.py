"""Integration on the embedded SmolLM2-135M: parity with transformers; greedy ISD (no adapter), R-ISD (its shipped
adapter), S2D2 and SimSD (the shipped block adapter), Jacobi and Jacobi MR == greedy AR."""
import pytest
import torch

from studio.engine.batch import greedy_batch
from studio.engine.engine import Engine
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.presets import load_strategy_preset
from studio.run.session import Settings, encode_prompt, run_to_end
from tests.support.prompts import PROMPTS

pytestmark = pytest.mark.slow


def test_logit_parity_with_transformers_gguf_loader(default_engine, hf_gguf):
    hf, _ = hf_gguf
    ids = encode_prompt(default_engine, PROMPTS[4] + " " + PROMPTS[9])[:64]
    ids += [100 + i for i in range(64 - len(ids))]
    assert len(ids) == 64
    x = torch.tensor(ids)
    with torch.inference_mode():
        ref = hf(x[None]).logits[0]
        kv = default_engine.model.new_cache(64)
        ours = default_engine.model(x, torch.arange(64), kv)[0]
    # the same fp32 sums in another order (oneDNN's blocked products against transformers' F.linear) move logits of
    # ~20 by ~1e-4; a wrong weight or layout moves them by more than 1e-2
    assert (ours - ref).abs().max().item() <= 3e-4


def _run(engine, name, ids, params=None, n=64):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(0.0))
    return run_to_end(engine, make_strategy(name, params), s, "", ids)


def top2_gap(engine, ids: list[int]) -> float:
    """The gap between the two largest next-token logits after `ids` (one full forward)."""
    kv = engine.model.new_cache(len(ids))
    with torch.inference_mode():
        logits = engine.model(torch.tensor(ids), torch.arange(len(ids)), kv, logits_rows=[len(ids) - 1])[0, 0]
    top = logits.topk(2).values
    return (top[0] - top[1]).item()


def assert_same_or_near_tie(engine, prompt_ids, ref: list[int], got: list[int], label: str) -> None:
    """Token-for-token equality, except at a floating-point near-tie that the test shows (gap < 1e-4)."""
    if got == ref:
        return
    k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    gap = top2_gap(engine, prompt_ids + ref[:k])
    print(f"{label}: first difference at token {k}, top-2 logit gap {gap:.2e}")
    assert gap < 1e-4, f"{label}: outputs differ at token {k} and the top-2 gap there is {gap:.2e}, not a near-tie"


# -------------------------------------------------------------------------------------------------
# the exact strategies on a causal model: greedy r-isd (the shipped adapter), jacobi and jacobi-mr == greedy ar
# -------------------------------------------------------------------------------------------------
N_EXACT = 128


@pytest.fixture(scope="module")
def ar_refs(default_engine):
    """Greedy AR on the ten prompts x 128 new tokens: (prompt, prompt ids, tokens), computed once for every strategy
    by the batched greedy decoder (batch 1's tokens, tests/engine/test_batch.py; a third of the time of ten `ar`
    runs). Each strategy checks five of them (`SHARE`), so that together they cover all ten in the time of five."""
    ids = [encode_prompt(default_engine, prompt) for prompt in PROMPTS]
    refs = greedy_batch(default_engine.model, ids, N_EXACT, default_engine.eos_ids())
    return list(zip(PROMPTS, ids, refs))


SHARE = {"isd": slice(0, 10, 2), "r-isd": slice(1, 10, 2), "jacobi": slice(1, 10, 2), "jacobi-mr": slice(0, 10, 2)}


def test_greedy_isd_equals_greedy_ar(default_engine, ar_refs):
    """isd at stride 4 without an adapter (the plain model: its drafts almost never accepted, so every step
    rejects and rolls back), 64 tokens: greedy ar's first 64."""
    for prompt, ids, ar in ar_refs[SHARE["isd"]]:
        isd = _run(default_engine, "isd", ids, {"stride": 4})
        assert_same_or_near_tie(default_engine, ids, ar[:64], isd.token_ids, f"isd {prompt!r}")
        assert isd.footer["forwards"] > 0


@pytest.fixture(scope="module")
def adapted_engine():
    """The embedded model as `dlm-studio run -s r-isd` loads it: with the R-ISD adapter shipped for it
    (presets/adapters/smollm2-risd, trained: its drafts are accepted often, so every accept/reject/rollback
    path runs), on an engine of its own so the session-wide default_engine never carries one."""
    from studio.presets.shipped import shipped_for
    engine = Engine.load("default").for_strategy("r-isd")
    assert engine.adapter == shipped_for("default", "r-isd") and engine.adapter.endswith("smollm2-risd")
    assert engine.config.mask_token_id == engine.model.lm_head.weight.shape[0]   # the adapter's own MASK row
    return engine


@pytest.mark.parametrize("name, params", [("s2d2", {"policy": "always", "drafting": "fixed"}),
                                          ("simsd", {"draft_steps": 1, "drafting": "fixed"})])
def test_verified_block_strategies_with_the_shipped_block_adapter_equal_greedy_ar(default_engine, ar_refs, name,
                                                                                 params):
    """s2d2 verifying every step and simsd (exact acceptance) draft with the shipped smollm2-block adapter at its
    block size 8, verify with the base model, and so decode greedy ar's tokens (three prompts x 128 tokens). Fixed
    drafting: on this CPU their cost-aware default takes AR steps nearly everywhere (docs/strategies.md)."""
    engine = Engine.load("default").for_strategy(name)
    assert engine.adapter.endswith("smollm2-block") and engine.config.adapter_block_size == 8
    accepted = 0
    for prompt, ids, ar in ar_refs[:3]:
        strategy = make_strategy(name, params)
        got = run_to_end(engine, strategy, Settings(max_new_tokens=N_EXACT, sampling=SamplingParams(0.0)), "", ids)
        assert strategy.B == 8 and got.header["model"]["adapter"] == engine.adapter
        assert_same_or_near_tie(default_engine, ids, ar, got.token_ids, f"{name} {prompt!r}")
        accepted += sum(len(e["pos"]) for e in got.events if e["t"] == "accept")
    assert accepted > 0


def _preset_params(name):
    preset = load_strategy_preset(name)
    assert preset.sampling == {"temperature": 0.0}
    return preset.params


@pytest.mark.parametrize("name", ["r-isd", "jacobi", "jacobi-mr"])
def test_greedy_exact_strategies_equal_greedy_ar(request, default_engine, ar_refs, name):
    """r-isd: stride 4 with the shipped trained adapter gated on at MASK rows only (the clean rows and their KV are
    base-only); jacobi: the jacobi-n16 preset's window (n = 16) in cost-aware drafting (the preset drafts all 16 every
    round, as the paper does: the same verification, 17-row forwards on five prompts); jacobi-mr: the jacobi-mr-cpu
    preset; each planning on this machine's measured costs."""
    if name == "r-isd":
        engine, params = request.getfixturevalue("adapted_engine"), {"stride": 4}
    elif name == "jacobi":
        engine, params = default_engine, {**_preset_params("jacobi-n16"), "drafting": "auto"}
    else:
        engine, params = default_engine, _preset_params("jacobi-mr-cpu")
    accepted = verified = 0
    for prompt, ids, ar in ar_refs[SHARE[name]]:
        got = _run(engine, name, ids, params, n=N_EXACT)
        accepted += sum(len(e["pos"]) for e in got.events if e["t"] == "accept")
        verified += sum(len(e["pos"]) for e in got.events if e["t"] == "accept") + \
            sum(e["t"] == "reject" for e in got.events)
        # near-ties are judged on the base model: that is the law every one of these strategies follows
        assert_same_or_near_tie(default_engine, ids, ar, got.token_ids, f"{name} {prompt!r}")
        forwards = [e for e in got.events if e["t"] == "forward" and e["role"] != "prefill"]
        assert len(forwards) == got.footer["forwards"] > 0
        if name == "r-isd":
            assert engine.adapter and got.header["model"]["adapter"] == engine.adapter
            # the MASK rows the cost-aware plan chose for the forward (of at most N - 1), never a clean row
            planned = {e["step"]: e["drafts"] for e in got.events if e["t"] == "plan"}
            assert all(f["lora_rows"] == planned[f["step"]] <= 3 for f in forwards)
        else:
            assert all(f["role"] == "jacobi" and f["lora_rows"] == 0 for f in forwards)
    if name == "r-isd":   # the trained adapter's drafts are mostly accepted: exactness under real acceptance
        assert accepted > 0.4 * verified, (accepted, verified)

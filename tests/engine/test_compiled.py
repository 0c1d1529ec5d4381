"""The compiled step (studio.engine.compiled: `Transformer.run` through torch.compile's inductor) against the plain
step, its oracle: logits within BOUND at the row counts the strategies use, with and without a gated adapter; the
same greedy tokens from whole runs; and a run of changing row counts and KV lengths compiles a few graphs, not one
per step. One tiny model shape throughout: dynamo keeps its graphs per code object, so the tests share them (a
compile costs seconds here)."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from studio.engine.compiled import compile_step, plain_step
from studio.engine.lora import LoadedAdapter, install
from studio.engine.model import fuse_projections
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.errors import BadInput
from studio.run.session import Settings, run_to_end
from tests.support.lora import random_lora
from tests.support.tiny import tiny_engine, tiny_model

V = 16
# logits of fp32 models with O(1) entries: the projections run the same kernels (custom ops in the graph), but
# inductor writes the norms, RoPE and activations as loops of its own, which may round in another order (and fuse
# a multiply-add): a few ulps, never more
BOUND = 1e-5


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", vocab=V, seed=3)
    fuse_projections(m)
    install(m, LoadedAdapter("random", random_lora(m, seed=4), 1.0, None, None))
    compile_step(m)
    return m


def logits(model, tokens, gate):
    """The forward under test after five committed tokens (the prefix written by the plain step)."""
    kv = model.new_cache(64)
    with torch.inference_mode():
        with plain_step(model):
            model(tokens[:5], torch.arange(5), kv)
        kv.commit(5)
        return model(tokens[5:], torch.arange(5, len(tokens)), kv, lora_gate=gate)


@pytest.mark.parametrize("T", [1, 4, 7])
@pytest.mark.parametrize("gated", [False, True])
def test_the_compiled_forward_equals_the_plain_one(model, T, gated):
    """1 row (our kernel), 4 (the kernel's widest) and 7 (oneDNN), with the adapter on a run of rows (the LoRA kernel,
    a custom op adding to the projection's output in place: every row of one, rows 1-3 of four -- R-ISD's tail of
    MASK rows -- and of seven) or on none."""
    tokens = torch.randint(0, V, (5 + T,), generator=torch.Generator().manual_seed(T))
    gate = (torch.arange(T) >= min(1, T - 1)) & (torch.arange(T) < 4) if gated else None
    breaks = counters["graph_break"].total()
    compiled = logits(model, tokens, gate)
    assert counters["graph_break"].total() == breaks   # one graph: no call dynamo cannot trace (a ctypes kernel)
    with plain_step(model):
        plain = logits(model, tokens, gate)
    assert compiled.shape == plain.shape == (1, T, V) and (compiled - plain).abs().max().item() <= BOUND
    if gated:   # the adapter changed the model: the test would see a LoRA the compiled graph dropped
        with plain_step(model):
            assert (logits(model, tokens, None) - plain).abs().max().item() > 100 * BOUND


@pytest.mark.parametrize("name, params", [("ar", {}), ("jacobi", {"block_size": 4})])
def test_a_compiled_engine_decodes_the_same_tokens(name, params):
    runs = []
    for compiled in (False, True):
        engine = tiny_engine("llama", vocab=V, seed=5)
        fuse_projections(engine.model)
        if compiled:
            compile_step(engine.model)
        settings = Settings(max_new_tokens=16, sampling=SamplingParams(0.0), seed=1)
        runs.append(run_to_end(engine, make_strategy(name, params), settings, "", [1, 2, 3, 4, 5]))
    plain, compiled = runs
    assert compiled.token_ids == plain.token_ids and len(plain.token_ids) == 16
    forwards = lambda r: [e["n_tokens"] for e in r.events if e["t"] == "forward"]
    assert forwards(compiled) == forwards(plain)


def test_changing_rows_and_kv_lengths_compile_a_few_graphs(model):
    """Row counts and KV lengths become symbols once they change: a decode that changes both at every step compiles
    its two layouts (one row without a mask, several rows with one) at most twice each -- with the sizes it first
    met, then with symbols -- not once per step."""
    kv = model.new_cache(64)
    with torch.inference_mode():
        with plain_step(model):
            model(torch.arange(5), torch.arange(5), kv)
        kv.commit(5)
        before = graphs_compiled()
        for T in [1, 2, 3, 5, 7, 1, 6, 2, 4, 1, 3, 7]:
            model(torch.arange(T) % V, torch.arange(kv.length, kv.length + T), kv)
            kv.commit(T)
    assert graphs_compiled() - before <= 4


def test_plain_step_lends_the_eager_forward_and_gives_the_compiled_one_back():
    m = tiny_model("llama", vocab=V)
    plain_run = m.run
    compile_step(m)
    compiled_run = m.run
    assert compiled_run != plain_run
    with plain_step(m):
        assert m.run == plain_run
    assert m.run is compiled_run


def test_bench_forwards_times_the_compiled_step_against_the_eager_one():
    from studio.engine.forward_cost import compiled_vs_eager
    engine = tiny_engine("llama", vocab=V)
    assert compiled_vs_eager(engine, repeats=1) is None   # nothing compiled: nothing to compare
    stand_in = engine.model.run   # a step of the instance's own stands for the compiled one: no compile's seconds
    engine.model.run = stand_in
    ratios = compiled_vs_eager(engine, repeats=2)
    assert list(ratios) == ["1-token step", "7-token extend"] and all(r > 0 for r in ratios.values())
    assert engine.model.run is stand_in   # the eager step was lent, and the compiled one is back


def test_compile_with_tensor_parallelism_is_refused():
    from studio.run.config import ModelChoice
    with pytest.raises(BadInput, match="--compile with --tp"):
        ModelChoice(tp=2, compile=True).load()

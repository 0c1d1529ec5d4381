"""The lossless claims on the GPU's own code paths: CUDA graphs replaying decode forwards, the fused Triton verify,
batched decoding. On a tiny fp32 model (no bf16 ties) every lossless strategy decodes greedy ar token for token,
graphs or not. Marked `cuda`; skipped without a GPU (the CPU tests check the same rules on the torch paths)."""
from __future__ import annotations

import pytest
import torch

from studio.engine import kernels
from studio.engine.batch import decode_strategy_batch
from studio.engine.engine import to_device
from studio.engine.graphs import GraphRunner
from studio.engine.lora import attach_adapter
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.run.session import Settings, run_to_end
from tests.support.dlm import block_size_one_greedy, generate
from tests.support.lora import random_adapter
from tests.support.tiny import tiny_dlm, tiny_engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
PROMPT = [1, 2, 3, 4, 5]
N = 48


def on_cuda(engine, graphs: bool):
    to_device(engine.model, CUDA, torch.float32)
    engine.graphs = graphs
    return engine


def adapted(tmp_path, graphs: bool):
    """A tiny llama on the GPU with a random adapter attached after the move (its MASK id the last entry)."""
    engine = tiny_engine("llama", vocab=24, seed=5, max_seq_len=512)
    path = random_adapter(tmp_path / "ad", engine.model, seed=5)
    attach_adapter(on_cuda(engine, graphs), path)
    return engine


@pytest.fixture
def counted(monkeypatch):
    """Counts of graph replays and of verifies through the fused kernel during a test."""
    n = {"replays": 0, "fused": 0}
    replay, fused = GraphRunner.forward, kernels.verify_logits

    def counting_forward(self, *a, **kw):
        before = self.replays
        out = replay(self, *a, **kw)
        n["replays"] += self.replays - before
        return out

    def counting_verify(*a, **kw):
        n["fused"] += kernels.runs_fused(a[1])
        return fused(*a, **kw)

    monkeypatch.setattr(GraphRunner, "forward", counting_forward)
    monkeypatch.setattr(kernels, "verify_logits", counting_verify)
    return n


def run(engine, name, params=None, n=N, temperature=0.0, seed=0):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=seed)
    return run_to_end(engine, make_strategy(name, params), s, "", PROMPT)


@pytest.mark.parametrize("name, params", [("r-isd", {"stride": 2}), ("r-isd", {"stride": 4}), ("jacobi", None),
                                          ("jacobi-mr", None)])
def test_greedy_lossless_strategies_equal_ar_through_graphs_and_the_fused_verify(tmp_path, counted, name, params):
    engine = adapted(tmp_path, graphs=True)
    base = engine.with_adapter(None) if name == "r-isd" else engine   # r-isd decodes the base model
    ar = run(base, "ar")
    out = run(engine, name, params)
    assert out.token_ids == ar.token_ids
    assert out.header["model"]["device"].startswith("cuda")
    assert counted["replays"] > 0 and counted["fused"] > 0   # the GPU paths ran, not their fallbacks


def test_graphs_and_eager_decode_the_same_tokens_and_rollbacks(tmp_path):
    """The same r-isd run with graphs and with --no-graphs: tokens, forwards, verdicts and KV moves agree."""
    def summary(graphs):
        r = run(adapted(tmp_path / str(graphs), graphs), "r-isd", {"stride": 3})
        moves = [(e["t"], e.get("pos"), e.get("op"), e.get("to_len")) for e in r.events
                 if e["t"] in ("accept", "reject", "resample", "bonus", "kv")]
        return r.token_ids, r.footer["forwards"], moves
    assert summary(True) == summary(False)


def test_s2d2_always_verifying_is_the_block_size_one_model_on_the_gpu():
    engine = on_cuda(tiny_dlm("qwen3", False, vocab=24, seed=7), graphs=True)
    r = generate(engine, "s2d2", {"policy": "always", "cache": "causal"}, n=30)
    assert r.token_ids == block_size_one_greedy(engine, [1, 2, 3, 4, 5], 30)


def test_simsd_self_drafting_right_shifted_is_ar_on_the_gpu():
    engine = on_cuda(tiny_dlm("qwen3", True, vocab=24, seed=7), graphs=True)
    r = generate(engine, "simsd", {"cache": "causal"}, n=30)
    assert r.token_ids == generate(engine, "ar", n=30).token_ids


@pytest.mark.parametrize("name, params", [("ar", None), ("isd", {"stride": 3}), ("r-isd", {"stride": 3})])
def test_a_gpu_batch_decodes_every_sequence_as_it_would_alone(tmp_path, name, params):
    engine = adapted(tmp_path, graphs=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    batched = decode_strategy_batch(engine, make_strategy(name, params), SamplingParams(), prompts, 24)
    for prompt, seq in zip(prompts, batched):
        alone = run_to_end(engine, make_strategy(name, params), Settings(max_new_tokens=24), "", prompt)
        assert seq.token_ids == alone.token_ids


def test_sampled_runs_are_reproducible_from_their_seed_on_the_gpu(tmp_path):
    """One seed, one output (the CUDA generator and the kernel's noise are drawn in a fixed order); another seed
    another output."""
    engine = adapted(tmp_path, graphs=True)
    a, b = (run(engine, "r-isd", {"stride": 3}, temperature=1.0, seed=7) for _ in range(2))
    c = run(engine, "r-isd", {"stride": 3}, temperature=1.0, seed=8)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids

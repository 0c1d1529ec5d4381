"""studio.engine.forward_cost: every shape is timed on its real inputs, after the same context, without
growing the cache, and reported against the 1-token step."""
from __future__ import annotations

from studio.engine.forward_cost import SHAPES, measure_forwards
from studio.engine.model import Transformer
from tests.support.lora import random_adapter
from tests.support.tiny import tiny_engine


def recording(model: Transformer) -> list[tuple]:
    """Wrap model.run: (tokens shape, first position, KV length, gated row count, adapter installed) of every
    forward."""
    calls, run = [], model.run

    def spy(tokens, positions, kv, mask, gate, rows, embed_shift=None):
        gated = 0 if gate is None else (tokens.numel() if gate.rows is None else len(gate.rows))
        calls.append((tuple(tokens.shape), int(positions[0, 0]), kv.length, gated,
                      getattr(model, "active_adapter", None) is not None))
        return run(tokens, positions, kv, mask, gate, rows, embed_shift)

    model.run = spy
    return calls


def test_every_shape_runs_on_its_inputs_after_the_context(tmp_path):
    plain = tiny_engine("qwen3", vocab=2048, mask_id=2047)
    gated = plain.with_adapter(str(random_adapter(tmp_path / "ad", plain.model, r=4)))
    calls = recording(plain.model)
    costs = measure_forwards(gated, repeats=3, warmup=1, context=24)

    assert [c.shape for c in costs] == SHAPES
    assert costs[0].ratio == 1.0 and all(c.ms > 0 for c in costs)
    timed = calls[2:]   # after the two prefills (batch 1 and batch 8)
    assert len(timed) == len(SHAPES) * 4
    expected = {((s.batch, s.tokens), 24, 24, s.gated * s.batch, True) for s in SHAPES}
    assert set(timed) == expected   # never committed: every forward sees the same 24-token context


def test_without_an_adapter_the_gated_shape_is_left_out():
    plain = tiny_engine("llama", vocab=64)
    costs = measure_forwards(plain, repeats=2, warmup=0, context=8)
    assert [c.shape.name for c in costs] == [s.name for s in SHAPES if not s.gated]


def test_lora_overhead_compares_the_gated_forward_with_the_plain_one_of_its_shape():
    from studio.engine.forward_cost import ForwardCost, Shape, lora_overhead
    costs = [ForwardCost(Shape("step", 1), 10.0, 1.0), ForwardCost(Shape("extend", 7), 20.0, 2.0),
             ForwardCost(Shape("gated", 7, gated=3), 23.0, 2.3)]
    assert lora_overhead(costs) == 23.0 / 20.0
    assert lora_overhead(costs[:2]) is None


def test_weight_bytes_counts_a_tied_head_once_after_a_mask_row_grew_the_table(tmp_path):
    from studio.engine.forward_cost import weight_bytes
    from tests.support.adapters import random_mask_adapter
    plain = tiny_engine("llama", vocab=64, tie_embeddings=True)
    base = weight_bytes(plain)
    assert base == sum(p.numel() * 4 for p in plain.model.parameters())   # one Parameter for the tied table
    plain.with_adapter(str(random_mask_adapter(tmp_path / "ad", plain.model))).activate()
    assert plain.model.lm_head.weight is not plain.model.model.embed_tokens.weight   # a view of the grown table
    assert weight_bytes(plain) == base + plain.config.dim * 4                          # + the MASK row only


def test_with_graphs_a_sequence_s_forwards_replay_graphs_as_a_run_s_do(monkeypatch):
    """On an engine that runs CUDA graphs the table is what a run pays: its batch-1 shapes go through a GraphRunner
    (captured in the warm-up, replayed when timed), the batch shape eagerly."""
    from studio.engine.graphs import GraphRunner
    runners = []
    init = GraphRunner.__init__
    monkeypatch.setattr(GraphRunner, "__init__", lambda self, *a, **k: (init(self, *a, **k), runners.append(self))[0])
    engine = tiny_engine("llama", vocab=64)
    engine.graphs = True
    costs = measure_forwards(engine, repeats=3, warmup=1, context=8)
    (runner,) = runners
    sequence_shapes = [c for c in costs if c.shape.batch == 1]
    assert runner.replays == 4 * len(sequence_shapes) and runner.fallbacks == 0
    assert len(runner.graphs) == len({c.shape.tokens for c in sequence_shapes})


def test_an_moe_step_is_weighed_against_a_dense_model_of_its_active_width(monkeypatch):
    """The dense twin has the MoE model's attention and head, and one SwiGLU per layer as wide as the k experts and
    the shared one together; a dense model gets None."""
    from studio.engine import forward_cost
    from tests.support.parallel import SIGMOID_MOE
    engine = tiny_engine("llama", vocab=64, dim=64, **SIGMOID_MOE)
    timed = []
    real = forward_cost.measure_forwards
    monkeypatch.setattr(forward_cost, "measure_forwards",
                        lambda e, **kw: (timed.append(e), real(e, **kw))[1])
    ratio = forward_cost.moe_step_vs_dense(engine, repeats=2, context=8)
    moe, dense = timed
    assert moe is engine and ratio > 0
    cfg = dense.config
    assert not cfg.n_experts and cfg.ffn_dim == 2 * 16 + 16 and cfg.n_layers == engine.config.n_layers
    assert [n for n, _ in dense.model.named_parameters() if "experts" in n or "gate.weight" in n] == []
    assert forward_cost.moe_step_vs_dense(tiny_engine("llama", vocab=64), repeats=2) is None

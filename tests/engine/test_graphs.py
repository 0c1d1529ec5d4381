"""studio.engine.graphs: the graph runner (and the graph-safe forward under it) against the eager forward.

On CPU the runner "captures" by recording the callable and replays it on the same static buffers, so
these tests check the buffer discipline: every input copied in, nothing read stale. With CUDA the same
tests run on real graph captures (marked `cuda`, skipped without a GPU).
"""
from __future__ import annotations

import pytest
import torch

from studio.engine.graphs import GraphRunner, kv_buckets
from studio.engine.lora import LoadedAdapter, install
from studio.engine.masks import block_causal, causal
from tests.support.lora import random_lora
from tests.support.tiny import FAMILIES, tiny_model

V = 24
BUCKETS = [16, 32, 64]
NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
def device(request):
    return request.param


def close(a, b, device) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= (1e-5 if device == "cpu" else 1e-4)


def random_adapter(model, seed: int = 0, rows=None) -> LoadedAdapter:
    dev = model.lm_head.weight.device
    lora = {name: (A.to(dev), B.to(dev)) for name, (A, B) in random_lora(model, seed=seed).items()}
    return LoadedAdapter(f"random-{seed}", lora, 1.0, rows, None)


def adapted_model(family: str, device: str):
    model = tiny_model(family, vocab=V, seed=1).to(device)
    install(model, random_adapter(model))
    return model


class Twin:
    """One model on two caches in lock step: the eager forward on one, the runner on the other."""

    def __init__(self, model, prompt_len: int = 9, **runner_kw):
        self.model, self.dev = model, model.lm_head.weight.device
        self.ekv, self.kv = model.new_cache(64), model.new_cache(64)
        self.runner = GraphRunner(model, self.kv, buckets=BUCKETS, **runner_kw)
        self.gen = torch.Generator().manual_seed(prompt_len)
        prompt = self.tokens(prompt_len)
        with torch.inference_mode():
            for kv in (self.ekv, self.kv):
                model(prompt, torch.arange(prompt_len, device=self.dev), kv)
        self.commit(prompt_len)

    def tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, V, (n,), generator=self.gen).to(self.dev)

    def forward(self, tokens, positions=None, mask=None, gate=None, rows=None):
        """(eager logits, runner logits) of one extend after the committed KV."""
        L = self.kv.length
        pos = torch.arange(L, L + len(tokens), device=self.dev) if positions is None else positions
        with torch.inference_mode():
            eager = self.model(tokens, pos, self.ekv, mask, gate, rows)
        return eager, self.runner.forward(tokens, pos, self.kv, mask, gate, rows)

    def commit(self, n: int) -> None:
        self.ekv.commit(n)
        self.kv.commit(n)

    def rollback(self, to_len: int) -> None:
        self.ekv.rollback(to_len)
        self.kv.rollback(to_len)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 7])
def test_graph_path_equals_eager_with_masks_and_gates(device, family, T):
    twin = Twin(adapted_model(family, device))
    mask = causal(T, 9, device=device) if T == 1 else block_causal(T, 9, block_size=3, device=device)
    mask[:, 4] = False   # a committed slot hidden from every row
    gate = torch.tensor([True] if T == 1 else [False, True, False, False, True, True, False], device=device)
    eager, graphed = twin.forward(twin.tokens(T), mask=mask, gate=gate)
    assert twin.runner.replays == 1 and close(eager, graphed, device)
    twin.commit(T)
    for a, b in ((twin.ekv.k, twin.kv.k), (twin.ekv.v, twin.kv.v)):
        assert close(a[:, :, :, :9 + T], b[:, :, :, :9 + T], device)


def test_gate_off_rows_are_exactly_base_in_a_graph(device):
    """R-ISD under graphs: the dense gate gives its off rows y + 0 = exactly the base model's values."""
    twin = Twin(adapted_model("qwen3", device))
    tokens = twin.tokens(7)
    _, gated = twin.forward(tokens, gate=torch.tensor([False] * 3 + [True] * 4, device=device))
    _, base = twin.forward(tokens)
    assert torch.equal(gated[:, :3], base[:, :3]) and not close(gated[:, 3:], base[:, 3:], device)


def test_replays_with_changed_inputs_equal_eager(device):
    """One graph (T = 7, bucket 16) replayed with new tokens, positions, masks, gates, logits rows and KV
    lengths -- shrinking ones too, so stale slots of a longer forward lie inside the bucket."""
    twin = Twin(adapted_model("llama", device), max_tokens=8)
    gen = torch.Generator().manual_seed(5)
    previous = None
    for L, custom, rope_copy, rows in [(9, True, False, None), (5, False, True, None), (8, True, True, [0, 6]),
                                       (2, True, False, None), (9, False, False, [3])]:
        twin.rollback(L)
        positions = torch.arange(L, L + 7, device=device)
        if rope_copy:   # SimSD-style: the last rows reuse earlier rows' position ids
            positions[4:] = positions[1:4]
        mask = None
        if custom:      # causal with random holes; every row sees itself
            mask = causal(7, L, device=device) & (torch.rand(7, L + 7, generator=gen) < 0.7).to(device)
            mask[:, L:] |= torch.eye(7, dtype=torch.bool, device=device)
        gate = (torch.rand(7, generator=gen) < 0.5).to(device)
        gate[int(torch.randint(0, 7, (1,), generator=gen))] = True
        eager, graphed = twin.forward(twin.tokens(7), positions, mask, gate, rows)
        assert close(eager, graphed, device)
        assert previous is None or not close(previous, graphed[0, 0], device)
        previous = graphed[0, 0]
        twin.commit(7)
    assert len(twin.runner.graphs) == 1 and twin.runner.replays == 5 and twin.runner.fallbacks == 0


def test_shapes_not_captured_run_eagerly(device):
    model = adapted_model("qwen2", device)
    twin = Twin(model, max_tokens=8)   # both caches hold the same eager prefill
    off = GraphRunner(model, twin.kv, enabled=False)
    same, batched, additive = (lambda m: m), (lambda m: m[None, None]), (lambda m: m.float())
    for runner, kv, T, shape in [(twin.runner, twin.kv, 9, same),      # longer than max_tokens (a prefill)
                                 (twin.runner, twin.kv, 3, batched),   # a batch-shaped mask
                                 (twin.runner, twin.kv, 3, additive),  # a float (additive) mask
                                 (twin.runner, twin.ekv, 3, same),     # another cache
                                 (off, twin.kv, 3, same)]:             # graphs turned off
        tokens, pos = twin.tokens(T), torch.arange(9, 9 + T, device=device)
        mask, gate = shape(causal(T, 9, device=device)), torch.arange(T, device=device) % 2 == 1
        with torch.inference_mode():
            want = model(tokens, pos, twin.ekv, mask, gate)
        assert torch.equal(runner.forward(tokens, pos, kv, mask, gate), want)
    assert twin.runner.fallbacks == 4 and off.fallbacks == 1
    assert twin.runner.replays == off.replays == 0 and not twin.runner.graphs and not off.graphs


def greedy(forward, kv, first: torch.Tensor, n: int) -> list[int]:
    tok, out = first, []
    for _ in range(n):
        with torch.inference_mode():
            tok = forward(tok, torch.tensor([kv.length], device=tok.device), kv)[0, -1].argmax()[None]
        kv.commit(1)
        out.append(int(tok))
    return out


def test_greedy_decode_through_the_runner_equals_eager(device):
    """20 AR steps across two KV buckets, on the plain model (no adapter)."""
    model = tiny_model("qwen3", vocab=V, seed=2).to(device)
    twin = Twin(model, prompt_len=6)
    first = twin.tokens(1)
    eager = greedy(model, twin.ekv, first, 20)
    assert greedy(twin.runner.forward, twin.kv, first, 20) == eager and len(set(eager)) > 3
    assert twin.runner.replays == 20 and sorted(k[1] for k in twin.runner.graphs) == [16, 32]


def test_capture_up_front_keeps_committed_kv_and_covers_every_bucket(device):
    assert kv_buckets(64) == [64] and kv_buckets(100, smallest=16) == [16, 32, 64, 100]
    twin = Twin(adapted_model("llama", device))
    committed = twin.kv.k[:, :, :, :9].clone()
    twin.runner.capture([1, 7])
    assert len(twin.runner.graphs) == 2 * len(BUCKETS) * 2 and twin.kv.length == 9
    assert torch.equal(twin.kv.k[:, :, :, :9], committed)   # the recording wrote only uncommitted slots
    for T, gate in ((7, None), (1, torch.tensor([True], device=device))):
        eager, graphed = twin.forward(twin.tokens(T), gate=gate)
        assert close(eager, graphed, device)
        twin.commit(T)
    assert len(twin.runner.graphs) == 12 and twin.runner.replays == 2


def test_each_adapter_gets_its_own_graphs_and_a_new_table_drops_them(device):
    model = adapted_model("llama", device)
    twin = Twin(model)
    gate = torch.tensor([False, True, True], device=device)
    second = random_adapter(model, seed=1)
    for loaded in (model.active_adapter, second, None, second):
        install(model, loaded)
        eager, graphed = twin.forward(twin.tokens(3), gate=gate)
        assert close(eager, graphed, device)
    assert len(twin.runner.graphs) == 3 and twin.runner.replays == 4
    # an adapter bringing a MASK embedding row grows the table: every graph read the old one
    install(model, random_adapter(model, seed=2, rows=torch.randn(1, model.config.dim, device=device)))
    eager, graphed = twin.forward(torch.tensor([1, 2, V], device=device), gate=gate)
    assert close(eager, graphed, device) and len(twin.runner.graphs) == 1


@pytest.mark.parametrize("name, params", [("ar", {}), ("isd", {"stride": 4}), ("r-isd", {"stride": 3}),
                                          ("jacobi", {"block_size": 4}), ("s2d2", {"block_size": 4, "steps": 4})])
def test_runs_with_graphs_on_decode_exactly_as_eager(tmp_path, monkeypatch, name, params):
    """The wiring (`Engine.graphs` -> DecodeContext): a whole run's decode forwards replay graphs, the prefill
    and wide forwards may run eagerly, and the tokens, forwards and KV moves equal an eager run's."""
    from studio.engine.lora import attach_adapter
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    from studio.run.session import Settings, run_to_end
    from tests.strategies.test_risd import random_adapter as adapter_dir
    from tests.support.tiny import tiny_engine

    runners = []
    init = GraphRunner.__init__
    monkeypatch.setattr(GraphRunner, "__init__", lambda self, *a, **k: (init(self, *a, **k), runners.append(self))[0])
    runs = []
    for graphs in (False, True):
        engine = tiny_engine("llama", vocab=V, seed=5)
        attach_adapter(engine, adapter_dir(tmp_path / f"ad-{graphs}", engine.model, seed=5))
        engine.graphs = graphs
        settings = Settings(max_new_tokens=40, sampling=SamplingParams(0.0))
        runs.append(run_to_end(engine, make_strategy(name, params), settings, "", [1, 2, 3, 4, 5]))
    eager, graphed = runs
    kinds = lambda r: [(e["t"], e.get("role"), e.get("op"), e.get("to_len")) for e in r.events if e["t"] in ("forward", "kv")]
    assert graphed.token_ids == eager.token_ids and len(set(eager.token_ids)) > 2
    assert kinds(graphed) == kinds(eager)
    forwards = [e for e in graphed.events if e["t"] == "forward"]
    (runner,) = runners
    assert runner.replays + runner.fallbacks == len(forwards) and runner.replays >= len(forwards) - 2


def test_runs_reuse_pooled_caches_and_the_graphs_captured_on_them(monkeypatch):
    """With graphs on, a run borrows a cache from the engine's pool and gives it back when it ends, and the
    cache's runner keeps its graphs: a second run of the same shapes captures nothing and replays, with the
    tokens of an eager run. Runs alive at once get caches of their own; a chat keeps its cache (and graphs)
    between turns instead of giving it back."""
    from studio.engine.strategies import make_strategy
    from studio.run.conversation import Conversation
    from studio.run.session import Run, Settings, drive, prepare, run_to_end
    from tests.support.tiny import tiny_engine

    runners = []
    init = GraphRunner.__init__
    monkeypatch.setattr(GraphRunner, "__init__", lambda self, *a, **k: (init(self, *a, **k), runners.append(self))[0])
    settings = Settings(max_new_tokens=24)
    isd = lambda: make_strategy("isd", {"drafting": "fixed"})   # shapes that do not depend on measured costs
    eager_engine = tiny_engine("llama", vocab=V, seed=5)
    eager = [run_to_end(eager_engine, isd(), settings, "", p).token_ids for p in ([1, 2, 3], [3, 2, 1])]

    engine = tiny_engine("llama", vocab=V, seed=5)
    engine.graphs = True
    first = run_to_end(engine, isd(), settings, "", [1, 2, 3])
    (runner,) = runners
    captured, replays = len(runner.graphs), runner.replays
    second = run_to_end(engine, isd(), settings, "", [3, 2, 1])
    assert [first.token_ids, second.token_ids] == eager
    assert len(runners) == 1 and len(runner.graphs) == captured and runner.replays > replays

    a, b = (Run(prepare(engine, isd()), settings, "", [1, 2, 3]) for _ in range(2))
    assert a.ctx.kv is not b.ctx.kv and runner.kv in (a.ctx.kv, b.ctx.kv)
    drive([a, b])
    assert a.result.token_ids == b.result.token_ids
    assert {id(kv) for kv in engine.caches.free[runner.kv.max_len]} == {id(a.ctx.kv), id(b.ctx.kv)}

    chat = Conversation(engine, chat=False)
    turn = chat.start_turn("ab", make_strategy("ar"), settings)
    drive([turn])
    kept = turn.ctx.kv
    assert kept.runner is not None and all(kv is not kept for kv in engine.caches.free.get(kept.max_len, []))
    n_runners = len(runners)
    drive([chat.start_turn("cd", make_strategy("ar"), Settings(max_new_tokens=2))])   # fits the kept cache
    assert chat._kv is kept and len(runners) == n_runners


def _canvas_run(engine, params, graphs: bool, monkeypatch_runners: list):
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    from studio.run.session import Settings, run_to_end
    engine.graphs = graphs
    return run_to_end(engine, make_strategy("canvas", params), Settings(max_new_tokens=16, sampling=SamplingParams(0.0)),
                      "", [1, 2, 3, 4, 5])


@pytest.mark.parametrize("model, params", [
    ("llada", {"cache": "none"}),
    ("llada", {"cache": "dual"}),                       # the open block rewritten inside the cached canvas (a window)
    ("llada", {"cache": "prefix", "prefix_look": 2}),   # the canvas after the prefix, the vicinity recomputed
    ("dream", {"cache": "dual", "after_look": 2}),      # a shifted model: the row before the block too
    ("llada2", {"cache": "prefix", "block_size": 4, "steps": 12}),   # block-causal, sigmoid-routed experts as grouped GEMMs
])
def test_canvas_runs_replay_graphs_and_decode_exactly_as_eager(monkeypatch, model, params):
    """Every canvas forward -- the whole canvas, the canvas past a cached prefix, the open block's window inside a
    cached canvas -- replays a graph (none falls back), and the run's tokens, forwards and KV moves equal an eager
    run's. An MoE model's experts run as grouped GEMMs there, as on CUDA (the path a graph captures)."""
    from studio.engine.moe import Experts
    from tests.support.parallel import SIGMOID_MOE
    from tests.support.tiny import tiny_mdm

    runners = []
    init = GraphRunner.__init__
    monkeypatch.setattr(GraphRunner, "__init__", lambda self, *a, **k: (init(self, *a, **k), runners.append(self))[0])
    monkeypatch.setattr(Experts, "path", "grouped")
    make = {"llada": lambda: tiny_mdm(vocab=V, seed=4), "dream": lambda: tiny_mdm(shift=True, vocab=V, seed=4),
            "llada2": lambda: tiny_mdm(attention="block", block=4, vocab=V, seed=4, dim=64, **SIGMOID_MOE)}[model]
    params = {"block_size": 8, "steps": 10, **params}
    eager, graphed = (_canvas_run(make(), params, graphs, runners) for graphs in (False, True))
    kinds = lambda r: [(e["t"], e.get("role"), e.get("op"), e.get("from_len"), e.get("to_len"), e.get("n_tokens"))
                       for e in r.events if e["t"] in ("forward", "kv")]
    assert graphed.token_ids == eager.token_ids and len(set(eager.token_ids)) > 2
    assert kinds(graphed) == kinds(eager)
    (runner,) = runners
    forwards = [e for e in graphed.events if e["t"] == "forward"]
    assert runner.fallbacks == 0 and runner.replays == len(forwards)
    widths = {key[0] for key in runner.graphs}
    assert max(widths) > 16 and len(runner.graphs) < len(forwards)   # canvas-wide, and replayed more than captured


def test_a_window_forward_through_a_graph_rewrites_only_its_slots(device):
    """The dual cache's forward: the window's slots inside the committed K/V are rewritten, every other slot is left
    as it was, and the logits equal the eager WindowWrite forward's (rows asked past WIDE: only those computed)."""
    from studio.engine.graphs import WIDE
    from studio.engine.kv_cache import WindowWrite
    from studio.engine.masks import bidirectional
    model = tiny_model("llama", vocab=V, seed=2).to(device)
    twin = Twin(model, prompt_len=40, max_tokens=None)
    lo, T = 10, WIDE + 4
    tokens, positions = twin.tokens(T), torch.arange(lo, lo + T, device=device)
    mask = bidirectional(T, 40, device=device)[:, :40]
    rows = [0, 3, 19]
    before = twin.kv.k.clone()
    with torch.inference_mode():
        eager = model(tokens, positions, WindowWrite(twin.ekv, lo), mask, None, rows)
    graphed = twin.runner.forward(tokens, positions, WindowWrite(twin.kv, lo), mask, None, rows)
    assert twin.runner.replays == 1 and close(eager, graphed, device) and graphed.shape[1] == 3
    assert torch.equal(twin.kv.k[:, :, :, :lo], before[:, :, :, :lo])
    assert torch.equal(twin.kv.k[:, :, :, lo + T:40], before[:, :, :, lo + T:40])
    assert close(twin.kv.k[:, :, :, lo:lo + T], twin.ekv.k[:, :, :, lo:lo + T], device)
    assert not close(twin.kv.k[:, :, :, lo:lo + T], before[:, :, :, lo:lo + T], device)


def test_diffusion_gemma_s_self_conditioned_passes_replay_a_graph_per_canvas_and_decode_as_eager(monkeypatch):
    """DiffusionGemma's decoder pass under graphs: each canvas's first pass (no self-conditioning yet) runs eagerly,
    every later one replays the graph captured for that canvas's committed length; tokens and events equal an eager
    run's, through two canvases and the encoder pass between them."""
    from studio.engine.graphs import PassGraphs
    from studio.engine.strategies import make_strategy
    from studio.run.session import Settings, run_to_end
    from tests.support.tiny import tiny_gemma

    passes = []
    init = PassGraphs.__init__
    monkeypatch.setattr(PassGraphs, "__init__", lambda self, *a, **k: (init(self, *a, **k), passes.append(self))[0])
    runs = []
    for graphs in (False, True):
        engine = tiny_gemma(seed=3)
        engine.graphs = graphs
        runs.append(run_to_end(engine, make_strategy("gemma-canvas", {"max_denoising_steps": 5,
                                                                      "confidence_threshold": 0.0}),
                               Settings(max_new_tokens=16, seed=7), "", [1, 2, 3, 4, 5]))
    eager, graphed = runs
    strip = lambda r: [{k: v for k, v in e.items() if k not in ("ms", "wall_ms")} for e in r.events]
    assert graphed.token_ids == eager.token_ids and strip(graphed) == strip(eager)
    drafts = [e for e in graphed.events if e["t"] == "forward" and e["role"] == "draft"]
    canvases = sum(e["t"] == "block" and e["op"] == "open" for e in graphed.events)
    (pass_graphs,) = passes
    assert canvases == 2 and len(drafts) == 10 and pass_graphs.replays == len(drafts) - canvases

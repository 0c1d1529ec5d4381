"""Batched decoding (a stationary batch, studio.engine.batch): every sequence of a greedy batch of ar, isd or r-isd
decodes exactly as its batch-1 run -- the same tokens, forwards and acceptance, counted from the same events -- while
sequences advance at their own rates and stop on their own; `bench --concurrency C` reports batch throughput against
ar."""
from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import torch
from typer.testing import CliRunner

from studio import events as ev
from studio.cli import app
from studio.engine.batch import ContinuousBatch, decode_strategy_batch, round_shape
from studio.engine.engine import Engine
from studio.engine.lora import attach_adapter
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.errors import BadInput
from studio.run.bench import spread
from studio.run.session import RunResult, Settings, encode_prompt, run_to_end
from tests.support.lora import random_adapter
from tests.support.tiny import FAMILIES, tiny_engine

V, N_NEW = 16, 40
_g = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(0, V - 1, (n,), generator=_g).tolist() for n in (3, 8, 1, 5, 2)]   # MASK (V - 1) excluded
# a batch drafts every round in full from its MASK rows, as batch 1 does in fixed drafting without lookup
FULL = {"drafting": "fixed", "lookup": 0}
CASES = [("ar", None), ("isd", dict(FULL, stride=2)), ("isd", dict(FULL, stride=4)),
         ("r-isd", dict(FULL, stride=2)), ("r-isd", dict(FULL, stride=4))]
GREEDY = SamplingParams()


def adapted(tmp_path, family: str, seed: int = 5):
    """A tiny engine with a random adapter (its MASK id is the last vocab entry); ar decodes past it."""
    engine = tiny_engine(family, vocab=V, seed=seed)
    attach_adapter(engine, random_adapter(tmp_path / "ad", engine.model, seed=seed))
    return engine


def alone(engine, name, params, prompt, n=N_NEW):
    return run_to_end(engine, make_strategy(name, params), Settings(max_new_tokens=n), "", prompt)


def with_eos(engine, eos: int):
    engine.config = dataclasses.replace(engine.config, eos_ids=[eos])
    return engine


def eos_some_reach(outputs: list[list[int]]) -> int:
    """A token that some answers reach after their first two tokens and at least one never does: made the EOS, some
    sequences stop early and the others go on to max_new_tokens."""
    def reached(t):
        return [o.index(t) for o in outputs if t in o]
    candidates = [t for t in range(V) if reached(t) and min(reached(t)) >= 2 and len(reached(t)) < len(outputs)]
    return max(candidates, key=lambda t: (len(reached(t)), -t))


def batch_and_alone(tmp_path, family, name, params):
    """A batch of PROMPTS on an adapted tiny engine whose EOS stops some sequences early, and each prompt's batch-1
    run: (engine, batched results, batch-1 RunResults)."""
    engine = adapted(tmp_path, family)
    with_eos(engine, eos_some_reach([alone(engine, name, params, p).token_ids for p in PROMPTS]))
    batched = decode_strategy_batch(engine, make_strategy(name, params), GREEDY, PROMPTS, N_NEW)
    return engine, batched, [alone(engine, name, params, p) for p in PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name, params", CASES)
def test_every_sequence_decodes_as_it_would_alone(tmp_path, family, name, params):
    engine, batched, alone_runs = batch_and_alone(tmp_path, family, name, params)
    for got, want in zip(batched, alone_runs):
        assert got.token_ids == want.token_ids
        assert got.footer["stop_reason"] == want.footer["stop_reason"]
    # an EOS stopped some sequences early while the others went on
    assert {r.footer["stop_reason"] for r in batched} == {"eos", "max_new_tokens"}
    if name != "ar":
        # per-sequence rates: some round accepted every draft, and the sequences took different numbers of forwards
        assert any(e["t"] == "bonus" for r in batched for e in r.events)
        assert len({r.footer["forwards"] for r in batched}) > 2
    if name == "r-isd":   # lossless: the base model's greedy answers
        base = with_eos(tiny_engine(family, vocab=V, seed=5), engine.config.eos_ids[0])
        assert [r.token_ids for r in batched] == [alone(base, "ar", None, p).token_ids for p in PROMPTS]


def without_clock(events: list[dict], entropy_tolerance: bool = False) -> list[dict]:
    """Events less the fields a batch stamps with its own clock; with `entropy_tolerance`, each target entropy
    (`h`) compares within 1e-4: a batched forward reduces in another order than batch 1's, which moves the last
    bits of a float, never an argmax."""
    return [{k: (pytest.approx(v, abs=1e-4) if k == "h" and entropy_tolerance else v)
             for k, v in e.items() if k not in ("ms", "wall_ms")} for e in events]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name, params", CASES)
def test_every_sequence_records_the_events_and_footer_of_its_batch_1_run(tmp_path, family, name, params):
    _, batched, alone_runs = batch_and_alone(tmp_path, family, name, params)
    for got, want in zip(batched, alone_runs):
        # every field but the clock's: kinds, order, step, pos, tok, role, n_tokens, lora_rows, p, q, kv lengths, texts
        assert without_clock(got.events) == without_clock(want.events, entropy_tolerance=True)
        # n_tokens, forwards, tpf, accept_rate, accept_by_pos and text, counted from the events as batch 1 counts
        summary = ev.summarize(got.events)
        assert {k: got.footer[k] for k in summary} == summary == {k: want.footer[k] for k in summary}
        assert got.footer["stop_reason"] == want.footer["stop_reason"]
    forwards = [e for r in batched for e in r.events if e["t"] == "forward"]
    assert {e["role"] for e in forwards} == ({"prefill", "extend"} if name == "ar" else {"prefill", "cold", "verify"})
    if name != "ar":
        assert any(e["lora_rows"] for e in forwards)     # the MASK rows' LoRA is counted, as batch 1 counts it


def test_a_batched_sequence_is_a_trace(tmp_path):
    """Its events and footer are valid trace material: saved under its batch-1 run's header, it reads back whole."""
    _, batched, alone_runs = batch_and_alone(tmp_path, "llama", "isd", {"stride": 3})
    got, want = batched[1], alone_runs[1]
    RunResult(want.header, got.events, got.footer, got.token_ids).save(tmp_path / "seq.jsonl")
    trace = ev.read_trace(tmp_path / "seq.jsonl")
    assert trace.events == got.events and {k: trace.footer[k] for k in got.footer} == got.footer
    assert got.footer["prefill_s"] <= got.footer["wall_s"] and got.footer["tok_s"] > 0   # it decoded after its prefill


@pytest.mark.parametrize("name", ["isd", "r-isd"])
def test_lora_gate_isd_on_real_rows_risd_on_mask_rows_never_on_padding(tmp_path, monkeypatch, name):
    engine = adapted(tmp_path, "llama")
    mask_id, stride = engine.config.mask_token_id, 3
    seen, run = [], engine.model.run

    def spy(tokens, positions, kv, mask, gate, rows):
        on = torch.zeros(tokens.numel(), dtype=torch.bool)
        if gate is not None:
            on[slice(None) if gate.rows is None else gate.rows] = True
        seen.append((tokens.clone(), on.view_as(tokens)))
        return run(tokens, positions, kv, mask, gate, rows)
    monkeypatch.setattr(engine.model, "run", spy)
    decode_strategy_batch(engine, make_strategy(name, {"stride": stride}), GREEDY, PROMPTS, 20)
    rounds = seen[1:]                                                   # after the prefill
    assert all(tokens.shape[1] == 2 * stride - 1 for tokens, _ in rounds)
    n_gated = torch.cat([on.sum(1) for _, on in rounds])
    if name == "r-isd":
        assert all(bool((tokens[on] == mask_id).all()) and not on[:, 0].any() for tokens, on in rounds)
        assert set(n_gated.tolist()) == {stride - 1}
    else:   # cold rounds: pending + MASK rows (the padding is off); verify rounds: every row
        assert all(bool((tokens[~on] == mask_id).all()) and on[:, 0].all() for tokens, on in rounds)
        assert set(n_gated.tolist()) == {stride, 2 * stride - 1}


@pytest.mark.parametrize("name, params", [CASES[0], CASES[2], CASES[4]])
def test_sequences_joining_and_leaving_a_running_batch_decode_as_alone(tmp_path, name, params):
    """The server's continuous batch: prompts join between rounds (one while two others run, one after some left),
    and every sequence records its batch-1 run's events; a dropped sequence stops where it was, cancelled."""
    engine = adapted(tmp_path, "llama")
    with_eos(engine, eos_some_reach([alone(engine, name, params, p).token_ids for p in PROMPTS]))
    want = [alone(engine, name, params, p) for p in PROMPTS]
    batch = ContinuousBatch(engine.for_strategy(name), make_strategy(name, params), GREEDY)
    seqs, sizes = [], []
    for rounds, joining in ((2, [0]), (2, [1, 2]), (1, [3]), (0, [4])):
        seqs += [batch.join(PROMPTS[i], N_NEW) for i in joining]
        for _ in range(rounds):
            sizes.append(len(batch.sequences))
            batch.step()
    dropped = seqs[-1]                                          # the last to join, before its first round
    assert dropped in batch.sequences
    batch.drop(dropped, "cancelled")
    while batch.sequences:
        sizes.append(len(batch.sequences))
        batch.step()
    assert max(sizes) >= 3 and 1 in sizes                       # the batch grew and shrank while it ran
    for seq, alone_run in zip(seqs, want):
        got = seq.result()
        if seq is dropped:
            assert got.footer["stop_reason"] == "cancelled"
            assert got.token_ids == alone_run.token_ids[:len(got.token_ids)]
        else:
            assert without_clock(got.events) == without_clock(alone_run.events, entropy_tolerance=True)
            assert got.footer["stop_reason"] == alone_run.footer["stop_reason"]


@pytest.mark.parametrize("name, params, needle", [
    ("jacobi", None, "batched decoding supports ar, isd, r-isd, not 'jacobi'"),
    ("isd", SamplingParams(temperature=0.7), "greedy only"),
    ("r-isd", {"tau": 0.5}, "verifies exactly"),
])
def test_what_batched_decoding_refuses(name, params, needle):
    with pytest.raises(BadInput, match=needle) as e:
        sampling = params if isinstance(params, SamplingParams) else GREEDY
        round_shape(make_strategy(name, params if isinstance(params, dict) else None), sampling)
    assert "\n" not in str(e.value)


# -- bench --concurrency ---------------------------------------------------------------------------------------
BENCH_PROMPTS = ["abc", "pon", "hello"]   # TinyTokenizer: letters a..p are the vocabulary


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """`dlm-studio bench ARGS` in-process on a tiny engine with BENCH_PROMPTS; returns the CliRunner result."""
    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(BENCH_PROMPTS) + "\n")

    def run(*args):
        return CliRunner().invoke(app, ["bench", "--prompts", str(prompts), *args])
    run.engine = engine
    return run


def test_bench_concurrency_reports_batch_throughput_against_ar(bench):
    res = bench("-s", "isd,r-isd", "--concurrency", "2", "--repeats", "2", "--warmup", "1", "--max-new-tokens", "8",
                "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(res.stdout)
    assert rep["concurrency"] == 2 and rep["batches"] == [[0, 1], [2]]
    assert rep["transformers_tok_s"] is None                      # the transformers baseline is batch-1 only
    ar = rep["strategies"][0]
    assert [s["label"] for s in rep["strategies"]] == ["ar", "isd", "r-isd"]
    for s in rep["strategies"]:
        batches = s["batch_tok_s"]
        assert len(batches) == 2 and all(len(x) == 2 and min(x) > 0 for x in batches)
        assert s["tok_s"] == spread([x for xs in batches for x in xs])
        ratios = [statistics.median(x) / statistics.median(a) for x, a in zip(batches, ar["batch_tok_s"])]
        assert s["speedup_vs_ar"]["median"] == pytest.approx(statistics.median(ratios))
        assert s["speedup_vs_ar"]["n"] == 2 and s["tpf"]["n"] == len(BENCH_PROMPTS) * 2
        assert all(p["tok_s"] is None and len(p["tpf"]) == 2 for p in s["per_prompt"])
        assert s["exact_match_vs_ar"] == 1.0                         # greedy isd/r-isd without an adapter: lossless
    # per sequence, TPF is that of the prompt's batch-1 run drafting in full, as every round of a batch does
    engine = bench.engine
    want = [alone(engine, "isd", FULL, encode_prompt(engine, p), 8).footer["tpf"] for p in BENCH_PROMPTS]
    assert [p["tpf"] for p in rep["strategies"][1]["per_prompt"]] == [[pytest.approx(t)] * 2 for t in want]


def test_bench_concurrency_measures_ar_one_prompt_at_a_time_beside_its_batches(bench, monkeypatch):
    import studio.run.bench as bench_module
    sizes, decode = [], bench_module.decode_strategy_batch
    monkeypatch.setattr(bench_module, "decode_strategy_batch", lambda engine, strategy, sampling, prompts, n:
                        sizes.append((strategy.name, len(prompts))) or decode(engine, strategy, sampling, prompts, n))
    res = bench("-s", "isd", "--concurrency", "2", "--repeats", "2", "--warmup", "0", "--max-new-tokens", "6", "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(res.stdout)
    # per repeat and batch ([0, 1], then [2]): ar and isd on the batch, then ar on its prompts one at a time
    assert sizes == [("ar", 2), ("isd", 2), ("ar", 1), ("ar", 1), ("ar", 1), ("isd", 1), ("ar", 1)] * 2
    assert rep["ar_batch1_tok_s"]["n"] == 4 and rep["ar_speedup_vs_batch1"]["n"] == 2
    assert rep["ar_speedup_vs_batch1"]["median"] > 0


def test_bench_concurrency_table_and_batch_1_fields(bench):
    res = bench("-s", "isd", "--concurrency", "2", "--repeats", "1", "--warmup", "0", "--max-new-tokens", "4")
    assert res.exit_code == 0, (res.output, res.exception)
    assert "stationary batches of 2" in res.stdout and "batch tok/s" in res.stdout
    assert "ar in batches of 2: ×" in res.stdout and "one prompt at a time" in res.stdout
    res = bench("-s", "isd", "--repeats", "1", "--warmup", "0", "--max-new-tokens", "4", "--no-transformers", "--json")
    rep = json.loads(res.stdout)
    assert rep["concurrency"] == 1 and rep["batches"] is None
    assert rep["ar_batch1_tok_s"] is None and rep["ar_speedup_vs_batch1"] is None
    assert all(s["batch_tok_s"] is None and len(s["per_prompt"][0]["tok_s"]) == 1 for s in rep["strategies"])


@pytest.mark.parametrize("args, needle", [
    (["-s", "jacobi", "--concurrency", "2"], "batched decoding supports ar, isd, r-isd, not 'jacobi'"),
    (["-s", "isd", "--concurrency", "2", "--temperature", "1"], "greedy only"),
    (["-s", "isd", "--concurrency", "2", "--oracle-accept", "0.5"], "--oracle-accept applies to batch-1 runs only"),
    (["-s", "isd", "--concurrency", "0"], "--concurrency must be >= 1"),
])
def test_bench_concurrency_bad_input_before_the_model_loads(monkeypatch, args, needle):
    monkeypatch.setattr(Engine, "load", staticmethod(lambda *a, **kw: pytest.fail("the model was loaded")))
    res = CliRunner().invoke(app, ["bench", *args])
    assert isinstance(res.exception, BadInput) and needle in str(res.exception) and "\n" not in str(res.exception)


def test_a_batch_drafts_only_where_the_cost_table_says_a_full_round_pays():
    from studio.engine.batch import batch_stride
    from studio.engine.cost_table import FLAT_COSTS, CostTable
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    greedy = SamplingParams(0.0)
    isd, ar = make_strategy("isd", {"stride": 4}), make_strategy("ar")
    linear = CostTable({"test": "linear"}, 0, tuple(float(n) for n in range(1, 17)))
    # 1.47 tokens a sequence (prior 0.5) for 7 rows against 1 for 1: a full round must cost under 1.47 AR rounds,
    # judged at 2 sequences (14 of the table's 16 rows) however large the batch
    half = CostTable({"test": "half"}, 0, (1.0,) * 6 + (1.6,) * 10)
    assert [batch_stride(isd, greedy, costs, 8, False) for costs in (FLAT_COSTS, None, linear, half)] == [4, 4, 1, 1]
    almost = CostTable({"test": "almost"}, 0, (1.0,) * 6 + (1.45,) + (1.5,) * 9)   # 1 sequence: 1.45 < 1.47
    assert batch_stride(isd, greedy, almost, 1, False) == 4 and batch_stride(isd, greedy, almost, 8, False) == 1
    assert batch_stride(ar, greedy, linear, 8, False) == batch_stride(ar, greedy, FLAT_COSTS, 8, False) == 1


def test_an_isd_batch_at_stride_1_answers_greedy_ar():
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    engine = tiny_engine("llama", vocab=24, seed=5)
    ar = ContinuousBatch(engine, make_strategy("ar"), SamplingParams(0.0))
    isd = ContinuousBatch(engine, make_strategy("isd"), SamplingParams(0.0), stride=1)
    seqs = [(b.join([1, 2, 3, 4], 20), b) for b in (ar, isd)]
    while ar.sequences or isd.sequences:
        ar.step(), isd.step()
    (a, _), (i, _) = seqs
    assert i.result().token_ids == a.result().token_ids and len(a.result().token_ids) == 20
    assert {e["role"] for e in i.result().events if e["t"] == "forward"} == {"prefill", "extend"}
    with pytest.raises(ValueError, match="stride 4 or 1, not 2"):
        ContinuousBatch(engine, make_strategy("isd"), SamplingParams(0.0), stride=2)

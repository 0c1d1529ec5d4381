"""The confidence-threshold block-diffusion baseline: unmasking rules, blocks, commit forwards, events."""
import pytest
import torch

from studio import events as ev
from studio.engine.strategies import make_strategy
from studio.engine.strategies.unmasking import select_dynamic, select_hierarchical, top_k, transfer_counts
from studio.errors import BadInput
from tests.support.dlm import block_size_one_greedy, generate, opened
from tests.support.tiny import FAMILIES, tiny_dlm


# -- rules ---------------------------------------------------------------------------------------
def test_transfer_counts_spread_the_remainder_first():
    assert transfer_counts(4, 4) == [1, 1, 1, 1]
    assert transfer_counts(7, 3) == [3, 2, 2]
    assert transfer_counts(2, 4) == [1, 1, 0, 0]


def test_top_k_keeps_slot_order_and_breaks_ties_left():
    assert top_k([0.1, 0.9, 0.5, 0.9], 2) == [1, 3]
    assert top_k([0.5, 0.5, 0.5], 1) == [0]


def test_dynamic_takes_every_confident_slot_or_the_top_quota():
    assert select_dynamic([0.95, 0.2, 0.91, 0.3], 1, 0.9) == [0, 2]
    assert select_dynamic([0.5, 0.2, 0.6, 0.3], 1, 0.9) == [2]        # none passes: the top-1
    assert select_dynamic([0.95, 0.2, 0.6, 0.3], 2, 0.9) == [0, 2]    # one passes, quota 2: top-2


def test_hierarchical_takes_one_per_masked_run_above_low():
    slots = [0, 1, 2, 5, 6, 9]
    conf = [0.7, 0.65, 0.1, 0.3, 0.5, 0.95]
    # runs {0,1,2} best 0 (0.7 > 0.62), {5,6} best 6 (0.5 < 0.62: skipped), {9} best 9 (> high too)
    assert select_hierarchical(conf, slots, threshold=0.9, low=0.62) == [0, 5]
    # nothing passes either threshold: the global top-1 alone
    assert select_hierarchical([0.1, 0.3, 0.2], [0, 1, 2], threshold=0.9, low=0.62) == [1]


def test_credit_boosts_a_repeated_top1():
    engine = tiny_dlm()
    strat = make_strategy("blockdiff", {"decoder": "credit"})
    opened(engine, strat, [1, 2, 3, 4])
    logits = torch.zeros(2, 16)
    logits[:, 5] = 1.0
    first = strat.credit.fuse([0, 1], logits, strat.B)
    second = strat.credit.fuse([0, 1], logits, strat.B)
    assert (first[:, 5] > logits[:, 5]).all() and (second[:, 5] > first[:, 5]).all()
    assert torch.equal(first[:, 6], logits[:, 6])   # only the top-1 earns credit


@pytest.mark.parametrize("params", [{"block_size": -1}, {"schedule": "fast"}, {"decoder": "magic"},
                                    {"threshold": 1.5}, {"credit_alpha": -1.0}, {"nope": 1}])
def test_bad_params_are_clear_errors(params):
    with pytest.raises(BadInput):
        make_strategy("blockdiff", params)


# -- runs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("params", [{}, {"schedule": "static", "steps": 2}, {"decoder": "hierarchical"},
                                    {"decoder": "credit"}, {"cache": "causal", "causal_prefix": True}])
def test_runs_end_to_end_with_consistent_events(tmp_path, family, shift, params):
    engine = tiny_dlm(family, shift)
    trace = tmp_path / "t.jsonl"
    r = generate(engine, "blockdiff", params, prompt=[1, 2, 3, 4, 5, 6], n=21, temperature=1.0, seed=3, trace=trace)
    back = ev.read_trace(trace)
    assert back.footer["n_tokens"] == 21 == len(r.token_ids)
    assert [t for e in r.events if e["t"] == "emit" for t in e["tok"]] == r.token_ids
    assert [p for e in r.events if e["t"] == "emit" for p in e["pos"]] == list(range(21))
    unmasked = {p: t for e in r.events if e["t"] == "unmask" for p, t in zip(e["pos"], e["tok"])}
    for p, tok in enumerate(r.token_ids):
        if p in unmasked:
            assert unmasked[p] == tok
    # right-shifted: only slot 0 of each later block (predicted by the commit forward) is never unmasked;
    # the first block's slot 0 is prompt (6 tokens: one whole block prefilled, the tail [5, 6] in block 2)
    n_predicted = sum(p not in unmasked for p in range(21))
    n_opened = sum(1 for e in r.events if e["t"] == "block" and e["op"] == "open")
    assert n_predicted == (n_opened - 1 if shift else 0)
    fwd = [e for e in r.events if e["t"] == "forward"]
    assert {f["role"] for f in fwd} <= {"prefill", "draft", "commit"}
    assert all(f["n_tokens"] == 4 for f in fwd if f["role"] != "prefill")
    commits = [e for e in r.events if e["t"] == "kv" and e["op"] == "commit"]
    assert all(c["to_len"] % 4 == 0 for c in commits)   # blocks stay aligned to multiples of B


def test_static_schedule_unmasks_the_quota_per_step():
    engine = tiny_dlm("llama", False)
    r = generate(engine, "blockdiff", {"schedule": "static", "block_size": 4, "steps": 2}, prompt=[1, 2, 3, 4], n=12)
    sizes = [len(e["pos"]) for e in r.events if e["t"] == "unmask"]
    assert sizes == [2] * 6


def test_threshold_zero_fills_a_block_in_one_step():
    engine = tiny_dlm("llama", False)
    r = generate(engine, "blockdiff", {"threshold": 0.0}, prompt=[1, 2, 3, 4], n=12)
    roles = [e["role"] for e in r.events if e["t"] == "forward"][1:]
    assert roles == ["draft", "commit"] * 2 + ["draft"]   # the last block needs no commit: output is done
    assert r.footer["tpf"] == pytest.approx(12 / 5)


def test_block_size_one_is_autoregressive():
    # right-shifted, B = 1: every block is just the token the last commit forward predicted = greedy AR
    engine = tiny_dlm("qwen2", True, vocab=24, seed=4)
    ar = generate(engine, "ar", n=30)
    bd = generate(engine, "blockdiff", {"block_size": 1}, n=30)
    assert bd.token_ids == ar.token_ids
    # position-aligned, B = 1 with a causal cache: the model in block-size-1 mode
    engine = tiny_dlm("qwen3", False, vocab=24, seed=4)
    bd = generate(engine, "blockdiff", {"block_size": 1, "cache": "causal"}, n=20)
    assert bd.token_ids == block_size_one_greedy(engine, [1, 2, 3, 4, 5], 20)


def test_stops_at_eos_and_never_emits_mask():
    engine = tiny_dlm("llama", False, eos_ids=(3,), vocab=16, seed=9)
    for seed in range(5):
        r = generate(engine, "blockdiff", {}, n=60, temperature=1.0, seed=seed)
        assert 15 not in r.token_ids
        assert r.footer["stop_reason"] == ("eos" if 3 in r.token_ids else "max_new_tokens")

"""Training (DESIGN §8) on tiny models: data, the App. E layout, the two-pass fast path, the objectives,
checkpoint/resume, and the saved adapter in the studio and in peft."""
from __future__ import annotations

import dataclasses
import json

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from studio.engine.batch import greedy_batch
from studio.engine.kv_cache import KVCache
from studio.engine.lora import attach_adapter, read_adapter
from studio.engine.strategies import make_strategy
from studio.errors import BadInput
from studio.run.session import Settings, run_to_end
from studio.train import data as train_data
from studio.train.layout import app_e_mask, block_positions, noisy_rows_mask
from studio.train.objectives import IGNORE, IDLM, Batch, Block
from studio.train.prompts import STYLES, everyday_prompts, eval_prompts, read_prompt_file, training_prompts
from studio.train.trainable import Trainable
from studio.train.trainer import TrainConfig, train
from tests.support.tiny import FAMILIES, tiny_engine, tiny_model

V = 16


def allowed(q: int, kv: int, n: int, b: int) -> bool:
    """The reference's `block_diff_mask` (use_regular_causal=True), read literally (references/idlm.md §6.2)."""
    q_clean, kv_clean = q >= n, kv >= n
    bq = (q - n) // b if q_clean else q // b
    bkv = (kv - n) // b if kv_clean else kv // b
    m_noisy = bq == bkv and not q_clean and not kv_clean and q >= kv
    m_cross = bq > bkv and kv_clean and not q_clean
    m_clean = q_clean and kv_clean and q >= kv
    return m_noisy or m_cross or m_clean


@pytest.mark.parametrize("n,b", [(6, 1), (6, 2), (7, 3), (9, 3)])
def test_app_e_mask_equals_a_brute_force_reading_of_the_reference(n, b):
    brute = torch.tensor([[allowed(q, k, n, b) for k in range(2 * n)] for q in range(2 * n)])
    assert torch.equal(app_e_mask(n, b), brute)


@pytest.mark.parametrize("n,b", [(6, 1), (6, 2), (9, 3)])
def test_the_noisy_rows_mask_at_aligned_starts_is_app_e_over_clean_then_noisy_columns(n, b):
    ref = app_e_mask(n, b)[:n]                                # the x_t rows
    ours = noisy_rows_mask(list(range(0, n, b)), b, n)        # columns: [clean | noisy]
    assert torch.equal(ours, torch.cat([ref[:, n:], ref[:, :n]], dim=1))


def _seqs(engine, n=48, plen=5, new=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (plen,), generator=g).tolist() for _ in range(n)]
    outs = greedy_batch(engine.model, prompts, new, [])
    return [train_data.Sequence(p + o, len(p)) for p, o in zip(prompts, outs)]


def _ar_engine(family="llama", seed=0, **kw):
    """A tiny AR engine without a MASK token (training adds one at id V)."""
    e = tiny_engine(family, vocab=V, seed=seed, **kw)
    e.model.config = e.config = dataclasses.replace(e.config, mask_token_id=None)
    return e


@pytest.mark.parametrize("gate_all", [False, True])
def test_two_pass_training_forward_equals_one_forward_over_the_app_e_layout(gate_all):
    """The CPU fast path (clean pass, then noisy rows over its K/V) computes what the reference's single
    [x_t | x_0] forward with the App. E mask computes, for the LoRA gate of either recipe."""
    n, b = 9, 3
    model = tiny_model("llama", vocab=V, seed=1)
    tr = Trainable(model, r=4, alpha=8, seed=0)
    with torch.no_grad():   # a non-trivial adapter
        for _, t in tr.named_tensors():
            t.normal_(0, 0.3)
    x0 = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(2))
    objective = IDLM(V, gate_all)
    # the reference layout: one forward of 2n rows, duplicated positions
    tokens = torch.cat([torch.full((n,), V), x0])
    pos = torch.cat([torch.arange(n), torch.arange(n)])
    gate = torch.ones(2 * n, dtype=torch.bool) if gate_all else torch.arange(2 * n) < n
    with torch.no_grad():
        ref = model(tokens, pos, KVCache(2, 2, 8, 2 * n), mask=app_e_mask(n, b), lora_gate=gate)[0]
    targets = torch.cat([x0[1:], torch.tensor([IGNORE])])
    ref_task = F.cross_entropy(ref[:n], targets, ignore_index=IGNORE)
    starts = list(range(0, n, b))
    batch = Batch(clean=x0[None], clean_targets=targets[None], noisy=torch.full((1, n), V),
                  positions=block_positions(starts, b)[None], mask=noisy_rows_mask(starts, b, n)[None],
                  gate=torch.ones(1, n, dtype=torch.bool), targets=targets[None],
                  slot=(torch.arange(n) % b + 1)[None], source=torch.arange(n)[None])
    losses = objective.loss(model, batch, n_slots=b)
    assert losses.task == pytest.approx(float(ref_task), abs=1e-5)
    # --mask-loss kl: each MASK row's target is the base model's law at its source row (the clean row before the
    # target's position), not the data's token alone
    with torch.no_grad():
        base_law = model(x0, torch.arange(n), KVCache(2, 2, 8, n))[0].log_softmax(-1)
    rows = targets != IGNORE
    ref_soft = (base_law.exp() * (base_law - ref[:n].log_softmax(-1)))[rows].sum(-1).mean()
    objective.mask_loss = "kl"
    soft = objective.loss(model, batch, n_slots=b)
    assert soft.task == pytest.approx(float(ref_soft), abs=1e-5) and soft.task != pytest.approx(losses.task)
    assert soft.clean == losses.clean and soft.correct.tolist() == losses.correct.tolist()
    objective.mask_loss = "ce"
    if gate_all:
        ref_clean = F.cross_entropy(ref[n:], targets, ignore_index=IGNORE)
        assert losses.clean == pytest.approx(float(ref_clean), abs=1e-5)
        # --clean-loss kl: KL(base || adapted) over the answer rows, the base being the model without its LoRA
        objective.clean_loss = "kl"
        with torch.no_grad():
            base = model(x0, torch.arange(n), KVCache(2, 2, 8, n))[0]
        rows = targets != IGNORE
        ref_kl = (base.log_softmax(-1).exp() * (base.log_softmax(-1) - ref[n:].log_softmax(-1)))[rows].sum(-1).mean()
        kl = objective.loss(model, batch, n_slots=b)
        assert kl.task == losses.task and kl.clean == pytest.approx(float(ref_kl), abs=1e-5) and kl.clean > 1e-3
        with torch.no_grad():                     # no adapter effect, no divergence
            for name, t in tr.named_tensors():
                if name.endswith("lora_B"):
                    t.zero_()
        assert objective.loss(model, batch, n_slots=b).clean == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("objective", [IDLM(V, False), Block(V, False, 4, shift=True)], ids=["idlm", "block"])
def test_each_target_s_soft_target_source_is_the_clean_row_before_its_position(objective):
    """--mask-loss kl reads the base model's law at a target's source row: the row that predicts the target's
    position in the clean sequence, whose next token is the target."""
    seqs = [train_data.Sequence(list(range(1, 40)), 6), train_data.Sequence([5, 9, 2, 7] * 8, 4)]
    batch = objective.make_batch(seqs, rows_per_seq=12, progress=1.0, gen=torch.Generator().manual_seed(0))
    rows = batch.targets != IGNORE
    assert rows.sum() > 8
    for b, r in rows.nonzero().tolist():
        assert seqs[b].tokens[batch.source[b, r] + 1] == batch.targets[b, r]


def _acceptance(engine, prompts, strategy, params):
    acc = prop = 0
    outs = []
    for p in prompts:
        r = run_to_end(engine, make_strategy(strategy, params), Settings(max_new_tokens=20), "", p)
        outs.append(r.token_ids)
        acc += sum(len(e["pos"]) for e in r.events if e["t"] == "accept")
        prop += sum(len(e["pos"]) for e in r.events if e["t"] == "accept") + sum(e["t"] == "reject" for e in r.events)
    return acc / max(1, prop), outs


def test_idlm_training_lowers_the_loss_and_raises_r_isd_acceptance_losslessly(tmp_path):
    """On its own data the trained R-ISD adapter is accepted more often than the untrained one, and greedy
    R-ISD with it still equals greedy AR token for token."""
    engine = _ar_engine(seed=3)
    seqs = _seqs(engine)
    untrained = tmp_path / "untrained"
    Trainable(tiny_model("llama", vocab=V, seed=3), r=8, alpha=16).save(untrained)
    cfg = TrainConfig(kind="idlm", gate="mask", steps=120, batch_size=8, rows_per_seq=24, lr=1e-2, r=8, alpha=16,
                      save_every=1000)
    log = []
    train(tiny_model("llama", vocab=V, seed=3), seqs, IDLM(V, False), cfg, tmp_path / "trained", on_step=log.append)
    first = sum(r.task for r in log[:10]) / 10
    last = sum(r.task for r in log[-10:]) / 10
    assert last < 0.8 * first
    assert [r.width for r in (log[0], log[50], log[-1])] == [1, 2, 3]          # curriculum N = 2 -> 3 -> 4
    prompts = [s.tokens[:s.prompt_len] for s in seqs[:8]]
    ar = [run_to_end(_ar_engine(seed=3), make_strategy("ar"), Settings(max_new_tokens=20), "", p).token_ids
          for p in prompts]
    rates = {}
    for name, path in (("untrained", untrained), ("trained", tmp_path / "trained")):
        e = _ar_engine(seed=3)
        attach_adapter(e, path)
        rates[name], outs = _acceptance(e, prompts, "r-isd", {"stride": 4, "lookup": 0})   # the MASK rows' drafts alone
        assert outs == ar
    assert rates["trained"] > rates["untrained"] + 0.15, rates


def test_block_training_lowers_the_loss_and_trains_masked_slots_only(tmp_path):
    engine = _ar_engine(seed=4)
    seqs = _seqs(engine, seed=1)
    objective = Block(V, gate_all=False, block_size=4, shift=True)
    batch = objective.make_batch(seqs[:4], 12, 0.0, torch.Generator().manual_seed(0))
    # right-shifted: slot 0 is never masked; a target sits on the row before each masked slot
    slots = batch.noisy.view(4, -1, 4)
    assert not (slots[..., 0] == V).any() and (slots == V).any()
    tgt = batch.targets.view(4, -1, 4)
    assert torch.equal(tgt[..., :3] != IGNORE, slots[..., 1:] == V) and (tgt[..., 3] == IGNORE).all()
    assert torch.equal(batch.gate, batch.noisy == V)
    cfg = TrainConfig(kind="block", gate="mask", steps=100, batch_size=8, rows_per_seq=24, lr=1e-2, r=8, alpha=16,
                      block_size=4, save_every=1000)
    log = []
    train(tiny_model("llama", vocab=V, seed=4), seqs, objective, cfg, tmp_path / "ad", on_step=log.append)
    assert sum(r.task for r in log[-10:]) < 0.8 * sum(r.task for r in log[:10])


def test_a_block_adapter_brings_its_block_size_to_the_block_strategies(tmp_path):
    """A block adapter trained at B = 6 makes 6 the default block of blockdiff/s2d2/simsd on it (an explicit
    block_size still wins); an I-DLM adapter records none. Both record the rows they were trained on (--gate)."""
    engine = _ar_engine(seed=4)
    seqs = _seqs(engine, seed=1)
    cfg = TrainConfig(kind="block", gate="mask", steps=1, batch_size=2, rows_per_seq=12, r=2, alpha=4, block_size=6)
    train(tiny_model("llama", vocab=V, seed=4), seqs, Block(V, False, 6, shift=True), cfg, tmp_path / "b6")
    idlm = TrainConfig(kind="idlm", gate="mask", steps=1, batch_size=2, rows_per_seq=6, r=2, alpha=4)
    train(tiny_model("llama", vocab=V, seed=4), seqs, IDLM(V, False), idlm, tmp_path / "isd")
    assert read_adapter(tmp_path / "b6").block_size == 6 and read_adapter(tmp_path / "isd").block_size is None
    assert read_adapter(tmp_path / "b6").adapted_rows == read_adapter(tmp_path / "isd").adapted_rows == "mask"
    e = engine.with_adapter(str(tmp_path / "b6"))
    assert e.config.adapter_block_size == 6 and engine.config.adapter_block_size is None
    for name, params, block in [("blockdiff", {}, 6), ("s2d2", {}, 6), ("simsd", {}, 6), ("blockdiff", {"block_size": 3}, 3)]:
        strategy = make_strategy(name, params)
        run_to_end(e, strategy, Settings(8), "", [1, 2, 3])
        assert strategy.B == block, (name, params)
    strategy = make_strategy("blockdiff")
    run_to_end(engine.with_adapter(str(tmp_path / "isd")), strategy, Settings(8), "", [1, 2, 3])
    assert strategy.B == 4


def test_resume_continues_exactly_where_an_uninterrupted_run_would_be(tmp_path):
    engine = _ar_engine(seed=5)
    seqs = _seqs(engine, n=16)
    cfg = TrainConfig(kind="idlm", gate="all", steps=6, batch_size=4, rows_per_seq=6, r=2, alpha=4, save_every=3)
    train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True), cfg, tmp_path / "whole")
    state = train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True), cfg, tmp_path / "split",
                  time_budget_s=0.0)   # stops before the first step
    assert state["step"] == 0 and state["stopped"] == "time budget"

    def ctrl_c_after_step_3(report):
        if report.step == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):   # saves a checkpoint on the way out
        train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True), cfg, tmp_path / "split", resume=True,
              on_step=ctrl_c_after_step_3)
    assert json.loads((tmp_path / "split" / "train_state.json").read_text())["step"] == 3
    state = train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True), cfg, tmp_path / "split", resume=True)
    assert state["step"] == 6 and state["stopped"] == "done"
    log = (tmp_path / "split" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in log] == [1, 2, 3, 4, 5, 6]
    a, b = read_adapter(tmp_path / "whole"), read_adapter(tmp_path / "split")
    for name in a.lora:
        for x, y in zip(a.lora[name], b.lora[name]):
            assert torch.allclose(x, y, atol=1e-6), name
    assert torch.allclose(a.mask_embedding, b.mask_embedding, atol=1e-6)
    with pytest.raises(BadInput, match="already holds a training run"):
        train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True), cfg, tmp_path / "whole")
    with pytest.raises(BadInput, match="cannot resume"):
        train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True), dataclasses.replace(cfg, r=3),
              tmp_path / "whole", resume=True)


def test_init_starts_from_a_trained_adapter_with_a_new_schedule(tmp_path):
    engine = _ar_engine(seed=5)
    seqs = _seqs(engine, n=16)
    cfg = TrainConfig(kind="idlm", gate="mask", steps=12, batch_size=4, rows_per_seq=6, r=2, alpha=4, lr=1e-2,
                      save_every=12)
    first = []
    train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, False), cfg, tmp_path / "a", on_step=first.append)
    warm = dataclasses.replace(cfg, gate="all", steps=2, start_stride=4, init=str(tmp_path / "a"))
    cont = []
    state = train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True, curriculum=(4,)), warm,
                  tmp_path / "b", on_step=cont.append)
    assert state["step"] == 2 and state["config"]["init"] == str(tmp_path / "a")
    assert cont[0].lr > first[-1].lr and cont[0].width == 3       # a schedule of its own, N = 4 from the start
    fresh = []
    train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True, curriculum=(4,)),
          dataclasses.replace(warm, init=None), tmp_path / "c", on_step=fresh.append)
    assert cont[0].task < fresh[0].task                           # the same first batch, a trained start
    with pytest.raises(BadInput, match="has rank 2"):
        train(tiny_model("llama", vocab=V, seed=5), seqs, IDLM(V, True), dataclasses.replace(warm, r=4),
              tmp_path / "d")


@pytest.mark.filterwarnings("ignore:Unexpected keyword arguments")   # peft ignores mask_token_id, adapted_rows
def test_the_saved_adapter_loads_in_peft_on_the_transformers_model_of_the_same_weights(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel

    from tests.support.tiny import hf_pair
    hf, ours = hf_pair("llama", seed=0)
    g = torch.Generator().manual_seed(0)
    seqs = [train_data.Sequence(torch.randint(0, 96, (20,), generator=g).tolist(), 4) for _ in range(8)]
    cfg = TrainConfig(kind="idlm", gate="all", steps=3, batch_size=4, rows_per_seq=6, r=4, alpha=8, lr=1e-2)
    train(ours, seqs, IDLM(96, True), cfg, tmp_path / "ad")
    assert read_adapter(tmp_path / "ad").adapted_rows == "all"     # recorded: the LoRA of every row (--gate all)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    # the studio applying the adapter on every row == peft's LoRA model
    fresh = hf_pair("llama", seed=0)[1]
    engine = dataclasses.replace(tiny_engine(), model=fresh, config=fresh.config)
    attach_adapter(engine, tmp_path / "ad")
    ids = torch.randint(0, 96, (12,), generator=g)
    with torch.no_grad():
        want = peft_model(ids[None]).logits[0]
        got = fresh(ids, torch.arange(12), fresh.new_cache(16), lora_gate=torch.ones(12, dtype=torch.bool))[0]
    assert (want - fresh(ids, torch.arange(12), fresh.new_cache(16))[0]).abs().max() > 1e-3   # it did change
    assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_equals_each_prompt_alone(family):
    model = tiny_model(family, vocab=24, seed=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (3, 9, 5, 1, 7, 4)]
    free = [greedy_batch(model, [p], 30, [])[0] for p in prompts]
    eos = [free[0][12]]          # a token one answer reaches mid-way
    batched = greedy_batch(model, prompts, 30, eos)
    alone = [greedy_batch(model, [p], 30, eos)[0] for p in prompts]
    assert batched == alone
    assert any(len(o) < 30 for o in batched) and any(len(o) == 30 for o in batched)   # EOS and the cap both hit
    assert all(o[-1] == eos[0] for o in batched if len(o) < 30)


def test_evaluation_prompts_are_disjoint_from_the_training_prompts():
    held = set(eval_prompts())
    assert len(held) >= 30
    train_all = set(training_prompts(100_000))
    assert len(train_all) > 3000 and not held & train_all
    assert len(set(training_prompts(2000, seed=1))) == 2000
    # beyond the pool: the pool asked again with a style line, distinct, the pool's own prompts first
    pool = training_prompts(10_000)[:len(set(training_prompts(6000)))]
    big = training_prompts(40_000, seed=2)
    assert len(set(big)) == 40_000 and set(training_prompts(6000, seed=2)) <= set(big)
    bases = {p[:-len(s) - 1] for p in big for s in STYLES if p.endswith(" " + s)}
    assert len(bases) > 3000 and bases <= set(pool) and not held & set(big)
    # the everyday requests: a held-out value reaches no training prompt; a sample holds its share of them
    chat_held, chat_train = set(everyday_prompts(held_out=True)), set(everyday_prompts(held_out=False))
    assert chat_held and not chat_held & train_all
    assert 200 <= len(set(training_prompts(2048)) & chat_train) <= 512
    # the README's ordinary-prompt bench: 30+ prompts no adapter trained on (nor evaluated on)
    ordinary = read_prompt_file(Path(__file__).parents[2] / "bench" / "ordinary-prompts.txt")
    assert len(set(ordinary)) == len(ordinary) >= 30 and not set(ordinary) & (train_all | held)


def test_data_shards_round_trip_and_resume(tmp_path):
    engine = _ar_engine(seed=6, eos_ids=(3,))
    prompts = [chr(97 + i % 12) * (1 + i % 4) for i in range(10)]
    m = train_data.generate(engine, prompts[:6], tmp_path / "d", 8, batch_size=4, shard_size=4)
    assert m["shard_sizes"] == [4, 2]
    with pytest.raises(BadInput, match="already holds"):
        train_data.generate(engine, prompts[:6], tmp_path / "d", 8)
    with pytest.raises(BadInput, match="different n_prompts"):
        train_data.generate(engine, prompts, tmp_path / "d", 8, resume=True)
    seqs = train_data.load_sequences(tmp_path / "d")
    alone = [greedy_batch(engine.model, [[ord(c) - 97 for c in p]], 8, [3])[0] for p in prompts[:6]]
    assert [s.tokens[s.prompt_len:] for s in seqs] == alone
    lines = (tmp_path / "d" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(x)["prompt"] for x in lines] == prompts[:6]


def test_a_half_precision_model_trains_fp32_tensors_through_their_casts(tmp_path):
    """On a bf16 model (`--dtype bf16`, the GPU campaign's) the LoRA and the MASK row stay fp32 (steps of lr x
    1e-3 would round away in bf16), the forward computes with their bf16 casts, and the loss still falls."""
    engine = _ar_engine(seed=3)
    seqs = _seqs(engine)
    model = tiny_model("llama", vocab=V, seed=3).to(torch.bfloat16)
    cfg = TrainConfig(kind="idlm", gate="all", steps=60, batch_size=8, rows_per_seq=12, lr=1e-2, r=4, alpha=8,
                      save_every=1000)
    log = []
    train(model, seqs, IDLM(V, True), cfg, tmp_path / "bf16", on_step=log.append)
    assert sum(r.task for r in log[-10:]) < 0.9 * sum(r.task for r in log[:10])
    saved = read_adapter(tmp_path / "bf16")
    assert all(A.dtype == B.dtype == torch.float32 for A, B in saved.lora.values())
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.lora_A.dtype == torch.bfloat16 and layer.lora_A.grad_fn is not None   # a cast of the fp32 tensor

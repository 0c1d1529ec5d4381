"""`train mdm` on tiny models: the masked-diffusion objective (what it masks, what it weights, the attention it
trains), and the adapter it writes, which makes the model the bidirectional one `canvas` decodes."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from studio.engine.lora import attach_adapter, read_adapter
from studio.engine.masks import bidirectional, causal
from studio.engine.strategies import make_strategy
from studio.errors import BadInput
from studio.presets.shipped import shipped, shipped_for
from studio.run.session import Settings, run_to_end
from studio.train.data import Sequence
from studio.train.objectives import IGNORE, MDM
from studio.train.trainable import Trainable
from studio.train.trainer import TrainConfig, train
from tests.support.tiny import tiny_engine, tiny_model

V, EOS = 16, 3


def _seqs():
    """Answers that end with EOS (padded with it to the batch's length) and one cut at the token limit (not)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for plen, alen, ended in ((4, 9, True), (6, 5, True), (3, 12, False), (5, 7, True)):
        body = (torch.randint(4, V, (plen + alen,), generator=g)).tolist()
        out.append(Sequence(body[:plen + alen - ended] + [EOS] * ended, plen))
    return out


def _brute_force(model, seqs, tokens, t, attention):
    """The loss read off its definition, one sequence at a time (no batch padding): every MASKed answer position i
    predicted by row i - 1 (the logit shift), cross-entropy weighted 1/t, summed, over the answer positions."""
    total, n_answer = 0.0, 0
    for b, s in enumerate(seqs):
        n = len(s.tokens) if s.tokens[-1] != EOS else tokens.shape[1]
        clean = s.tokens + [EOS] * (n - len(s.tokens))
        x = tokens[b, :n]
        with torch.no_grad():
            logits = model(x, torch.arange(n), model.new_cache(n), mask=attention(n, 0), lora_gate=torch.ones(n, dtype=torch.bool))[0]
        for i in range(s.prompt_len, n):
            if x[i] == V:
                total += float(F.cross_entropy(logits[i - 1], torch.tensor(clean[i]))) / float(t[b])
        n_answer += n - s.prompt_len
    return total / n_answer


def test_the_objective_masks_answer_tokens_and_weights_their_loss_by_one_over_t():
    model = tiny_model("llama", vocab=V, seed=1)
    trainable = Trainable(model, r=4, alpha=8, seed=0)
    with torch.no_grad():   # a non-trivial adapter and MASK row: the LoRA applies on every row
        for _, w in trainable.named_tensors():
            w.normal_(0, 1.0)
    seqs, objective = _seqs(), MDM(V, [EOS])
    batch = objective.make_batch(seqs, 0, 0.0, torch.Generator().manual_seed(3))
    L = batch.tokens.shape[1]
    t = torch.stack([1 / w[w > 0][0] for w in batch.weights])
    # one stratified draw: the ratios are evenly spaced in (eps, 1]
    gaps = t.sort().values.diff()
    assert torch.allclose(gaps, torch.full_like(gaps, (1 - objective.eps) / len(seqs)), atol=1e-6)
    for b, s in enumerate(seqs):
        P, n = s.prompt_len, (L if s.tokens[-1] == EOS else len(s.tokens))
        clean = torch.tensor(s.tokens + [EOS] * (n - len(s.tokens)))
        x = batch.tokens[b, :n]
        masked = x == V
        assert not masked[:P].any() and masked.any()                                     # the prompt stays clean
        assert torch.equal(x[~masked], clean[~masked])                                   # the rest is the answer
        assert torch.equal(batch.keys[b], torch.arange(L) < n)         # EOS padding to L; a cut answer is not padded
        want = torch.full((L,), IGNORE)
        want[(masked.nonzero()[:, 0] - 1)] = clean[masked]              # row i - 1 predicts the MASKed token i
        assert torch.equal(batch.targets[b], want)
        assert torch.equal(batch.weights[b] > 0, want != IGNORE)
    assert int(batch.n_answer) == sum((L if s.tokens[-1] == EOS else len(s.tokens)) - s.prompt_len for s in seqs)
    loss = objective.loss(model, batch, objective.n_slots())
    assert loss.task == pytest.approx(_brute_force(model, seqs, batch.tokens, t, bidirectional), abs=1e-5)
    assert abs(loss.task - _brute_force(model, seqs, batch.tokens, t, causal)) > 0.05   # a causal read differs
    assert int(loss.counted.sum()) == int((batch.targets != IGNORE).sum())   # accuracy counts the MASKed rows only


def _ar_engine(seed=3):
    """A tiny AR engine without a MASK token (training adds one at id V)."""
    e = tiny_engine("llama", vocab=V, seed=seed, eos_ids=(EOS,))
    e.model.config = e.config = dataclasses.replace(e.config, mask_token_id=None)
    return e


def test_train_mdm_writes_an_adapter_that_makes_the_model_bidirectional_for_canvas(tmp_path):
    seqs = _seqs() * 4
    objective = MDM(V, [EOS])
    cfg = TrainConfig(kind="mdm", gate="all", steps=30, batch_size=4, lr=1e-2, r=4, alpha=8, save_every=1000)
    log = []
    train(tiny_model("llama", vocab=V, seed=3), seqs, objective, cfg, tmp_path / "mdm", on_step=log.append)
    assert sum(r.task for r in log[-5:]) < 0.8 * sum(r.task for r in log[:5])
    adapter = read_adapter(tmp_path / "mdm")
    assert adapter.attention == "bidirectional" and adapter.adapted_rows == "all" and adapter.mask_token_id == V
    base = _ar_engine()
    view = base.with_adapter(str(tmp_path / "mdm"))
    assert view.config.attention == "bidirectional" and view.config.logit_shift and view.config.mask_token_id == V
    assert base.config.attention == "causal"                          # the base view is the AR model still
    attached = _ar_engine()
    attach_adapter(attached, tmp_path / "mdm")                        # and so it is after an attach (train eval)
    assert attached.config.attention == "bidirectional" and attached.with_adapter(None).config.attention == "causal"
    canvas = make_strategy("canvas", {"block_size": 4, "threshold": 0.5})
    out = run_to_end(view, canvas, Settings(max_new_tokens=8), "", seqs[0].tokens[:4])
    assert out.token_ids and canvas.mode == "bidirectional" and canvas.shift
    assert any(e["t"] == "unmask" for e in out.events)
    assert run_to_end(view, make_strategy("ar"), Settings(max_new_tokens=4), "", [4, 5, 6]).token_ids  # its AR mode
    for name in ("isd", "jacobi"):                                    # the causal strategies refuse it, in one line
        with pytest.raises(BadInput, match=f"strategy '{name}' needs a causal model .* bidirectional attention"):
            run_to_end(view, make_strategy(name), Settings(max_new_tokens=8), "", [4, 5, 6])


def test_an_adapter_declares_only_an_attention_it_can_mean(tmp_path):
    import json
    Trainable(tiny_model("llama", vocab=V), r=2, alpha=4).save(tmp_path, adapted_rows="all", attention="sideways")
    with pytest.raises(BadInput, match="attention must be one of 'causal', 'bidirectional', got 'sideways'"):
        read_adapter(tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    del cfg["attention"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    assert read_adapter(tmp_path).attention is None                   # absent: the base model's own attention


def test_the_shipped_mdm_adapter_is_canvas_s_on_the_default_model():
    entry = shipped()["smollm2-mdm"]
    assert entry["model"] == "default" and entry["strategies"] == ["canvas"]
    assert shipped_for("default", "canvas") == entry["path"]
    adapter = read_adapter(entry["path"])
    assert adapter.attention == "bidirectional" and adapter.adapted_rows == "all" and adapter.mask_token_id == 49152

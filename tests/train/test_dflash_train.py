"""train dflash: the tapped features are the target's own; trained on a tiny model's greedy answers, the drafter
raises dflash's tokens per forward over an untrained one while dflash stays `ar` token for token (a chain and a
tree); a resumed run trains what an uninterrupted one does."""
from collections import Counter

import pytest
import torch

from studio.engine.dflash import load_drafter
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.engine.taps import LayerTaps
from studio.errors import BadInput
from studio.run.session import Settings, run_to_end
from studio.train import dflash as train_dflash
from studio.train.data import Sequence
from tests.support.dflash import tiny_drafter
from tests.support.tiny import tiny_engine

GREEDY = Settings(max_new_tokens=32, sampling=SamplingParams(0.0))


def _data(engine, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 15, (6,), generator=g).tolist() for _ in range(n)]
    return [Sequence(p + run_to_end(engine, make_strategy("ar"), GREEDY, "", p).token_ids, len(p)) for p in prompts]


def _config(**over):
    return train_dflash.DFlashConfig(**{"layers": 1, "taps": [0, 1], "block_size": 5, "mask_token_id": 15,
                                        "anchors": 8, "steps": 60, "batch_size": 8, "lr": 3e-3, "save_every": 1000,
                                        **over})


def _tpf(engine, drafter, prompts, **params):
    tokens = forwards = 0
    for p in prompts:
        s = make_strategy("dflash", {"drafting": "fixed", **params})
        s.use_drafter(str(drafter))
        r = run_to_end(engine, s, GREEDY, "", p)
        assert r.token_ids == run_to_end(engine, make_strategy("ar"), GREEDY, "", p).token_ids
        tokens, forwards = tokens + len(r.token_ids), forwards + r.footer["forwards"]
    return tokens / forwards


def test_trained_drafter_raises_tokens_per_forward_and_dflash_stays_ar(tmp_path):
    engine = tiny_engine("qwen3", vocab=16, seed=3)
    seqs = _data(engine)
    cfg = _config()
    train_dflash.extract(engine.model, seqs, cfg.taps, tmp_path, cfg.max_len)
    feats = train_dflash.load_features(tmp_path)
    with LayerTaps(engine.model, cfg.taps) as taps, torch.no_grad():   # the stored features are the target's taps
        ids = torch.tensor(seqs[3].tokens)
        engine.model(ids, torch.arange(len(ids)), engine.model.new_cache(len(ids)))
        torch.testing.assert_close(feats[3].hidden.float(), taps.take()[0], atol=0.05, rtol=0.01)
    state = train_dflash.train(engine.model, feats, cfg, tmp_path)
    assert state["stopped"] == "done" and load_drafter(tmp_path).config.taps == (0, 1)
    tiny_drafter(engine, tmp_path / "untrained", block=5)
    prompts = [[1, 2, 3, 4, 1, 2], [5, 3, 9, 1, 0, 7], [2, 2, 8, 6, 4, 11]]
    before, after = _tpf(engine, tmp_path / "untrained", prompts), _tpf(engine, tmp_path, prompts)
    assert after > before + 0.5, (before, after)
    assert _tpf(engine, tmp_path, prompts, branches=3) >= after - 0.1


def test_a_resumed_run_trains_what_an_uninterrupted_one_does(tmp_path):
    engine = tiny_engine("qwen3", vocab=16, seed=3)
    seqs = _data(engine, n=8)
    train_dflash.extract(engine.model, seqs, [0, 1], tmp_path / "f", 320)
    feats = train_dflash.load_features(tmp_path / "f")
    train_dflash.train(engine.model, feats, _config(steps=6, save_every=3), tmp_path / "whole")
    def stop_after_3(r):
        if r.step == 3:
            raise KeyboardInterrupt   # Ctrl+C: a checkpoint at the step it finished
    with pytest.raises(KeyboardInterrupt):
        train_dflash.train(engine.model, feats, _config(steps=6, save_every=3), tmp_path / "cut", on_step=stop_after_3)
    train_dflash.train(engine.model, feats, _config(steps=6, save_every=3), tmp_path / "cut", resume=True)
    whole, cut = load_drafter(tmp_path / "whole").state_dict(), load_drafter(tmp_path / "cut").state_dict()
    for name in whole:
        torch.testing.assert_close(cut[name], whole[name], atol=1e-6, rtol=1e-5)
    steps = [line for line in (tmp_path / "cut" / "train_log.jsonl").read_text().splitlines()]
    assert len(steps) == 6


def test_the_draft_vocabulary_is_the_answers_most_frequent_tokens_and_drafts_stay_inside_it(tmp_path):
    engine = tiny_engine("qwen3", vocab=16, seed=3)
    seqs = _data(engine, n=8)
    train_dflash.extract(engine.model, seqs, [0, 1], tmp_path, 320)
    feats = train_dflash.load_features(tmp_path)
    counts = Counter(t for s in seqs for t in s.tokens[s.prompt_len:])
    state = train_dflash.train(engine.model, feats, _config(steps=4, draft_vocab=5), tmp_path)
    vocab = load_drafter(tmp_path).vocab.tolist()
    assert len(vocab) == 5 and min(counts[t] for t in vocab) >= max(counts[t] for t in range(16) if t not in vocab)
    assert state["draft_vocab"] == {"tokens": 5, "coverage": sum(counts[t] for t in vocab) / sum(counts.values())}
    for p in ([1, 2, 3, 4, 1, 2], [5, 3, 9, 1, 0, 7]):
        s = make_strategy("dflash", {"drafting": "fixed", "lookup": 0})
        s.use_drafter(str(tmp_path))
        r = run_to_end(engine, s, GREEDY, "", p)
        assert r.token_ids == run_to_end(engine, make_strategy("ar"), GREEDY, "", p).token_ids
        drafted = {t for e in r.events if e["t"] == "propose" for t in e["tok"]}
        assert drafted and drafted <= set(vocab)
    assert train_dflash.draft_vocabulary(feats, 16, 0) is None and train_dflash.draft_vocabulary(feats, 16, 16) is None


def test_appended_data_extends_the_features_and_other_data_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(train_dflash, "SHARD", 4)
    engine = tiny_engine("qwen3", vocab=16, seed=3)
    seqs = _data(engine, n=10)
    assert train_dflash.extract(engine.model, seqs[:6], [0, 1], tmp_path / "f", 320) == 6   # shards of 4 and 2
    kept = (tmp_path / "f" / "features" / "feat-00000.safetensors").stat().st_mtime_ns
    assert train_dflash.extract(engine.model, seqs, [0, 1], tmp_path / "f", 320) == 10      # 4, 4 again, 2
    assert (tmp_path / "f" / "features" / "feat-00000.safetensors").stat().st_mtime_ns == kept
    train_dflash.extract(engine.model, seqs, [0, 1], tmp_path / "whole", 320)
    grown, whole = train_dflash.load_features(tmp_path / "f"), train_dflash.load_features(tmp_path / "whole")
    assert [f.tokens for f in grown] == [s.tokens for s in seqs]
    for a, b in zip(grown, whole):
        torch.testing.assert_close(a.hidden, b.hidden, atol=0, rtol=0)
    with pytest.raises(BadInput, match="other sequences"):
        train_dflash.extract(engine.model, seqs[::-1], [0, 1], tmp_path / "f", 320)

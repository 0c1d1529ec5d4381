"""A drafter's price: measured once per machine, target and drafter, then read back (a seeded run plans the same from
one run to the next), and measured again for another drafter or target."""
import json

import pytest

from studio.engine import drafter_cost
from studio.engine.cost_table import costs_dir
from tests.support.tiny import tiny_engine


@pytest.mark.slow   # the real measurement (the suite pins it for the tiny models otherwise)
def test_a_drafter_is_measured_once_and_read_back_by_its_key(monkeypatch):
    engine = tiny_engine("llama", vocab=16, seed=3)
    made = []

    def make_draft():
        made.append(1)
        return lambda: engine.model.lm_head.weight.sum()

    share = drafter_cost.drafter_share(engine, {"path": "a", "size": 1}, make_draft)
    assert share > 0 and made == [1]
    assert drafter_cost.drafter_share(engine, {"path": "a", "size": 1}, make_draft) == share and made == [1]
    drafter_cost._measured.clear()   # another process: read from the cache file
    stored = [json.loads(f.read_text()) for f in costs_dir().glob("drafter-*.json")]
    assert any(s["share"] == share and s["key"]["drafter"] == {"path": "a", "size": 1} for s in stored)
    assert drafter_cost.drafter_share(engine, {"path": "a", "size": 1}, make_draft) == share and made == [1]
    drafter_cost.drafter_share(engine, {"path": "a", "size": 2}, make_draft)   # the weights rewritten
    assert made == [1, 1]
    other = tiny_engine("qwen3", vocab=16, seed=3)
    drafter_cost.drafter_share(other, {"path": "a", "size": 2}, make_draft)   # another target
    assert made == [1, 1, 1]

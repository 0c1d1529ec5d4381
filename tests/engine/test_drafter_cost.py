"""A drafter's price: measured once per machine, target and drafter, at a few draft counts, then read back (a seeded
run plans the same from one run to the next), measured again for another drafter or target, and priced between the
counts it was measured at by straight lines."""
import json

import pytest

from studio.engine import drafter_cost
from studio.engine.cost_table import costs_dir
from tests.support.tiny import tiny_engine


def test_the_price_runs_straight_between_the_measured_draft_counts():
    assert drafter_cost.sizes(15) == [1, 2, 4, 8, 15] and drafter_cost.sizes(4) == [1, 2, 4]
    assert drafter_cost.sizes(1) == [1] and drafter_cost.sizes(3) == [1, 2, 3]
    price = drafter_cost.DrafterPrice((1, 2, 4, 8, 15), (0.1, 0.12, 0.14, 0.16, 0.3))
    assert price(1) == 0.1 and price(4) == 0.14 and price(15) == 0.3
    assert price(3) == pytest.approx(0.13) and price(10) == pytest.approx(0.2)
    assert price(0) == 0.1 and price(20) == 0.3                # flat past the ends


@pytest.mark.slow   # the real measurement (the suite pins it for the tiny models otherwise)
def test_a_drafter_is_measured_once_and_read_back_by_its_key():
    engine = tiny_engine("llama", vocab=16, seed=3)
    made = []

    def make_draft(k):
        made.append(k)
        return lambda: engine.model.lm_head.weight[:k].sum()

    price = drafter_cost.drafter_share(engine, {"path": "a", "size": 1}, 4, make_draft)
    assert price.drafts == (1, 2, 4) and made == [1, 2, 4] and all(s > 0 for s in price.shares)
    assert drafter_cost.drafter_share(engine, {"path": "a", "size": 1}, 4, make_draft) == price and len(made) == 3
    drafter_cost._measured.clear()   # another process: read from the cache file
    stored = [json.loads(f.read_text()) for f in costs_dir().glob("drafter-*.json")]
    assert any(s["shares"] == list(price.shares) and s["key"]["drafter"] == {"path": "a", "size": 1} for s in stored)
    assert drafter_cost.drafter_share(engine, {"path": "a", "size": 1}, 4, make_draft) == price and len(made) == 3
    drafter_cost.drafter_share(engine, {"path": "a", "size": 2}, 4, make_draft)   # the weights rewritten
    assert len(made) == 6
    drafter_cost.drafter_share(engine, {"path": "a", "size": 2}, 8, make_draft)   # a longer block
    assert made[6:] == [1, 2, 4, 8]
    other = tiny_engine("qwen3", vocab=16, seed=3)
    drafter_cost.drafter_share(other, {"path": "a", "size": 2}, 4, make_draft)   # another target
    assert len(made) == 13

"""Tensor parallelism on the CPU (gloo): 2 and 4 ranks decode exactly what one process does -- every strategy's
greedy output and events, sampled output with the same seed, adapters included; a rank that dies ends rank 0 with
one line, not a hang."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from studio.engine.lora import attach_adapter
from studio.errors import BadInput
from studio.parallel.tensor import TensorParallel, check_splittable, shard_model
from tests.support.lora import random_adapter
from tests.support.parallel import build, decode, served
from tests.support.tiny import tiny_model


def ranks(args: dict, cache, timeout: float = 240) -> dict:
    """Rank 0 of a group started by tests.support.parallel, in a process of its own (its cost tables in `cache`);
    its JSON answer."""
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    done = subprocess.run([sys.executable, "-m", "tests.support.parallel", json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_decodes_on_n_ranks_what_one_process_does(tmp_path, world):
    engine = build()
    adapter = str(random_adapter(tmp_path / "ad", engine.model, seed=5))
    alone = decode(engine, adapter)
    split = ranks({"world": world, "adapter": adapter}, tmp_path)
    assert list(split) == list(alone)
    for label in alone:
        assert split[label]["tokens"] == alone[label]["tokens"], label
        # greedy: the events too, up to the order the shards add products in (a planned run plans with the costs
        # measured on its own machine, so only its tokens); sampled: the tokens (a draft of near-tied tokens may differ)
        if "t=0.0" in label and "'auto'" not in label:
            assert same(split[label]["events"], alone[label]["events"]), label
    # the runs are not trivial: drafts were accepted and rejected
    kinds = {e["t"] for run in alone.values() for e in run["events"]}
    assert {"accept", "reject", "propose"} <= kinds


def same(a, b) -> bool:
    """Equal, the probabilities in events to 1e-4: the shards add the same products in another order."""
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-4, abs=1e-6)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_server_on_two_ranks_answers_concurrent_requests_as_one_process_does(tmp_path):
    """`serve --tp`: the decode thread steps several runs in turn, each step's message and collectives together."""
    assert ranks({"world": 2, "serve": True}, tmp_path) == served(build())


def test_shards_hold_their_part_and_sum_to_the_whole_projection():
    """Without collectives (world 1 group faked): each rank's q/k/v rows and o_proj columns are the heads it keeps;
    the partial o_proj products of all ranks add up to the whole model's."""
    model = tiny_model("qwen2", vocab=24, seed=1)
    cfg = model.config
    x = torch.randn(3, cfg.n_heads * cfg.head_dim)
    whole = model.model.layers[0].self_attn.o_proj
    parts = []
    for rank in range(2):
        plan = TensorParallel(rank, 2, None, cfg)
        shard = shard_model(model, plan)
        attn = shard.model.layers[0].self_attn
        assert attn.q_proj.weight.shape[0] == cfg.n_heads // 2 * cfg.head_dim
        assert attn.q_proj.bias is not None and attn.q_proj.bias.shape[0] == attn.q_proj.weight.shape[0]
        assert shard.new_cache(8).k.shape[2] == cfg.n_kv_heads // 2
        cols = plan.columns_of("o_proj")
        with torch.no_grad():
            parts.append(x[:, cols] @ attn.o_proj.weight.T)
    with torch.no_grad():
        assert torch.allclose(parts[0] + parts[1], x @ whole.weight.T, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(n_heads=6, n_kv_heads=2), "6 attention heads do not split into 4"),
    (dict(vocab_size=30), "30 vocabulary do not split into 4"),
    (dict(n_experts=4, n_experts_per_tok=2), "MoE models are not split"),
])
def test_a_model_that_does_not_split_is_refused_in_one_line(change, message):
    import dataclasses
    cfg = dataclasses.replace(tiny_model("llama", vocab=24).config, **change)
    with pytest.raises(BadInput, match=message):
        check_splittable(cfg, 4)


def test_a_killed_rank_ends_rank_0_with_one_line_within_the_timeout(tmp_path):
    t = time.monotonic()
    out = ranks({"world": 2, "kill_after": 5, "timeout_s": 20}, tmp_path, timeout=120)
    assert out["lost"] and out["step"] == 5
    assert "\n" not in out["lost"] and "stopped answering" in out["lost"]
    assert time.monotonic() - t < 60

"""Tensor and expert parallelism on the CPU (gloo): 2 and 4 ranks decode exactly what one process does -- every
strategy's greedy output and events, sampled output with the same seed, adapters included, on a tiny model of each
family (mixtures of experts split by columns and placed whole); a rank that dies ends rank 0 with one line, not a
hang. `make test` runs a few families on 2 ranks; `make test-parallel` (DLM_PARALLEL=long) every family on 2 and 4."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from studio.errors import BadInput
from studio.engine.tensor_parallel import TensorParallel, check_splittable, shard_model
from tests.support.lora import random_adapter
from tests.support.parallel import FAMILIES, build, decode, served
from tests.support.tiny import tiny_model


def ranks(args: dict, cache, timeout: float = 240) -> dict:
    """Rank 0 of a group started by tests.support.parallel, in a process of its own (its cost tables in `cache`);
    its JSON answer."""
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    done = subprocess.run([sys.executable, "-m", "tests.support.parallel", json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("world", [2, 4] if os.environ.get("DLM_PARALLEL") == "long" else [2])
def test_every_strategy_decodes_on_n_ranks_what_one_process_does(tmp_path, world):
    engine = build()
    adapter = str(random_adapter(tmp_path / "ad", engine.model, seed=5))
    alone = decode(engine, adapter)
    split = ranks({"world": world, "adapter": adapter}, tmp_path)
    assert list(split) == list(alone)
    exact = decode(exactly(build()), adapter)
    for label in alone:
        assert split[label]["tokens"] == alone[label]["tokens"], label
        # greedy: the events too, their floats as close to float64's as one process's (a planned run plans with the
        # costs measured on its own machine, so only its tokens); sampled: the tokens (near-tied drafts may differ)
        if "t=0.0" in label and "'auto'" not in label:
            assert as_precise(split[label]["events"], alone[label]["events"], exact[label]["events"]), label
    # the runs are not trivial: drafts were accepted and rejected
    kinds = {e["t"] for run in alone.values() for e in run["events"]}
    assert {"accept", "reject", "propose"} <= kinds


MOE = ("llada-moe", "llada2", "diffusiongemma")
LONG = os.environ.get("DLM_PARALLEL") == "long"
QUICK = [("diffusiongemma", 2, True)]   # LLaDA2 with its experts placed: read from its files, below
EVERY = [(family, world, ep) for family in FAMILIES if family != "llama" for world in (2, 4)
         for ep in ((False, True) if family in MOE else (False,))]


def exactly(engine):
    """The engine in float64: the same computation, its rounding a billionth of fp32's (the reference the floats of
    an fp32 run are measured against)."""
    engine.model.double()
    return engine


@pytest.mark.parametrize("family, world, ep", EVERY if LONG else QUICK)
def test_each_family_decodes_on_n_ranks_what_one_process_does(tmp_path, family, world, ep):
    """`ep`: an MoE model's experts placed whole across the ranks (--ep), else split by columns like an MLP."""
    runs = FAMILIES[family][1]
    alone = decode(build(family), None, runs)
    split = ranks({"world": world, "family": family, "ep": ep}, tmp_path)
    assert list(split) == list(alone)
    exact = decode(exactly(build(family)), None, runs)
    for label in alone:
        assert split[label]["tokens"] == alone[label]["tokens"], label
        if "t=0.0" in label:
            assert as_precise(split[label]["events"], alone[label]["events"], exact[label]["events"]), label


@pytest.mark.parametrize("ep", [False, True] if LONG else [True])
def test_a_checkpoint_read_on_two_ranks_decodes_what_one_process_does(tmp_path, ep):
    """LLaDA2 as published (fused QKV, per-expert tensors), each rank reading its part of the files alone."""
    from tests.support.hf_files import llada2_checkpoint
    from tests.support.parallel import load
    llada2_checkpoint(tmp_path / "l2")
    runs = FAMILIES["llada2"][1]
    alone = decode(load(str(tmp_path / "l2")), None, runs)
    split = ranks({"world": 2, "family": "llada2", "model": str(tmp_path / "l2"), "ep": ep}, tmp_path)
    assert list(split) == list(alone)
    exact = decode(exactly(load(str(tmp_path / "l2"))), None, runs)
    for label in alone:
        assert split[label]["tokens"] == alone[label]["tokens"], label
        if "t=0.0" in label:
            assert as_precise(split[label]["events"], alone[label]["events"], exact[label]["events"]), label


@pytest.mark.parametrize("place_experts", [False, True])
def test_a_rank_reads_from_the_files_only_what_it_keeps(tmp_path, monkeypatch, place_experts):
    """Every element a rank reads from the safetensors files is one its shard keeps (the fused QKV's rows of its
    heads, its experts or their columns, its vocabulary), and its tensors are those parts of the whole model's."""
    import math

    from studio.engine import lazy_tensors
    from studio.engine.weights import load_model_files
    from tests.support.hf_files import llada2_checkpoint
    llada2_checkpoint(tmp_path / "l2")
    whole = load_model_files(tmp_path / "l2").state_dict
    read = []
    real_read = lazy_tensors.Lazy.read
    monkeypatch.setattr(lazy_tensors.Lazy, "read", lambda self: read.append(math.prod(self.shape)) or real_read(self))
    for rank in range(2):
        read.clear()
        plans = []

        def planner(cfg):
            plans.append(TensorParallel(rank, 2, None, cfg, place_experts))
            return plans[-1]
        part = load_model_files(tmp_path / "l2", shard=planner).state_dict
        assert part.keys() == whole.keys()
        for name, t in part.items():
            assert torch.equal(t, plans[0].shard(name, whole[name])), name
        assert sum(read) == sum(t.numel() for t in part.values()) < sum(t.numel() for t in whole.values())


@pytest.mark.skipif(not LONG, reason="make test-parallel")
def test_lm_eval_on_two_ranks_scores_and_answers_as_one_process(tmp_path):
    """`dlm-studio lm-eval --model_args tp=2`: log-likelihoods (one forward each, every rank running it), rolling
    ones and generations from a two-file checkpoint with a tied head, each rank reading its part."""
    pytest.importorskip("lm_eval")
    from studio.evaluation.lm_eval_model import StudioLM
    from tests.support.hf_files import write_hf_dir
    from tests.support.parallel import lm_eval_answers
    write_hf_dir(tmp_path / "m", tie=True, sharded=True)
    alone = lm_eval_answers(StudioLM(model=str(tmp_path / "m"), strategy="jacobi", device="cpu", dtype="fp32"))
    split = ranks({"world": 2, "lm_eval": True, "model": str(tmp_path / "m")}, tmp_path)
    assert split["generate"] == alone["generate"]
    assert [greedy for _, greedy in split["loglikelihood"]] == [greedy for _, greedy in alone["loglikelihood"]]
    assert same([lp for lp, _ in split["loglikelihood"]] + split["rolling"],
                [lp for lp, _ in alone["loglikelihood"]] + alone["rolling"])


def as_precise(split: list, alone: list, exact: list) -> bool:
    """Whether the events of a run on several ranks are those of one process in all but their floats, and their floats
    as close to the float64 run's (`exact`, the same events) as one process's are: within 4x one process's worst
    relative error, and at least 1e-5. The shards add the same products in another order, so they may differ from
    one process by what fp32 rounding loses, on any CPU's kernels, and by no more. (A fixed bound between the two fp32
    runs held on one machine only: DiffusionGemma's canvas confidences differ by 1.8e-4 relative with AVX2 kernels,
    where each run is itself 0.6-1.8e-4 from float64.)"""
    errors = {"split": [], "alone": []}

    def walk(s, a, e) -> bool:
        if isinstance(e, float):
            if not (isinstance(s, float) and isinstance(a, float)):
                return False
            scale = max(abs(e), 1e-12)
            errors["split"].append(abs(s - e) / scale)
            errors["alone"].append(abs(a - e) / scale)
            return True
        if isinstance(e, dict):
            return (isinstance(s, dict) and isinstance(a, dict) and s.keys() == a.keys() == e.keys()
                    and all(walk(s[k], a[k], e[k]) for k in e))
        if isinstance(e, list):
            return (isinstance(s, list) and isinstance(a, list) and len(s) == len(a) == len(e)
                    and all(walk(x, y, z) for x, y, z in zip(s, a, e)))
        return s == a == e

    if not walk(split, alone, exact):
        return False
    return max(errors["split"], default=0.0) <= max(4 * max(errors["alone"], default=0.0), 1e-5)


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


def test_a_chat_on_two_ranks_reuses_its_kv_as_one_process_does(tmp_path):
    """`chat --tp`: a turn continues the last one's KV cache (rolled back to the shared prefix on every rank when the
    history was edited), a turn of another strategy starts afresh."""
    from tests.support.parallel import chat
    alone = chat(build())
    prefilled = [sum(e["n_tokens"] for e in turn["events"] if e.get("role") == "prefill") for turn in alone]
    assert max(prefilled[1:3]) < 10 < prefilled[3]   # turns 2 and 3 prefilled their new text, turn 4 everything
    split = ranks({"world": 2, "chat": True}, tmp_path)
    exact = chat(exactly(build()))
    for turn_split, turn_alone, turn_exact in zip(split, alone, exact, strict=True):
        assert turn_split["tokens"] == turn_alone["tokens"]
        assert as_precise(turn_split["events"], turn_alone["events"], turn_exact["events"])


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
        cols = plan.columns_of("model.layers.0.self_attn.o_proj".split("."))
        with torch.no_grad():
            parts.append(x[:, cols] @ attn.o_proj.weight.T)
    with torch.no_grad():
        assert torch.allclose(parts[0] + parts[1], x @ whole.weight.T, atol=1e-5)


@pytest.mark.parametrize("place_experts", [False, True])
def test_expert_shards_hold_their_part_and_sum_to_the_whole_layer(place_experts):
    """Without collectives: placed whole, each rank holds half the experts and runs only the tokens routed to them;
    split by columns, every expert's half; either way the ranks' partial outputs (shared expert included) add up to
    the whole layer's, and each rank reports the experts the router chose, not its own share."""
    from studio.engine.moe import MoE
    from tests.support.parallel import SIGMOID_MOE
    model = tiny_model("llama", vocab=24, seed=2, **SIGMOID_MOE)
    cfg = model.config
    layer = model.model.layers[1].mlp
    assert isinstance(layer, MoE)
    x = torch.randn(1, 5, cfg.dim)
    parts = []
    with torch.no_grad():
        whole = layer(x)
        for rank in range(2):
            shard = shard_model(model, TensorParallel(rank, 2, None, cfg, place_experts)).model.layers[1].mlp
            experts = shard.experts.gate_proj.shape
            assert experts == ((4, 16, cfg.dim) if place_experts else (8, 8, cfg.dim))
            shard.reduce = None   # the partial sum, as the all-reduce receives it
            parts.append(shard(x))
            assert int(shard.experts_run) == int(layer.experts_run)
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)


@pytest.mark.parametrize("change, place_experts, message", [
    (dict(n_heads=6, n_kv_heads=2), False, "6 attention heads do not split into 4"),
    (dict(vocab_size=30), False, "30 vocabulary do not split into 4"),
    (dict(n_experts=6, n_experts_per_tok=2, moe_ffn_dim=8), True, "6 experts do not split into 4"),
    (dict(n_experts=6, n_experts_per_tok=2, moe_ffn_dim=6), False, "6 expert columns do not split into 4"),
    ({}, True, "--ep: the model has no experts"),
])
def test_a_model_that_does_not_split_is_refused_in_one_line(change, place_experts, message):
    import dataclasses
    cfg = dataclasses.replace(tiny_model("llama", vocab=24).config, **change)
    with pytest.raises(BadInput, match=message):
        check_splittable(cfg, 4, place_experts)


def test_a_killed_rank_ends_rank_0_with_one_line_within_the_timeout(tmp_path):
    t = time.monotonic()
    out = ranks({"world": 2, "kill_after": 5, "timeout_s": 20}, tmp_path, timeout=120)
    assert out["lost"] and out["step"] == 5
    assert "\n" not in out["lost"] and "stopped answering" in out["lost"]
    assert time.monotonic() - t < 60


def test_ep_alone_splits_the_attention_across_the_same_ranks_and_another_tp_is_refused():
    from studio.run.config import ModelChoice
    assert (ModelChoice(ep=2).world, ModelChoice(tp=2, ep=2).world, ModelChoice(tp=4).world) == (2, 2, 4)
    with pytest.raises(BadInput, match="--ep 4 with --tp 2"):
        ModelChoice(tp=2, ep=4).world


@pytest.mark.skipif(not LONG, reason="make test-parallel")
def test_torchrun_starts_the_ranks_and_rank_0_answers_as_one_process(tmp_path):
    """`torchrun --nproc-per-node 2 -m studio run ...` (how several machines run it, here on one): rank 0 prints the
    answer, the other rank only follows."""
    from tests.support.hf_files import write_hf_dir
    write_hf_dir(tmp_path / "m", tie=True, sharded=True)
    args = ["run", "--model", str(tmp_path / "m"), "-s", "jacobi", "--max-new-tokens", "12", "--raw", "hello world"]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    alone = subprocess.run([sys.executable, "-m", "studio", *args], capture_output=True, text=True, env=env, timeout=120)
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "studio", *args], capture_output=True, text=True, env=env, timeout=240)
    assert alone.returncode == launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout == alone.stdout and alone.stdout.strip()

"""Runs of every strategy on a tiny engine, alone or as rank 0 of a tensor-parallel group (tests/parallel).

`python -m tests.support.parallel '{"world": 2, ...}'` starts the group (ranks spawned here, gloo), decodes `RUNS`
and prints them as JSON; the test decodes the same on one process and compares.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys

PROMPT = [1, 2, 3, 4]
# (strategy, parameters, temperature, on the adapter's model): every strategy of a causal model, greedy and sampled
FIXED = {"drafting": "fixed"}   # the cost tables of one process and of a shard differ: plans would too
RUNS = [("ar", {}, 0.0, False), ("isd", {"stride": 4, **FIXED}, 0.0, False), ("jacobi", FIXED, 0.0, False),
        ("jacobi-mr", FIXED, 0.0, False), ("s2d2", FIXED, 0.0, False), ("simsd", FIXED, 0.0, False),
        ("r-isd", {"stride": 3, **FIXED}, 0.0, True), ("isd", {"stride": 3, **FIXED}, 0.0, True),
        ("ar", {}, 1.0, False), ("isd", {"stride": 4, **FIXED}, 1.0, False),
        ("r-isd", {"stride": 3, **FIXED}, 1.0, True), ("jacobi-mr", FIXED, 1.0, False)]
CANVAS = {"block_size": 8, "steps": 12}
CANVAS_RUNS = [("canvas", CANVAS, 0.0, False), ("canvas", CANVAS, 1.0, False)]
# a mixture of experts as LLaDA-MoE has it (softmax router) and as LLaDA2 does (sigmoid router over groups, a bias,
# a shared expert, a dense first layer)
SOFTMAX_MOE = dict(n_experts=8, n_experts_per_tok=2, moe_ffn_dim=16)
SIGMOID_MOE = dict(n_experts=8, n_experts_per_tok=2, moe_ffn_dim=16, moe_router="sigmoid", moe_groups=4,
                   moe_topk_groups=2, moe_expert_bias=True, moe_renormalize=True, moe_scale=2.5,
                   moe_shared_ffn_dim=16, first_dense_layers=1)
# family -> (its tiny engine's maker and arguments, the runs it decodes)
FAMILIES = {
    "llama": (("tiny_engine", {"family": "llama"}), RUNS),
    "qwen2": (("tiny_engine", {"family": "qwen2"}), RUNS[:3] + RUNS[8:10]),
    "qwen3": (("tiny_engine", {"family": "qwen3"}), RUNS[:3] + RUNS[8:10]),
    "sdar": (("tiny_dlm", {"family": "qwen3", "block": 4}),
             [("blockdiff", {}, 0.0, False), ("s2d2", FIXED, 0.0, False), ("blockdiff", {}, 1.0, False)]),
    "llada": (("tiny_mdm", {}), CANVAS_RUNS),
    "dream": (("tiny_mdm", {"shift": True}), CANVAS_RUNS),
    "llada-moe": (("tiny_mdm", SOFTMAX_MOE), CANVAS_RUNS),
    "llada2": (("tiny_mdm", {"attention": "block", "block": 4, **SIGMOID_MOE}),
               [("canvas", {**CANVAS, "block_size": 4, "steps": 12}, 0.0, False), ("s2d2", FIXED, 0.0, False),
                ("s2d2", FIXED, 1.0, False)]),
    # its canvas strategy samples on its own schedule, seeded: "t=0.0" names the runs, which draw all the same
    "diffusiongemma": (("tiny_gemma", {}), [("gemma-canvas", {"max_denoising_steps": 4}, 0.0, False),
                                            ("gemma-canvas", {"max_denoising_steps": 6, "entropy_bound": 3.0}, 0.0,
                                             False)]),
}
TIMING = ("ms", "wall_ms")


def build(family: str = "llama", vocab: int = 24, seed: int = 3, shard=None):
    """The family's tiny engine, whole (`shard`, the launcher's planner, is for a model read from files)."""
    from tests.support import tiny
    (maker, kw), _ = FAMILIES[family]
    return getattr(tiny, maker)(vocab=vocab, seed=seed, max_seq_len=1024, **kw)


def load(path: str, shard=None):
    """A checkpoint directory's engine on the CPU (with `shard`, a rank's part of it, read alone)."""
    from studio.engine.engine import Engine
    return Engine.load(path, adapter="none", device="cpu", dtype="fp32", graphs=False, shard=shard)


def decode(engine, adapter: str | None, runs=RUNS, n: int = 24) -> dict:
    """label -> {"tokens", "events" (without their timings)} of each run, through `Run` as every command drives it."""
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    from studio.run.session import Settings, run_to_end
    out = {}
    for name, params, temperature, adapted in runs:
        view = engine.with_adapter(adapter) if adapted else engine
        settings = Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=7)
        result = run_to_end(view, make_strategy(name, params), settings, "", PROMPT)
        label = f"{name} {params} t={temperature}{' adapted' if adapted else ''}"
        out[label] = {"tokens": result.token_ids,
                      "events": [{k: v for k, v in e.items() if k not in TIMING} for e in result.events]}
    return out


# requests the server decodes at once (each its own run under --tp: batches are not split across ranks)
REQUESTS = [("default:ar", "abc"), ("default:isd", "pon"), ("default:jacobi", "hello"), ("default:r-isd", "abc")]


def served(engine, n: int = 12) -> list[str]:
    """The texts of REQUESTS sent at once to `dlm-studio serve`'s app on `engine` (greedy completions)."""
    import concurrent.futures
    import urllib.request
    from studio.run.config import RunConfig
    from studio.serve.app import build_app, serving_in_thread

    def post(base: str, model: str, prompt: str) -> str:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]
    with serving_in_thread(build_app(engine, RunConfig("ar"), chat_template=False)) as base:
        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            return list(pool.map(lambda r: post(base, *r), REQUESTS))


# (user text, strategy, whether the last exchange is forgotten first): the second turn continues the first's KV, the
# third the part of it the edited history still shares (rolled back), the fourth, of another strategy, starts afresh
CHAT_TURNS = [("abc", "isd", False), ("pon", "isd", False), ("hello", "isd", True), ("fog", "ar", False)]


def chat(engine, n: int = 12) -> list[dict]:
    """A conversation's turns (tokens, events without timings), as `dlm-studio chat` drives them."""
    from studio.engine.strategies import make_strategy
    from studio.run.conversation import Conversation
    from studio.run.session import Settings
    conversation, out = Conversation(engine, chat=False), []
    for text, name, forget in CHAT_TURNS:
        if forget:
            conversation.messages = conversation.messages[:-2]
        params = {"stride": 3, **FIXED} if name == "isd" else {}
        run = conversation.start_turn(text, make_strategy(name, params), Settings(max_new_tokens=n))
        while not run.done:
            run.advance()
        out.append({"tokens": run.result.token_ids,
                    "events": [{k: v for k, v in e.items() if k not in TIMING} for e in run.result.events]})
    return out


class _Request:
    def __init__(self, *args):
        self.args = args


def lm_eval_answers(lm) -> dict:
    """What `lm` (a StudioLM) answers to a few requests of each kind lm-eval sends."""
    pairs = [("hello world", " the cat"), ("the cat", " sat"), ("a", " cat sat hello")]
    return {"loglikelihood": lm.loglikelihood([_Request(*p) for p in pairs]),
            "rolling": lm.loglikelihood_rolling([_Request("hello world the cat sat a cat")]),
            "generate": lm.generate_until([_Request("hello world", {"until": ["sat"], "max_gen_toks": 6})])}


def main() -> None:
    args = json.loads(sys.argv[1])
    if "lm_eval" in args:   # lm-eval's model starts the group itself (model_args tp=N)
        from studio.evaluation.lm_eval_model import StudioLM
        lm = StudioLM(model=args["model"], strategy="jacobi", device="cpu", dtype="fp32", tp=args["world"])
        print(json.dumps(lm_eval_answers(lm)))
        return
    from studio.run.launch import _workers, finish, start
    family = args.get("family", "llama")
    make = functools.partial(build, family) if "model" not in args else functools.partial(load, args["model"])
    engine = start(args["world"], make, timeout_s=args.get("timeout_s", 60.0), place_experts=args.get("ep", False))
    if args.get("kill_after"):   # a rank dies mid-run: rank 0 must end with one line, not hang
        from studio.engine.strategies import make_strategy
        from studio.errors import RankLost
        from studio.run.session import Run, Settings, prepare
        run = Run(prepare(engine, make_strategy("ar")), Settings(max_new_tokens=60), "", PROMPT)
        for i in range(60):
            if i == args["kill_after"]:
                os.kill(_workers[0].pid, signal.SIGKILL)
                _workers[0].join()
            try:
                run.advance()
            except RankLost as e:
                print(json.dumps({"lost": str(e), "step": i}))
                return
        print(json.dumps({"lost": None}))
        return
    if args.get("serve"):
        print(json.dumps(served(engine)))
    elif args.get("chat"):
        print(json.dumps(chat(engine)))
    else:
        print(json.dumps(decode(engine, args.get("adapter"), FAMILIES[family][1])))
    finish()


if __name__ == "__main__":
    main()

"""The sampled law of every strategy that claims exactness, in the mode a user gets with no `-p` at all: its default
parameters, the adapter shipped for it on the embedded model, the machine's own forward-cost table (measured by the
first cost-aware run of the test session, as a user's first run measures it), top-k and top-p processing. Each run
writes LENGTH tokens, long enough for a cost-aware plan to change along it; the law is checked position by position
against the exact conditionals of the model the run says it decodes (`PositionLaws`). `ar` is the control, and `isd`,
which decodes the adapted model, doubles as the power check: its samples against the base model's law must fail.

About 37 minutes on a 2-core machine for the ten cases (`make test-exact`, which `.ci/run` runs after `make test`):
DLM_EXACT=1 runs them, DLM_EXACT_SAMPLES sets the sample count (600 by default), and with DLM_EXACT_REPORT=FILE each
strategy appends its line (p, samples, the plans its runs made) to FILE."""
import os
from collections import Counter

import pytest
import torch

from studio.engine.kv_cache import KVCache
from studio.engine.sampling import SamplingParams, process_logits
from studio.engine.strategies import make_strategy
from studio.run.session import Settings, decoded_model, encode_prompt, run_to_end
from tests.support.exact import PositionLaws

pytestmark = [pytest.mark.slow, pytest.mark.exact]

SAMPLES = int(os.environ.get("DLM_EXACT_SAMPLES", "600"))
LENGTH = 8
RANKS = 4   # the top three tokens of each conditional, and the rest of the nucleus
SAMPLING = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
PROMPT = "Name a fruit and say why you like it."
ALPHA = 0.01

# label -> (strategy, parameters): the defaults, except where the strategy is exact only in one mode of a knob
CASES = {
    "ar": ("ar", {}),
    "r-isd": ("r-isd", {}),
    "isd": ("isd", {}),
    "jacobi": ("jacobi", {}),
    "jacobi-mr": ("jacobi-mr", {}),
    "s2d2 policy=always": ("s2d2", {"policy": "always"}),   # S2D2 is exact on the tokens its verifier decides
    "simsd": ("simsd", {}),
    "dflash": ("dflash", {}),                      # the shipped drafter's chain: sampled drafts against its q
    "dflash branches=3": ("dflash", {"branches": 3}),   # its draft tree: the multi-draft rule
}


@pytest.fixture(scope="module")
def engine():
    from studio.engine.engine import Engine
    from tests.conftest import default_gguf_file
    default_gguf_file()
    return Engine.load("default")   # each strategy with the adapter shipped for it, as a user gets it


def sample_runs(engine, name, params):
    """SAMPLES seeded runs of LENGTH tokens: (token ids, draft counts the run planned) of each."""
    ids = encode_prompt(engine, PROMPT)
    settings = lambda seed: Settings(max_new_tokens=LENGTH, sampling=SAMPLING, seed=seed)
    runs = []
    for seed in range(SAMPLES):
        r = run_to_end(engine, make_strategy(name, params), settings(seed), "", ids)
        runs.append((r.token_ids, [e["drafts"] for e in r.events if e["t"] == "plan"]))
    return ids, runs


def conditionals(view, gated: bool, ids, samples, batch: int = 32):
    """Each sample's exact conditionals under `view`'s model (its LoRA on every row when `gated`): logits [n, V], row
    t the next token's given the prompt and the sample's first t tokens. The prompt is one forward, shared; the
    samples then run in batches over copies of its cache (a full forward per sample cost ~6x the rows)."""
    view.activate()
    model = view.model
    dev = model.lm_head.weight.device
    P = len(ids)
    prompt = model.new_cache(P)
    with torch.inference_mode():
        first = model(torch.tensor(ids, device=dev), torch.arange(P, device=dev), prompt,
                      lora_gate=torch.full((P,), gated, device=dev), logits_rows=[P - 1])[0].float()
    prompt.commit(P)
    out = [first[:len(s)] for s in samples]
    by_length = {}
    for i, s in enumerate(samples):
        if len(s) > 1:
            by_length.setdefault(len(s), []).append(i)
    for n, members in by_length.items():
        for at in range(0, len(members), batch):
            rows = members[at:at + batch]
            kv = KVCache.stacked([prompt] * len(rows), P + n - 1)
            kv.length = P   # the batch reads the prompt's committed slots (stacked copies the slots, not the length)
            tokens = torch.tensor([samples[i][:n - 1] for i in rows], device=dev)
            positions = torch.arange(P, P + n - 1, device=dev).repeat(len(rows), 1)
            with torch.inference_mode():
                logits = model(tokens, positions, kv, lora_gate=torch.full(tokens.shape, gated, device=dev))
            for b, i in enumerate(rows):
                out[i] = torch.cat([first, logits[b].float()])
    return out


def position_laws(view, gated: bool, ids, runs) -> PositionLaws:
    """The runs' tokens against the exact conditionals of `view`'s model (its LoRA on every row when `gated`)."""
    laws = PositionLaws(LENGTH, RANKS)
    samples = [tokens for tokens, _ in runs]
    for tokens, logits in zip(samples, conditionals(view, gated, ids, samples)):
        laws.add(tokens, process_logits(logits, SAMPLING))
    return laws


def report(label, laws, runs, extra=""):
    plans = Counter(d for _, plan in runs for d in plan)
    changed = sum(len(set(plan[1:])) > 1 for _, plan in runs)   # plans after the prefill's that changed mid-run
    line = (f"{label}: p={laws.pvalue():.3g} over {laws.samples} samples of {LENGTH} tokens "
            f"({laws.impossible} tokens of probability 0); plans by drafts "
            f"{dict(sorted(plans.items()))}, changed mid-run in {changed} runs{extra}")
    path = os.environ.get("DLM_EXACT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return line


@pytest.mark.parametrize("label", list(CASES))
def test_default_mode_follows_the_law_of_the_model_it_decodes(engine, label):
    name, params = CASES[label]
    view = engine.for_strategy(name)
    strategy = make_strategy(name, params)
    gated = strategy.clean_gate(view.lora)
    ids, runs = sample_runs(engine, name, params)
    laws = position_laws(view, gated, ids, runs)
    extra = ""
    if label == "isd":
        assert decoded_model(view, strategy) is not None, "isd's shipped adapter adapts every row"
        # power: the same samples against the base model, a law one adapter away, must be seen to differ
        leak = position_laws(view, False, ids, runs)
        extra = f"; against the base model's law p={leak.pvalue():.3g}"
    line = report(label, laws, runs, extra)
    assert laws.pvalue() > ALPHA, line
    if label == "isd":
        assert leak.pvalue() < ALPHA, f"the harness cannot see an adapter's law: {line}"


def test_a_served_sampled_request_follows_the_base_law(engine):
    """The served path: r-isd's sampled requests through `serve` over loopback HTTP, four clients at a time (the
    server interleaves their runs step by step), each with its own seed; the tokens the stream's events emit are
    checked against the base model's law like the runs above."""
    from concurrent.futures import ThreadPoolExecutor

    openai = pytest.importorskip("openai")
    from studio.run.config import RunConfig
    from studio.serve.app import build_app, serving_in_thread

    ids = encode_prompt(engine, PROMPT)

    def served(url: str, seed: int) -> tuple[list[int], list[int]]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(
            model="default:r-isd", prompt=ids, max_tokens=LENGTH, temperature=SAMPLING.temperature,
            top_p=SAMPLING.top_p, seed=seed, stream=True, stream_options={"include_events": True},
            extra_body={"top_k": SAMPLING.top_k})
        events = [e for chunk in stream for e in (chunk.model_extra.get("dlm_trace") or {}).get("events", [])]
        return ([t for e in events if e["t"] == "emit" for t in e["tok"]],
                [e["drafts"] for e in events if e["t"] == "plan"])

    with serving_in_thread(build_app(engine, RunConfig("ar", max_new_tokens=LENGTH))) as url:
        with ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda seed: served(url, seed), range(SAMPLES)))
    assert all(tokens for tokens, _ in runs)   # every request answered (an EOS may end one early, as in a run)
    laws = position_laws(engine.for_strategy("r-isd"), False, ids, runs)
    line = report("r-isd served", laws, runs)
    assert laws.pvalue() > ALPHA, line

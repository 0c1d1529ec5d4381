"""Benchmarks: strategies against `ar` (and `transformers` generate) in one process, interleaved.

For every prompt and repeat, every strategy runs once in turn, so slow drifts of the machine hit all
strategies alike. Speedups are per-prompt ratios of medians; spread is reported, never hidden.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from studio.compare import RunSpec, first_difference
from studio.errors import BadInput
from studio.session import Session, encode_prompt

BUILTIN_PROMPTS = [
    "What is the capital of France?",                                      # chat
    "Write a Python function that checks whether a number is prime.",     # code
    "Write a numbered list of seven colours.",                              # a list
    "Tell me a short story about a cat who wants to fly.",                  # a story
]


def load_prompts(path: Path | None) -> list[str]:
    """One prompt per line, or JSON Lines with a "prompt" field."""
    if path is None:
        return list(BUILTIN_PROMPTS)
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise BadInput(f"cannot read prompts file {path}: {e.strerror}") from None
    prompts = []
    for i, ln in enumerate(lines, 1):
        if ln.lstrip().startswith("{"):
            try:
                prompts.append(json.loads(ln)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise BadInput(f"{path}:{i}: expected a JSON object with a 'prompt' field") from None
        else:
            prompts.append(ln)
    if not prompts:
        raise BadInput(f"prompts file {path} is empty")
    return prompts


@dataclass
class Samples:
    tok_s: list[float] = field(default_factory=list)
    tpf: list[float] = field(default_factory=list)
    accept: list[float] = field(default_factory=list)
    same_as_ar: list[bool] = field(default_factory=list)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def hf_generate_tok_s(engine, prompt_ids: list[int], n_new: int) -> float | None:
    """`transformers` generate on the same weights (greedy, decode only), or None when not installed."""
    import torch
    try:
        model = _hf_model(engine)
    except ImportError:
        return None
    x = torch.tensor([prompt_ids])
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
        total = time.perf_counter() - t
    return (n_new - 1) / max(total - prefill, 1e-9)


_HF_CACHE: dict = {}


def _hf_model(engine):
    """A transformers model sharing our weights (built once per engine)."""
    import transformers as tf
    key = id(engine)
    if key not in _HF_CACHE:
        c = engine.config
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config}[c.arch]
        extra = {"head_dim": c.head_dim} if c.arch != "qwen2" else {}
        cfg = cls(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
                  num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                  max_position_embeddings=c.max_seq_len, rms_norm_eps=c.rms_eps, rope_theta=c.rope_theta,
                  rope_scaling=c.rope_scaling, tie_word_embeddings=c.tie_embeddings,
                  eos_token_id=engine.eos_ids(), **extra)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        model.load_state_dict(engine.model.state_dict(), strict=False)
        _HF_CACHE[key] = model
    return _HF_CACHE[key]


def run_bench(engine, prompts: list[str], specs: list[RunSpec], make_run, repeats: int = 3, warmup: int = 1,
              with_transformers: bool = True, progress=None) -> dict:
    """Returns the --json report: per strategy tok/s, TPF, acceptance, speedups vs ar and vs transformers."""
    runs = {s.label: make_run(s) for s in specs}
    n_new = max(settings.max_new_tokens for _, settings in runs.values())
    ids = [encode_prompt(engine, p) for p in prompts]
    samples = {label: [Samples() for _ in prompts] for label in runs}
    hf = [[] for _ in prompts]
    for w in range(warmup):
        for label, (strategy, settings) in runs.items():
            Session(engine, strategy, settings).run(prompts[0], ids[0])
            if progress:
                progress("warm-up", label)
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            ar_ids = None
            for label, (strategy, settings) in runs.items():
                r = Session(engine, strategy, settings).run(prompt, ids[i])
                s = samples[label][i]
                s.tok_s.append(r.footer["tok_s"])
                s.tpf.append(r.footer["tpf"])
                s.accept.append(r.footer["accept_rate"])
                if label == "ar":
                    ar_ids = r.token_ids
                s.same_as_ar.append(first_difference(ar_ids, r.token_ids) is None)
                if progress:
                    progress(f"repeat {rep + 1}/{repeats}", label)
            if with_transformers:
                tok_s = hf_generate_tok_s(engine, ids[i], n_new)
                if tok_s is not None:
                    hf[i].append(tok_s)
                if progress:
                    progress(f"repeat {rep + 1}/{repeats}", "transformers")
    return _report(engine, prompts, runs, samples, hf, repeats, warmup)


def _report(engine, prompts, runs, samples, hf, repeats, warmup) -> dict:
    ar_med = [statistics.median(s.tok_s) for s in samples["ar"]]
    hf_med = [statistics.median(x) for x in hf] if all(hf) else None
    out = {"model": engine.model_meta(), "prompts": prompts, "repeats": repeats, "warmup": warmup,
           "transformers_tok_s": spread(hf_med) if hf_med else None, "strategies": []}
    for label, (strategy, settings) in runs.items():
        per_prompt = samples[label]
        med = [statistics.median(s.tok_s) for s in per_prompt]
        out["strategies"].append({
            "label": label, "strategy": strategy.name,
            "params": dict(vars(strategy.params), temperature=settings.sampling.temperature,
                           max_new_tokens=settings.max_new_tokens),
            "tok_s": spread([x for s in per_prompt for x in s.tok_s]),
            "tpf": spread([x for s in per_prompt for x in s.tpf]),
            "accept_rate": spread([x for s in per_prompt for x in s.accept]),
            "speedup_vs_ar": spread([m / a for m, a in zip(med, ar_med)]),
            "speedup_vs_transformers": spread([m / h for m, h in zip(med, hf_med)]) if hf_med else None,
            "exact_match_vs_ar": sum(x for s in per_prompt for x in s.same_as_ar) / (len(prompts) * repeats),
        })
    return out

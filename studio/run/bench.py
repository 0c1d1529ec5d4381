"""Benchmarks: strategies against a baseline -- `ar`, or the model's own one-token-per-step decode where it has no AR
mode (`compare.fit_baseline`) -- and `transformers` generate, in one process, interleaved. A run that approximates
an exact decode (a cached canvas run) is also compared with that exact run (`compare.with_references`), per prompt.

For every prompt and repeat, every strategy's run advances in lock-step with the others, one forward at a time (each
timed by its own clock), so drifts of the machine hit all strategies alike. Speedups are per-prompt ratios of medians; spread is reported, never hidden.
With `concurrency` C > 1 the prompts run in stationary batches of C (studio.engine.batch: ar, isd, r-isd,
greedy) instead: speed is a batch's throughput (its new tokens / its wall time, prefill included) and
speedups are per-batch ratios to ar at the same concurrency; TPF, acceptance and agreement stay per sequence.
Under `--oracle-accept P` (runs whose settings carry `oracle_accept`) accept decisions are Bernoulli(P) draws:
the engine's efficiency (speedup / TPF) at a controlled acceptance, with the expected TPF beside the measured
one where a strategy knows it; the outputs are not the model's, so agreement with ar is not reported.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from studio.engine.batch import decode_strategy_batch, round_shape
from studio.engine.device import synchronize
from studio.engine.forward_cost import weight_bytes
from studio.errors import BadInput
from studio.files import read_user_text
from studio.run.compare import first_difference
from studio.run.config import RunConfig
from studio.run.session import Run, drive, encode_prompt, kv_length_needed, prepare, run_to_end
from studio.run.sweep import aup_line
from studio.traces import projection

BUILTIN_PROMPTS = [
    "What is the capital of France?",                                      # chat
    "Write a Python function that checks whether a number is prime.",     # code
    "Write a numbered list of seven colours.",                              # a list
    "Tell me a short story about a cat who wants to fly.",                  # a story
]


def bench_length(config, scored: bool) -> int:
    """The answer length of a bench (and of each tune trial): what the command line or model preset gives, else
    32 tokens for a question set's short answers and 64 for prompts."""
    given = config.length_given()
    return (32 if scored else 64) if given is None else given


def load_prompts(path: Path | None) -> list[str]:
    """One prompt per line, or JSON Lines with a "prompt" field."""
    if path is None:
        return list(BUILTIN_PROMPTS)
    text = read_user_text(path, "prompts file")
    # Lines end at \n only (read_text turns \r\n and \r into \n): str.splitlines() also splits at U+2028,
    # U+0085, \x0b ..., which a JSON string may hold unescaped.
    prompts = []
    for i, ln in enumerate(text.split("\n"), 1):
        if not ln.strip():
            continue
        if ln.lstrip().startswith("{"):
            try:
                prompt = json.loads(ln)["prompt"]
            except (ValueError, KeyError, TypeError, RecursionError):  # also 4300+ digit ints, nesting too deep
                raise BadInput(f"{path}:{i}: expected a JSON object with a 'prompt' field") from None
            if not isinstance(prompt, str) or not prompt.strip():
                raise BadInput(f"{path}:{i}: 'prompt' must be a non-empty string")
            prompts.append(prompt)
        else:
            prompts.append(ln)
    if not prompts:
        raise BadInput(f"prompts file {path} is empty")
    return prompts


@dataclass
class Samples:
    """One strategy on one prompt, one entry per repeat."""
    tok_s: list[float] = field(default_factory=list)
    tpf: list[float] = field(default_factory=list)
    accept: list[float | None] = field(default_factory=list)   # None: the run verified no drafts
    same_as_ar: list[bool] = field(default_factory=list)   # the baseline's tokens (ar's, where it runs)
    tokens: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    projected: list = field(default_factory=list)   # studio.traces.projection.Projection per repeat (with costs)

    def add(self, result, ar_ids: list[int]) -> None:
        """TPF, acceptance and agreement of one repeat, from a run's footer and events (a `RunResult`, or a
        batched sequence's `SequenceResult`: the same events and footer) and the baseline's tokens on the same
        prompt."""
        self.tpf.append(result.footer["tpf"])
        verified = any(e["t"] in ("accept", "reject") for e in result.events)
        self.accept.append(result.footer["accept_rate"] if verified else None)
        self.same_as_ar.append(first_difference(ar_ids, result.token_ids) is None)
        self.tokens.append(list(result.token_ids))
        self.texts.append(result.footer["text"])


def spread(xs: list[float]) -> dict | None:
    """median, min, max and the number of samples; None when there are none."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def hf_generate(engine, prompt_ids: list[int], n_new: int, exact_length: bool = False) -> list[int]:
    """Greedy `transformers` generate on our weights; the new token ids. The attention mask is explicit:
    transformers would otherwise take prompt tokens equal to its pad id for padding."""
    import torch
    model = _hf_model(engine)
    x = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                             min_new_tokens=n_new if exact_length else None, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def hf_generate_tok_s(engine, prompt_ids: list[int], n_new: int) -> float | None:
    """`transformers` generate on the same weights (greedy, decode only), or None when not installed."""
    try:
        _hf_model(engine)
    except ImportError:
        return None
    t = time.perf_counter()
    hf_generate(engine, prompt_ids, 1)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    hf_generate(engine, prompt_ids, n_new, exact_length=True)
    total = time.perf_counter() - t
    return (n_new - 1) / max(total - prefill, 1e-9)


_HF_CACHE: dict = {}


def _hf_model(engine):
    """A transformers model with our weights, on our device in our dtype (built once per engine)."""
    import torch
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
                  eos_token_id=engine.eos_ids() or None, pad_token_id=(engine.eos_ids() or [0])[0], **extra)
        w = engine.model.lm_head.weight
        with torch.device(w.device):
            model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=w.dtype).eval()
        state = engine.model.state_dict()   # the base weights; an adapter's MASK rows (input-only) may have grown
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:c.vocab_size]   # the table
        model.load_state_dict(state, strict=False)
        _HF_CACHE[key] = model
    return _HF_CACHE[key]


def check_concurrency(runs, concurrency: int) -> None:
    """BadInput unless every (strategy, settings) run can decode in stationary batches of `concurrency`."""
    if concurrency < 1:
        raise BadInput(f"--concurrency must be >= 1, got {concurrency}")
    if concurrency == 1:
        return
    for strategy, settings in runs:
        round_shape(strategy, settings.sampling)
        if settings.oracle_accept is not None:
            raise BadInput("--oracle-accept applies to batch-1 runs only (--concurrency 1)")


def run_bench(engine, prompts: list[str], configs: Mapping[str, RunConfig], repeats: int = 3, warmup: int = 1,
              with_transformers: bool = True, progress=None, concurrency: int = 1,
              exact: Mapping[str, str] | None = None, costs=None) -> dict:
    """Returns the --json report:

    `model, prompts, repeats, warmup`; `transformers_tok_s` (spread over every transformers sample, None when
    skipped or not installed) and `transformers_per_prompt` (the samples); `strategies`: one object per run
    with `label, strategy, params`, spreads (`median, min, max, n`) of `tok_s`, `tpf`, `accept_rate` (None
    when the strategy verifies nothing) over every sample, `speedup_vs_ar` and `speedup_vs_transformers`
    (spreads over prompts of median(strategy tok/s) / median(baseline tok/s) on that prompt),
    `exact_match_vs_ar` (share of runs whose tokens equal ar's on the same prompt and repeat; None for every
    run but ar under the oracle), `expected_tpf` (under the oracle, `Strategy.expected_tpf(P)`, else None) and
    `per_prompt` (the raw samples, one entry per repeat); `oracle_accept` (P, or None).

    `concurrency` C > 1 (`check_concurrency`; no transformers baseline): `batches` lists the prompt indices of each
    stationary batch and every strategy's `batch_tok_s` its throughput samples (one list per batch, one entry per
    repeat); `tok_s` and `speedup_vs_ar` are then spreads over those batches, `per_prompt` has no `tok_s` (None),
    and `tpf`, `accept_rate`, `exact_match_vs_ar` are per sequence, as at C = 1; `ar_batch1_tok_s` is ar's
    throughput on the same prompts one at a time (interleaved with the batches) and `ar_speedup_vs_batch1` the
    spread over batches of ar's batch throughput over it. At C = 1 these four fields are None.

    The first config is the baseline (`baseline`: its label) that the `_vs_ar` fields are against. `exact` maps a
    label to the label of the exact run it approximates (listed in `configs`): `reference` names it,
    `exact_match_vs_reference` is the share of runs whose tokens equal its on the same prompt and repeat, and
    `reference_first_difference` the first differing token per prompt (first repeat; None where equal).

    `costs` (studio.traces.projection.DeviceCosts, one prompt at a time only): `costs` names the table and its
    origin, and every strategy's `projected_vs_ar` is the spread over prompts of its tokens per priced ms over the
    baseline's (medians over repeats): the forwards' cost on that device, a projection. Without it both are None."""
    if not configs:
        raise BadInput("bench needs a baseline first (compare_configs puts ar there)")
    if costs is not None and concurrency > 1:
        raise BadInput("--costs prices runs decoded one at a time: not with --concurrency")
    runs = {label: config.build() for label, config in configs.items()}
    check_concurrency(runs.values(), concurrency)
    if engine.model.parallel is not None:
        if concurrency > 1:
            raise BadInput("--concurrency: batches are not split across ranks yet (--tp, --ep)")
        with_transformers = False   # a rank holds a shard of the weights, not a model transformers could load
    if engine.quant != "none":
        with_transformers = False   # transformers would run float weights: another model than the one benched
    ids = [encode_prompt(engine, p) for p in prompts]
    if concurrency > 1:
        samples, batches, batch_tok_s, solo = _bench_batched(engine, ids, runs, repeats, warmup, concurrency,
                                                             progress)
        report = _report(engine, prompts, runs, samples, [[] for _ in prompts], repeats, warmup,
                         concurrency, batches, batch_tok_s, exact)
        batched = [statistics.median(x) for x in batch_tok_s[next(iter(runs))]]
        report["ar_batch1_tok_s"] = spread([x for xs in solo for x in xs])
        report["ar_speedup_vs_batch1"] = spread([b / statistics.median(s) for b, s in zip(batched, solo)])
        return report
    n_new = max(settings.max_new_tokens for _, settings in runs.values())
    ready = {label: prepare(engine, strategy) for label, (strategy, _) in runs.items()}   # off every clock
    samples = {label: [Samples() for _ in prompts] for label in runs}
    hf = [[] for _ in prompts]
    for w in range(warmup):
        for label, (strategy, settings) in runs.items():
            run_to_end(engine, strategy, settings, prompts[0], ids[0])
            if progress:
                progress("warm-up", label)
        if with_transformers:
            hf_generate_tok_s(engine, ids[0], n_new)
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            # every strategy's run of this prompt in lock-step, one forward at a time (each timed by its own clock):
            # the machine's drift, which swings a run's speed by 10-20 % from one second to the next here, then hits
            # every strategy alike instead of whichever ran during it
            prompt_runs = {label: Run(ready[label], settings, prompt, ids[i]) for label, (_, settings) in runs.items()}
            drive(list(prompt_runs.values()))
            ar_ids = None
            for label, run in prompt_runs.items():
                r = run.result
                if ar_ids is None:   # the baseline comes first
                    ar_ids = r.token_ids
                samples[label][i].tok_s.append(r.footer["tok_s"])
                samples[label][i].add(r, ar_ids)
                if costs is not None:
                    samples[label][i].projected.append(projection.project(r.events, costs))
                if progress:
                    progress(f"repeat {rep + 1}/{repeats}", label)
            if with_transformers:
                tok_s = hf_generate_tok_s(engine, ids[i], n_new)
                if tok_s is not None:
                    hf[i].append(tok_s)
                if progress:
                    progress(f"repeat {rep + 1}/{repeats}", "transformers")
    return _report(engine, prompts, runs, samples, hf, repeats, warmup, exact=exact, costs=costs)


def _bench_batched(engine, ids: list[list[int]], runs: dict, repeats: int, warmup: int, concurrency: int, progress):
    """The prompts in stationary batches of `concurrency` (in order), every strategy once per batch and repeat,
    then ar on the same prompts one at a time (what batching gains). Returns (per-prompt Samples without tok/s,
    the batches' prompt indices, per label and batch the throughputs, per batch ar's batch-1 throughputs)."""
    for strategy, settings in runs.values():
        for p in ids:
            kv_length_needed(engine.for_strategy(strategy.name), strategy, settings, p)
    batches = [list(range(i, min(i + concurrency, len(ids)))) for i in range(0, len(ids), concurrency)]
    samples = {label: [Samples() for _ in ids] for label in runs}
    tok_s = {label: [[] for _ in batches] for label in runs}
    solo = [[] for _ in batches]
    base = next(iter(runs))   # the baseline runs first
    for _ in range(warmup):
        for label, (strategy, settings) in runs.items():
            _timed_batch(engine, strategy, settings, [ids[i] for i in batches[0]])
            if progress:
                progress("warm-up", label)
    for rep in range(repeats):
        for b, batch in enumerate(batches):
            for label, (strategy, settings) in runs.items():
                results, wall_s = _timed_batch(engine, strategy, settings, [ids[i] for i in batch])
                tok_s[label][b].append(sum(r.footer["n_tokens"] for r in results) / wall_s)
                if label == base:
                    ar_ids = [r.token_ids for r in results]
                for i, r, ar in zip(batch, results, ar_ids):
                    samples[label][i].add(r, ar)
                if progress:
                    progress(f"repeat {rep + 1}/{repeats}", label)
            alone = [_timed_batch(engine, *runs[base], [ids[i]]) for i in batch]
            solo[b].append(sum(r[0].footer["n_tokens"] for r, _ in alone) / sum(wall_s for _, wall_s in alone))
            if progress:
                progress(f"repeat {rep + 1}/{repeats}", "ar at batch 1")
    return samples, batches, tok_s, solo


def _timed_batch(engine, strategy, settings, prompt_ids: list[list[int]]):
    """One stationary batch: its per-sequence results (events and footers, as batch-1 runs') and its wall time,
    prefill included (device synchronised)."""
    engine.for_strategy(strategy.name).activate()      # an adapter switch is not decoding time
    device = engine.model.lm_head.weight.device
    synchronize(device)
    t = time.perf_counter()
    results = decode_strategy_batch(engine, strategy, settings.sampling, prompt_ids, settings.max_new_tokens)
    synchronize(device)
    return results, time.perf_counter() - t


def _report(engine, prompts, runs, samples, hf, repeats, warmup, concurrency=1, batches=None,
            batch_tok_s=None, exact=None, costs=None) -> dict:
    # the unit speeds are compared on: a prompt run alone, or a stationary batch
    speed = batch_tok_s or {label: [s.tok_s for s in per_prompt] for label, per_prompt in samples.items()}
    base = next(iter(runs))
    ar_med = [statistics.median(x) for x in speed[base]]
    hf_med = [statistics.median(x) for x in hf] if all(hf) else None
    oracle = runs[base][1].oracle_accept
    exact = exact or {}
    # the bytes a 1-token step streams: what a tok/s is read against a card's bandwidth (scripts/gpu_numbers_summary.py)
    out = {"model": {**engine.model_meta(), "step_bytes": weight_bytes(engine)}, "baseline": base, "prompts": prompts, "repeats": repeats, "warmup": warmup,
           "oracle_accept": oracle, "concurrency": concurrency, "batches": batches,
           "transformers_tok_s": spread([x for xs in hf for x in xs]) if hf_med else None,
           "transformers_per_prompt": hf if hf_med else None, "strategies": [],
           "ar_batch1_tok_s": None, "ar_speedup_vs_batch1": None,   # C > 1: set by run_bench
           "costs": None if costs is None else {"name": costs.name, "origin": costs.origin}}
    rates = {label: [_projected_rate(s) for s in per_prompt] for label, per_prompt in samples.items()}
    for label, (strategy, settings) in runs.items():
        per_prompt = samples[label]
        med = [statistics.median(x) for x in speed[label]]
        out["strategies"].append({
            "label": label, "strategy": strategy.name,
            "params": dict(strategy.header_params(), temperature=settings.sampling.temperature,
                           max_new_tokens=settings.max_new_tokens),
            "tok_s": spread([x for xs in speed[label] for x in xs]),
            "tpf": spread([x for s in per_prompt for x in s.tpf]),
            "accept_rate": spread([x for s in per_prompt for x in s.accept]),
            "speedup_vs_ar": spread([m / a if a else None for m, a in zip(med, ar_med)]),
            "speedup_vs_transformers": spread([m / h if h else None for m, h in zip(med, hf_med)]) if hf_med else None,
            "exact_match_vs_ar": None if oracle is not None and label != base else
                                 sum(x for s in per_prompt for x in s.same_as_ar) / (len(prompts) * repeats),
            **_against(per_prompt, samples.get(exact.get(label)), exact.get(label)),
            "expected_tpf": None if oracle is None else strategy.expected_tpf(oracle),
            "projected_vs_ar": None if costs is None else
                               spread([m / a if m and a else None for m, a in zip(rates[label], rates[base])]),
            # the raw samples the numbers above come from: per prompt, one entry per repeat
            "per_prompt": [{"tok_s": None if batches else s.tok_s, "tpf": s.tpf, "accept_rate": s.accept,
                            "same_as_ar": s.same_as_ar, "text": s.texts} for s in per_prompt],
            "batch_tok_s": batch_tok_s[label] if batches else None,
        })
    return out


def _projected_rate(s: Samples) -> float | None:
    """A prompt's tokens per projected ms, the median over its repeats (None: nothing was priced)."""
    rates = [p.tokens / p.forward_ms for p in s.projected if p.forward_ms > 0]
    return statistics.median(rates) if rates else None


def format_spread(s: dict | None, digits: int = 2) -> str:
    """"median [min–max]" of a `spread`, or "—"."""
    return "—" if not s else f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The bench table as the terminal and the HTML page show it: the header, then one row of cells per
    strategy. Under the oracle an expected-TPF column follows TPF, and "= ar" is "—" (outputs mean nothing)."""
    oracle = report["oracle_accept"] is not None
    speed = "tok/s" if report["concurrency"] == 1 else "batch tok/s"
    base = "ar" if report.get("baseline", "ar") == "ar" else "base"
    exact = any(r.get("reference") for r in report["strategies"])
    task = report.get("task") is not None
    costs = report.get("costs")
    projected = [f"× {base} on {costs['name']} (projected)"] if costs else []
    head = ["strategy", *(["accuracy"] if task else []), speed, "TPF", *(["TPF expected"] if oracle else []), "accept",
            f"× {base}", *projected, "× transformers", f"= {base}", *(["= exact"] if exact else [])]
    rows = []
    for r in report["strategies"]:
        expected = ["—" if r["expected_tpf"] is None else f"{r['expected_tpf']:.2f}"] if oracle else []
        same = "—" if r["exact_match_vs_ar"] is None else f"{r['exact_match_vs_ar']:.0%}"
        rows.append([r["label"], *([f"{r['accuracy']:.0%}"] if task else []), format_spread(r["tok_s"], 1),
                     format_spread(r["tpf"]), *expected,
                     format_spread(r["accept_rate"]), format_spread(r["speedup_vs_ar"]),
                     *([format_spread(r["projected_vs_ar"])] if costs else []),
                     format_spread(r["speedup_vs_transformers"]), same, *([same_as_exact(r)] if exact else [])])
    return head, rows


def same_as_exact(row: dict) -> str:
    """How a run agrees with its exact reference: the share of identical outputs, and where the first differs."""
    if not row.get("reference"):
        return "—"
    firsts = [k for k in row["reference_first_difference"] if k is not None]
    return f"{row['exact_match_vs_reference']:.0%}" + (f" (from token {min(firsts)})" if firsts else "")


def report_title(report: dict) -> str:
    oracle, c = report["oracle_accept"], report["concurrency"]
    base = report.get("baseline", "ar")
    task = report.get("task")
    return (f"bench: {len(report['prompts'])} {'questions of ' + task['name'] if task else 'prompts'} "
            f"× {report['repeats']} repeats"
            + ("" if base == "ar" else f", baseline {base} (the model has no AR mode)")
            + ("" if c == 1 else f", stationary batches of {c} (batch tok/s: new tokens ÷ the batch's wall time)")
            + ("" if oracle is None else f", oracle acceptance {oracle:g} (outputs not meaningful)")
            + ("" if report["model"].get("quant", "none") == "none" else
               f", {report['model']['quant']} weights (transformers left out: it would run the float ones)"))


def write_bench_html(report: dict, path) -> Path:
    """A self-contained HTML page (plotly.js inlined, opens offline): the bench table and its figure."""
    import html as _html
    import plotly.io as pio
    from studio.viz.figures import accuracy_figure, bench_figure, parallelism_figure

    hf = report["transformers_tok_s"]
    head, rows = table_rows(report)
    cells = ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
             + "".join("<tr>" + "".join(f"<td>{_html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
             + "</table>")
    heading = f"dlm-studio {report_title(report)}"
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{_html.escape(heading)}</title><style>"
            "body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}"
            f"</style></head><body><h1>{_html.escape(heading)}</h1>"
            f"<p>model {_html.escape(report['model']['name'])} · median [min–max] over prompts and repeats · "
            f"transformers generate: {format_spread(hf, 1)} tok/s</p>{cells}"
            + (f"<p>{_html.escape(projection.caption(**report['costs']))}</p>" if report.get("costs") else "")
            + pio.to_html(bench_figure(report), full_html=False, include_plotlyjs=True, config={"displaylogo": False})
            + (pio.to_html(accuracy_figure(report), full_html=False, include_plotlyjs=False,
                           config={"displaylogo": False}) if report.get("task") else "")
            + (f"<p>{_html.escape(aup_line(report))}</p>" + pio.to_html(
                parallelism_figure(report), full_html=False, include_plotlyjs=False, config={"displaylogo": False})
               if report.get("aup") else "")
            + "<h2>Prompts</h2><ol>" + "".join(f"<li>{_html.escape(p)}</li>" for p in report["prompts"])
            + "</ol></body></html>")
    path = Path(path)
    from studio.files import atomic_write
    with atomic_write(path) as f:   # a temporary name renamed into place: never a half-written report
        f.write(page)
    return path


@dataclass
class ForwardCosts:
    """`bench forwards`: one forward of each shape the strategies use, timed round-robin, with what explains them
    (the copy bandwidth, the verify kernel, an MoE layer against a dense one) and the cost table by row count."""
    head: dict       # the report's own fields (rounded, as the JSON gives them)
    costs: list      # `forward_cost.measure_forwards`: one per shape, the 1-token step first
    by_rows: object  # the cost table by row count (`cost_model.cost_table`), measured anew
    copy_gbps: float
    stream_gbps: float
    moe_ratio: float | None

    def to_dict(self) -> dict:
        return {**self.head, "forwards": [c.to_dict() for c in self.costs], "by_rows": self.by_rows.to_dict()}


def measure_forward_costs(engine, repeats: int, warmup: int) -> ForwardCosts:
    """Time the forwards of `engine` (the view a strategy runs: with r-isd's adapter, the gated shape is timed too)
    10 x `repeats` times each; the cached cost table is refreshed."""
    import torch
    from studio.engine.cost_model import cost_table
    from studio.engine.forward_cost import (compiled_vs_eager, copy_bandwidth, fused_vs_plain, int8_vs_float,
                                            lora_overhead, measure_forwards, moe_step_vs_dense, moe_vs_dense,
                                            verify_time, weight_bytes)
    device = engine.model.lm_head.weight.device
    costs = measure_forwards(engine, repeats=10 * repeats, warmup=max(warmup, 1))
    by_rows = cost_table(engine, refresh=True)   # measured anew: bench forwards refreshes the cached table
    copy_gbps, verify_s, verify_path = copy_bandwidth(device), *verify_time(engine)
    moe_ratio, fused, int8 = moe_vs_dense(engine), fused_vs_plain(engine), int8_vs_float(engine)
    compiled = compiled_vs_eager(engine)
    moe_step = moe_step_vs_dense(engine, repeats=10 * repeats)
    weights = weight_bytes(engine)
    stream_gbps = weights / (costs[0].ms / 1e3) / 1e9   # the 1-token step reads every weight once
    head = {**engine.model_meta(), "threads": torch.get_num_threads(), "graphs": engine.graphs, "weight_bytes": weights,
            "copy_gbps": round(copy_gbps, 2), "step_stream_gbps": round(stream_gbps, 2),
            "step_share_of_copy": round(stream_gbps / copy_gbps, 3), "lora_overhead": lora_overhead(costs),
            "verify_7_rows_us": round(verify_s * 1e6, 1), "verify_path": verify_path,
            "moe_layer_vs_dense": None if moe_ratio is None else round(moe_ratio, 3),
            "moe_step_vs_dense": None if moe_step is None else round(moe_step, 3),
            "fused_vs_plain": None if fused is None else {k: round(v, 3) for k, v in fused.items()},
            "int8_vs_float": None if int8 is None else {k: round(v, 3) for k, v in int8.items()},
            "compiled_vs_eager": None if compiled is None else {k: round(v, 3) for k, v in compiled.items()}}
    return ForwardCosts(head, costs, by_rows, copy_gbps, stream_gbps, moe_ratio)


def _against(mine: list[Samples], ref: list[Samples] | None, label: str | None) -> dict:
    """The report fields of a run against its exact reference (None when it has none)."""
    if ref is None:
        return {"reference": None, "exact_match_vs_reference": None, "reference_first_difference": None}
    pairs = [(a, b) for m, r in zip(mine, ref) for a, b in zip(m.tokens, r.tokens)]
    return {"reference": label,
            "exact_match_vs_reference": sum(first_difference(b, a) is None for a, b in pairs) / len(pairs),
            "reference_first_difference": [first_difference(r.tokens[0], m.tokens[0]) for m, r in zip(mine, ref)]}

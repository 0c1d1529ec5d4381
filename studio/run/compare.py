"""Side-by-side comparison: several strategies on one prompt, seed and sampling setting, in one process.

A baseline always runs first and speed is measured against it: `ar`, or on a model without an AR mode (LLaDA,
DiffusionGemma) the model's own one-token-per-step decode (`fit_baseline`). Each run's output is compared with its
reference: the exact decode a run approximates when it has one (a cached canvas run: the same run with
cache=none, added beside it), else the `ar` run of the model it decodes (`Run.model_adapter`) -- the `ar` row for
runs on the base model (no adapter, a MASK-row adapter, r-isd), and an extra `ar` run on the adapter for a run that
decodes an adapter of every row (isd on smollm2-isd: `ar · smollm2-isd`), which `make_runs` adds
(not on a model an adapter made bidirectional: canvas on smollm2-mdm, whose cached rows have their cache=none
twin) -- else the baseline.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Mapping

from studio.errors import BadInput
from studio.run.config import RunConfig
from studio.run.session import (
    CANCELLED,
    Run,
    RunResult,
    prepare,
    decoded_model,
    drive,
    kv_length_needed,
)

ENDED_ON_ITS_OWN = ("eos", "stop_string")   # stop reasons after which a run's output is complete


def compare_configs(items: str, base: RunConfig | None = None, ar_alone: bool = False) -> dict[str, RunConfig]:
    """`ar,isd,isd-n4` -> {label: RunConfig}: each item a strategy or a strategy preset on `base`'s settings
    (`RunConfig.use`), `ar` first (added when missing: the baseline). BadInput for an unknown or repeated item,
    or a list with nothing to compare with `ar` -- unless `ar_alone` (a bench of ar against transformers)."""
    base = base or RunConfig()
    configs: dict[str, RunConfig] = {}
    for item in [s.strip() for s in items.split(",") if s.strip()]:
        config = base.use(item)
        if config.label in configs:
            raise BadInput(f"{config.label} is listed twice: {items}")
        configs[config.label] = config
    if set(configs) <= {"ar"} and not (ar_alone and configs):
        got = f" (got {items.strip()!r})" if items.strip() else ""
        raise BadInput(f"nothing to compare with ar: name a strategy or preset besides it{got}")
    ar = configs.pop("ar", None) or base.use("ar")
    return {"ar": ar, **configs}


BASELINES = {"canvas": "canvas · 1 token/step", "gemma-canvas": "gemma-canvas"}   # no AR mode: label


def fit_baseline(engine, configs: Mapping[str, RunConfig]) -> dict[str, RunConfig]:
    """`configs` (ar first, `compare_configs`) for `engine`'s model. Where `ar` has no AR mode to run, the baseline
    is the model's own one-token-per-step decode instead: canvas at one token per step without a cache (LLaDA), or
    gemma-canvas at its defaults (DiffusionGemma), labelled as such; a listed run equal to it stands in for it."""
    from studio.engine.strategies import STRATEGIES
    if STRATEGIES["ar"].fits(engine.config):
        return dict(configs)
    name = next(n for n in BASELINES if STRATEGIES[n].fits(engine.config))
    baseline = dataclasses.replace(configs["ar"], strategy=name, preset=None, params={})
    rest = {label: c for label, c in configs.items() if label != "ar"}
    same = next((label for label, c in rest.items() if _signature(c) == _signature(baseline)), None)
    if same is not None:
        return {same: rest.pop(same), **rest}
    return {BASELINES[name]: baseline, **rest}


def _signature(config: RunConfig) -> tuple:
    """What a run decodes: two configs with one signature make the same run."""
    strategy, settings = config.build()
    return strategy.name, repr(sorted(strategy.header_params().items())), repr(settings), config.adapter


def with_references(configs: Mapping[str, RunConfig]) -> tuple[dict[str, RunConfig], dict[str, str]]:
    """`configs` with, after each run that approximates an exact decode (`Strategy.exact_reference`: a cached
    canvas run), that exact run (`LABEL · cache=none`) unless one is listed; and {label: its exact reference}."""
    out: dict[str, RunConfig] = {}
    refs: dict[str, str] = {}
    listed = {_signature(c): label for label, c in configs.items()}
    for label, config in configs.items():
        out[label] = config
        overrides = config.build()[0].exact_reference()
        if overrides is None:
            continue
        twin = dataclasses.replace(config, params={**config.params, **overrides})
        refs[label] = listed.setdefault(_signature(twin), f"{label} · cache=none")   # one twin for runs sharing it
        if refs[label] not in configs:   # a listed exact run keeps its place in the list
            out[refs[label]] = twin
    return out, refs


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How a run's output agrees with its reference's, on the tokens both produced."""
    difference: int | None   # the first position where they really differ; None when they agree
    compared: int            # tokens both produced
    so_far: bool             # they agree, but a run was cut short (cancelled, or at a lower token limit)


def agreement(ref: RunResult, run: RunResult) -> Agreement:
    """Compare `run`'s tokens with `ref`'s where both produced one. Different lengths differ only where the
    shorter run ended on its own (EOS, a stop string) while the other went on; a run cut short (cancelled, or
    at a lower --max-new-tokens) agrees "so far"."""
    a, b = ref.token_ids, run.token_ids
    compared = min(len(a), len(b))
    k = first_difference(a[:compared], b[:compared])
    if k is None and len(a) != len(b):
        shorter = ref if len(a) < len(b) else run
        if shorter.footer["stop_reason"] in ENDED_ON_ITS_OWN:
            k = compared
    cut_short = len(a) != len(b) or CANCELLED in (ref.footer["stop_reason"], run.footer["stop_reason"])
    return Agreement(k, compared, k is None and cut_short and run is not ref)


def reference_label(model_adapter: str | None) -> str:
    """The label of the `ar` run on `model_adapter`'s model (None: the base model), when it is not the `ar` row."""
    return f"ar · {Path(model_adapter).name}" if model_adapter else "ar · base"


def references(results: dict[str, RunResult]) -> dict[str, str]:
    """label -> the label of its reference: the one `make_runs` planned (`RunResult.reference`), else the first `ar`
    run that decodes the same model, else (a model without an AR mode) the baseline. A reference that did not run
    (a front end that runs only the specs) is named all the same."""
    ar_on: dict[str | None, str] = {}
    for label, r in results.items():
        if r.header["strategy"] == "ar":
            ar_on.setdefault(r.model_adapter, label)
    first = next(iter(results))
    if not ar_on and results[first].header["strategy"] != "ar":   # no AR mode: the model's own baseline
        return {label: r.reference or first for label, r in results.items()}
    return {label: r.reference or ar_on.get(r.model_adapter) or reference_label(r.model_adapter)
            for label, r in results.items()}


def rows(results: dict[str, RunResult], costs=None) -> list[dict]:
    """One row per run: the numbers the table, --json and reports show (all from footers/events). Speed and
    `identical_to_ar` are against the `ar` row; `identical_to_reference` against the row's reference (None
    when it did not run). Outputs are compared on the tokens both runs produced (`agreement`):
    `identical_so_far` marks a match where a run was cut short, `compared_tokens` counts the tokens compared.
    The baseline is the first run (`ar`, or `fit_baseline`'s); `speed_vs_ar` and `identical_to_ar` are against it.
    With `costs` (studio.traces.projection.DeviceCosts) each row also has `projected_vs_ar`: its forwards priced on
    that device against the baseline's, a projection."""
    from studio.traces import projection
    base = next(iter(results.values()))
    refs = references(results)
    base_projected = None if costs is None else projection.project(base.events, costs)
    out = []
    for label, r in results.items():
        f = r.footer
        verified = any(e["t"] in ("accept", "reject") for e in r.events)
        to_ar = agreement(base, r)
        ref = results.get(refs[label])
        to_ref = None if ref is None else agreement(ref, r)
        out.append({"label": label, "strategy": r.header["strategy"], "params": r.header["params"],
                    "n_tokens": f["n_tokens"], "token_ids": list(r.token_ids), "forwards": f["forwards"],
                    "tpf": f["tpf"],
                    "accept_rate": f["accept_rate"] if verified else None, "tok_s": f["tok_s"],
                    "speed_vs_ar": f["tok_s"] / base.footer["tok_s"] if base.footer["tok_s"] else None,
                    "identical_to_ar": to_ar.difference is None, "first_difference": to_ar.difference,
                    "reference": refs[label],
                    "identical_to_reference": None if to_ref is None else to_ref.difference is None,
                    "reference_first_difference": None if to_ref is None else to_ref.difference,
                    "identical_so_far": None if to_ref is None else to_ref.so_far,
                    "compared_tokens": None if to_ref is None else to_ref.compared,
                    "stop_reason": f["stop_reason"], "text": f["text"]})
        if costs is not None:
            out[-1]["projected_vs_ar"] = projection.project(r.events, costs).vs(base_projected)
    return out


def same_as(row: dict) -> str:
    """The table's last column: whether the output is identical to the row's reference, which it names
    ("yes so far" when a run was cut short before the other ended)."""
    ref, same = row["reference"], row["identical_to_reference"]
    if same is None:
        return f"— ({ref} did not run)"
    if not same:
        return f"no at token {row['reference_first_difference']} ({ref})"
    return f"yes so far ({ref}, {row['compared_tokens']} tokens)" if row["identical_so_far"] else f"yes ({ref})"


def settings_text(header: dict) -> str:
    """The generation settings a run used, from its trace header: `temperature 0 · top-k 0 · top-p 1 · seed 0
    · max tokens 16`."""
    p = header["params"]
    return (f"temperature {p['temperature']:g} · top-k {p['top_k']} · top-p {p['top_p']:g} · seed {header['seed']}"
            f" · max tokens {p['max_new_tokens']}")


def render_table(table_rows: list[dict], sampled: bool, costs=None, model: str | None = None):
    """The comparison as a Rich table, titled with the model it ran on (`Engine.title`: an int8 one says so);
    with `costs` (the DeviceCosts `rows` projected with) a projected column and the table's origin in the
    caption."""
    from rich.markup import escape
    from rich.table import Table
    from studio.traces import projection
    t = Table(title="compare" + (f" on {escape(model)}" if model else ""), title_justify="left")
    label_width = max([len(r["label"]) for r in table_rows] + [8])
    projected = [] if costs is None else [projection.label(costs)]
    for col in ("strategy", "tokens", "forwards", "TPF", "accept", "tok/s", "× ar", *projected, "same as"):
        # labels are never cut (a narrow terminal wraps "same as" instead)
        extra = {"no_wrap": True, "min_width": label_width} if col == "strategy" else {}
        t.add_column(col, justify="left" if col in ("strategy", "same as") else "right", **extra)
    for r in table_rows:
        acc = "—" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
        speed = _times(r["speed_vs_ar"])
        cells = [] if costs is None else [_times(r["projected_vs_ar"])]
        t.add_row(r["label"], str(r["n_tokens"]), str(r["forwards"]), f"{r['tpf']:.2f}", acc,
                  f"{r['tok_s']:.1f}", speed, *cells, same_as(r))
    captions = []
    if sampled:
        captions.append("sampled runs: lossless strategies match their reference in distribution, not token for token")
    if costs is not None:
        captions.append(projection.caption(costs.name, costs.origin))
    t.caption = "\n".join(captions) or None
    return t


def _times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def make_runs(engine, prompt: str, prompt_ids: list[int], configs: Mapping[str, RunConfig], *, trace_dir=None,
              trace_prefix: str = "", on_built: Callable[[list], None] | None = None, most: int | None = None,
              force: bool = True) -> dict[str, Run]:
    """The runs of a comparison, in lock-step order: every config (the first is the `ar` baseline, or the model's own
    `fit_baseline`), each run's exact reference after it (`with_references`) and, before the first run that needs
    it, each `ar` reference run (see the module doc). `on_built(strategies)` sees the built strategies first (SimSD's
    drafter). BadInput, before any trace file is opened, for more than `most` runs (references included), a run that
    does not fit the model, or (without `force`) a trace file that exists. Traces go to
    `trace_dir/{trace_prefix}{label}.jsonl`."""
    configs = fit_baseline(engine, configs)
    ar_mode = next(iter(configs)) == "ar"
    configs, exact = with_references(configs)
    built = {label: config.build() for label, config in configs.items()}
    if on_built:
        on_built([strategy for strategy, _ in built.values()])

    def view(config: RunConfig, strategy):
        """The engine a run decodes with: the config's own adapter, else the engine's choice for the strategy."""
        if config.adapter is not None:
            from studio.presets.shipped import adapter_path
            return engine.with_adapter(None if config.adapter == "none" else adapter_path(config.adapter))
        return engine.for_strategy(strategy.name)

    engines = {label: view(configs[label], strategy) for label, (strategy, _) in built.items()}
    planned: dict[str, tuple[RunConfig, tuple]] = {}
    with_ar = set()   # the models an ar run decodes so far (None: the base model)
    for label, config in configs.items():
        strategy, settings = built[label]
        model = decoded_model(engines[label], strategy)
        causal = engines[label].config.attention == "causal"   # not a model an adapter made bidirectional
        if ar_mode and causal and strategy.name != "ar" and model not in with_ar and label not in exact:
            reference = dataclasses.replace(configs["ar"], adapter=model or "none")
            planned[reference_label(model)] = reference, reference.build()
        with_ar.add(model)
        planned[label] = config, (strategy, settings)
    if most is not None and len(planned) > most:
        raise BadInput(f"compare shows at most {most} runs (ar and references included): {', '.join(planned)}")
    for label, (strategy, settings) in built.items():
        kv_length_needed(engines[label], strategy, settings, prompt_ids)
    if trace_dir and not force:
        from studio.files import check_writable
        for path in trace_paths(trace_dir, planned, trace_prefix).values():
            check_writable(path, force)
    return {label: Run(prepare(engine, strategy, view=view(config, strategy)), settings, prompt, prompt_ids,
                       trace_path=str(trace_path(trace_dir, label, trace_prefix)) if trace_dir else None,
                       reference=exact.get(label))
            for label, (config, (strategy, settings)) in planned.items()}


def run_compare(engine, prompt: str, prompt_ids: list[int], configs: Mapping[str, RunConfig], *, trace_dir=None,
                progress=None, trace_prefix: str = "", on_done=None, on_built=None, force: bool = True
                ) -> dict[str, RunResult]:
    """`make_runs`, driven to the end in lock-step by forward count (`session.drive`). `progress(label, event)`
    for every event; `on_done(label, result)` as each run ends."""
    runs = make_runs(engine, prompt, prompt_ids, configs, trace_dir=trace_dir, trace_prefix=trace_prefix,
                     on_built=on_built, force=force)
    labels = list(runs)

    def publish(i: int, events: list[dict]) -> None:
        for e in events if progress else ():
            progress(labels[i], e)
        if on_done and runs[labels[i]].done:
            on_done(labels[i], runs[labels[i]].result)
    drive(list(runs.values()), publish)
    return {label: run.result for label, run in runs.items()}


def trace_path(trace_dir, label: str, prefix: str = "") -> Path:
    """`trace_dir/PREFIXLABEL.jsonl`, the name made safe (`studio.files.safe_name`): a label from a preset
    or a trace is never a path, so a trace is never written outside `trace_dir`."""
    from studio.files import safe_name
    return Path(trace_dir) / (safe_name(f"{prefix}{label}") + ".jsonl")


def trace_paths(trace_dir, labels, prefix: str = "") -> dict[str, Path]:
    """`trace_path` of every label; BadInput when two labels would share a file."""
    paths = {label: trace_path(trace_dir, label, prefix) for label in labels}
    seen: dict[Path, str] = {}
    for label, path in paths.items():
        if path in seen:
            raise BadInput(f"runs {seen[path]!r} and {label!r} would both write {path}: rename one")
        seen[path] = label
    return paths


def as_trace(result: RunResult):
    """A finished run as a `studio.events.Trace` (what every exporter and figure consumes)."""
    from studio.events import Trace
    return Trace(header=result.header, events=result.events, footer=result.footer)


def write_html(results: dict[str, RunResult], path, title: str, trace_dir=None, trace_prefix: str = "") -> Path:
    """The self-contained HTML report of a comparison, runs labelled as in the table. With `trace_dir` (where
    `run_compare` wrote the traces) the report is built from the trace files, so it shows their run ids."""
    from studio.events import read_trace
    from studio.traces.export import html_report
    traces = [read_trace(trace_path(trace_dir, label, trace_prefix)) if trace_dir else as_trace(r)
              for label, r in results.items()]
    return html_report(traces, path, title=title, labels=list(results))


@contextmanager
def progress_display(totals: dict[str, int], console=None, enabled: bool = True):
    """One Rich progress bar per run on stderr (advanced by emit events); yields `progress(label, event)`
    for `run_compare`. When stderr is not a terminal the bars are off and nothing is drawn. A run that `run_compare`
    adds (a reference, the model's own baseline) gets its bar at its first event, with the first run's total."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    console = console or Console(stderr=True)
    with Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=console, transient=True,
                  disable=not enabled or not console.is_terminal) as bar:
        tasks = {label: bar.add_task(label, total=total, info="") for label, total in totals.items()}

        def progress(label: str, e: dict) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=next(iter(totals.values()), None), info="")
            if e["t"] == "emit":
                bar.advance(tasks[label], len(e["tok"]))
            elif e["t"] == "forward" and e["role"] != "prefill":
                bar.update(tasks[label], info=f"forward {e['step']}")
        yield progress

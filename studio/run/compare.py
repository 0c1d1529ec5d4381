"""Side-by-side comparison: several strategies on one prompt, seed and sampling setting, in one process.

`ar` always runs (first) as the baseline that speed is measured against. Each run's output is compared with
its reference: the `ar` run of the model it decodes (`Run.model_adapter`). That is the `ar` row for runs on the
base model (no adapter, a MASK-row adapter, r-isd), and an extra `ar` run on the adapter for a run that decodes
an adapter of every row (isd on smollm2-isd: `ar · smollm2-isd`), which `run_compare` adds.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from studio.engine.strategies import STRATEGIES
from studio.errors import BadInput
from studio.run.session import Run, RunResult, drive, kv_length_needed


@dataclass
class RunSpec:
    label: str          # what the user asked for (a strategy or preset name)
    strategy: str | None
    preset: str | None
    adapter: str | None = None   # this run's adapter directory ("none": the base model); None: the engine's choice


def parse_specs(items: str, preset: str | None = None) -> list[RunSpec]:
    """`ar,isd,isd-n4` -> specs; an item is a strategy name or a strategy preset name. `ar` is added first."""
    from studio.presets import list_presets
    presets = set(list_presets("strategies"))
    specs = []
    for item in [s.strip() for s in items.split(",") if s.strip()] + ([preset] if preset else []):
        if item in STRATEGIES:
            specs.append(RunSpec(item, item, None))
        elif item in presets or item.endswith(".toml"):
            specs.append(RunSpec(Path(item).stem, None, item))
        else:
            raise BadInput(f"unknown strategy or preset {item!r} (strategies: {', '.join(STRATEGIES)}; "
                           f"presets: {', '.join(sorted(presets))})")
    # ar runs first, always: it is the baseline every later run is measured against
    if not any(s.strategy == "ar" for s in specs):
        specs.insert(0, RunSpec("ar", "ar", None))
    specs.sort(key=lambda s: s.strategy != "ar")  # stable: ar first, the rest in the order given
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise BadInput(f"a strategy is listed twice: {','.join(labels)}")
    return specs


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_label(model_adapter: str | None) -> str:
    """The label of the `ar` run on `model_adapter`'s model (None: the base model), when it is not the `ar` row."""
    return f"ar · {Path(model_adapter).name}" if model_adapter else "ar · base"


def references(results: dict[str, RunResult]) -> dict[str, str]:
    """label -> the label of its reference: the first `ar` run that decodes the same model. A reference that did
    not run (a front end that runs only the specs) is named all the same."""
    ar_on: dict[str | None, str] = {}
    for label, r in results.items():
        if r.header["strategy"] == "ar":
            ar_on.setdefault(r.model_adapter, label)
    return {label: ar_on.get(r.model_adapter) or reference_label(r.model_adapter) for label, r in results.items()}


def rows(results: dict[str, RunResult]) -> list[dict]:
    """One row per run: the numbers the table, --json and reports show (all from footers/events). Speed and
    `identical_to_ar` are against the `ar` row; `identical_to_reference` against the row's reference (None
    when it did not run)."""
    base = results["ar"]
    refs = references(results)
    out = []
    for label, r in results.items():
        f = r.footer
        verified = any(e["t"] in ("accept", "reject") for e in r.events)
        ref = results.get(refs[label])
        k = None if ref is None else first_difference(ref.token_ids, r.token_ids)
        out.append({"label": label, "strategy": r.header["strategy"], "params": r.header["params"],
                    "n_tokens": f["n_tokens"], "token_ids": list(r.token_ids), "forwards": f["forwards"],
                    "tpf": f["tpf"],
                    "accept_rate": f["accept_rate"] if verified else None, "tok_s": f["tok_s"],
                    "speed_vs_ar": f["tok_s"] / base.footer["tok_s"] if base.footer["tok_s"] else None,
                    "identical_to_ar": first_difference(base.token_ids, r.token_ids) is None,
                    "first_difference": first_difference(base.token_ids, r.token_ids),
                    "reference": refs[label], "identical_to_reference": None if ref is None else k is None,
                    "reference_first_difference": k,
                    "stop_reason": f["stop_reason"], "text": f["text"]})
    return out


def same_as(row: dict) -> str:
    """The table's last column: whether the output is identical to the row's reference, which it names."""
    ref, same = row["reference"], row["identical_to_reference"]
    if same is None:
        return f"— ({ref} did not run)"
    return f"yes ({ref})" if same else f"no at token {row['reference_first_difference']} ({ref})"


def render_table(table_rows: list[dict], sampled: bool):
    from rich.table import Table
    t = Table(title="compare", title_justify="left")
    label_width = max([len(r["label"]) for r in table_rows] + [8])
    for col in ("strategy", "tokens", "forwards", "TPF", "accept", "tok/s", "× ar", "same as"):
        # labels are never cut (a narrow terminal wraps "same as" instead)
        extra = {"no_wrap": True, "min_width": label_width} if col == "strategy" else {}
        t.add_column(col, justify="left" if col in ("strategy", "same as") else "right", **extra)
    for r in table_rows:
        acc = "—" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
        speed = "—" if r["speed_vs_ar"] is None else f"{r['speed_vs_ar']:.2f}×"
        t.add_row(r["label"], str(r["n_tokens"]), str(r["forwards"]), f"{r['tpf']:.2f}", acc,
                  f"{r['tok_s']:.1f}", speed, same_as(r))
    if sampled:
        t.caption = "sampled runs: lossless strategies match their reference in distribution, not token for token"
    return t


def run_compare(engine, prompt: str, prompt_ids: list[int], specs: list[RunSpec], make_run, trace_dir=None,
                progress=None, *, trace_prefix: str = "", on_done=None) -> dict[str, RunResult]:
    """Run every spec on the prompt in lock-step by forward count (`session.drive`), each reference run that
    the specs' runs need (see the module doc) placed before the first run that needs it. The first spec is
    `ar` (`parse_specs`); a reference run has its strategy and settings. `make_run(spec) -> (Strategy,
    Settings)`; `progress(label, event)` for every event; `on_done(label, result)` as each run ends. Traces go
    to `trace_dir/{trace_prefix}{label}.jsonl`."""
    made = [make_run(spec) for spec in specs]
    for strategy, settings in made:   # every run fits before any trace file is opened
        kv_length_needed(engine, strategy, settings, prompt_ids)

    def start(spec: RunSpec, strategy, settings) -> Run:
        view = engine if spec.adapter is None else engine.with_adapter(None if spec.adapter == "none" else spec.adapter)
        return Run(view, strategy, settings, prompt, prompt_ids,
                   trace_path=str(trace_path(trace_dir, spec.label, trace_prefix)) if trace_dir else None)
    labels, runs = [], []
    with_ar = set()   # the models an ar run decodes so far
    for spec, (strategy, settings) in zip(specs, made):
        run = start(spec, strategy, settings)
        model = run.model_adapter
        if strategy.name != "ar" and model not in with_ar:
            ref = RunSpec(reference_label(model), "ar", None, adapter=model or "none")
            labels.append(ref.label)
            runs.append(start(ref, copy.deepcopy(made[0][0]), made[0][1]))   # nothing has run yet: a fresh ar
        with_ar.add(model)
        labels.append(spec.label)
        runs.append(run)

    def publish(i: int, events: list[dict]) -> None:
        for e in events if progress else ():
            progress(labels[i], e)
        if on_done and runs[i].done:
            on_done(labels[i], runs[i].result)
    drive(runs, publish)
    return {label: run.result for label, run in zip(labels, runs)}


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
    for `run_compare`. When stderr is not a terminal the bars are off and nothing is drawn. A reference run
    that `run_compare` adds gets its bar at its first event, with the `ar` run's total (its settings)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    console = console or Console(stderr=True)
    with Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=console, transient=True,
                  disable=not enabled or not console.is_terminal) as bar:
        tasks = {label: bar.add_task(label, total=total, info="") for label, total in totals.items()}

        def progress(label: str, e: dict) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=totals.get("ar"), info="")
            if e["t"] == "emit":
                bar.advance(tasks[label], len(e["tok"]))
            elif e["t"] == "forward" and e["role"] != "prefill":
                bar.update(tasks[label], info=f"forward {e['step']}")
        yield progress

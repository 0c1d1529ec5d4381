"""`make run` / `dlm-studio demo`: the compare demo on the embedded default model.

One prompt through every strategy in the registry (a strategy's CPU-sized preset `NAME-cpu` when one
exists, e.g. `jacobi-mr-cpu`), greedy, one process, `ar` first as the baseline (and `ar` on the adapter of a
run that decodes an adapter of every row, its reference): the compare table, one trace per run and the HTML
report, with every path printed at the end. It is `dlm-studio compare`
with demo defaults, built from the same pieces (`studio.run.compare`).

A strategy that cannot decode the AR model itself (`canvas`) runs where an adapter is shipped for it on the
model (smollm2-mdm makes the embedded model a bidirectional masked-diffusion model): it decodes that other model,
on which no `ar` reference runs (`studio.run.compare`), so a cached canvas run is shown against its cache=none twin
and the twin against `ar` on the base model, labelled so.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from studio.engine.strategies import STRATEGIES
from studio.run.compare import compare_configs, progress_display, render_table, rows, run_compare, trace_path, \
    write_html
from studio.run.config import RunConfig
from studio.traces import projection

# a prompt long enough for 64 greedy tokens, whose repetitive structure lets parallel decoding show: r-isd (shipped
# adapter) reaches TPF ~2.2 on it, jacobi-mr-cpu ~1.9
DEMO_PROMPT = "Write a numbered list from 1 to 20."
TRACE_PREFIX = "demo-"
REPORT_NAME = "demo-report.html"


FIXED = " · fixed"
PAPERS_LAYOUT = {"drafting": "fixed", "lookup": 0}   # the strategy's own drafts every step, none copied
COSTS = "h200"       # the device table the demo projects its runs onto


def demo_configs(strategies: str | None, max_new_tokens: int, model: str = "default") -> dict[str, RunConfig]:
    """The demo's runs, greedy, seed 0: `None` or `all` is every registered strategy that decodes `model` (the
    embedded AR model, or what an adapter shipped for a strategy on it makes of it: canvas with smollm2-mdm), in
    registry order (ar first), a strategy's `NAME-cpu` preset in its place where one exists; otherwise a comma
    list as for compare. Every run that drafts cost-aware (`drafting = auto`) is followed by its twin in the
    papers' layout, `LABEL · fixed` (`PAPERS_LAYOUT`): what the algorithm does, beside what it buys here."""
    from studio.presets import list_presets
    from studio.presets.shipped import shipped_for
    if strategies is None or strategies.strip() in ("", "all"):
        presets = set(list_presets("strategies"))
        strategies = ",".join(f"{name}-cpu" if f"{name}-cpu" in presets else name
                              for name, cls in STRATEGIES.items()
                              if (cls.decodes_ar_models or shipped_for(model, name)) and cls.ready_for(model))
    out: dict[str, RunConfig] = {}
    for label, config in compare_configs(strategies, RunConfig(temperature=0.0, max_new_tokens=max_new_tokens)).items():
        out[label] = config
        params = config.build()[0].params
        if getattr(params, "drafting", None) == "auto":   # the layout's parameters the strategy has
            layout = {k: v for k, v in PAPERS_LAYOUT.items() if hasattr(params, k)}
            out[label + FIXED] = dataclasses.replace(config, params={**config.params, **layout})
    return out


def run_demo(engine, prompt: str = DEMO_PROMPT, strategies: str | None = None, max_new_tokens: int = 64,
             trace_dir: Path = Path("traces"), html: bool = True, console=None, err_console=None) -> dict:
    """Runs the demo on `engine` (greedy, seed 0) and prints it; returns {results, rows, traces, report}."""
    from rich.console import Console

    from studio.run.session import encode_prompt

    if console is None:  # piped: 80 columns would cut the table's labels; a terminal keeps its own width
        console = Console()
        console = console if console.is_terminal else Console(width=120)
    err = err_console or Console(stderr=True)
    configs = demo_configs(strategies, max_new_tokens, engine.name)
    ids = encode_prompt(engine, prompt)
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    say = lambda text: err.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    say(f"model: {engine.name} ({engine.config.arch}, {engine.source}; loaded in {engine.load_s:.1f}s"
        f"{' from cache' if engine.from_cache else ''})")
    say(f"runs:  {', '.join(configs)}  (greedy, seed 0, up to {max_new_tokens} new tokens; and ar on the model of "
        "each run that decodes an adapter of every row, its reference, unless that model is bidirectional; a cached "
        "canvas run beside its cache=none twin)")
    console.print(f"prompt: {prompt}\n", highlight=False, markup=False)

    def done(label, r) -> None:
        if not err.is_terminal:  # the progress bars are off: say something per run instead
            f = r.footer
            say(f"[{label}] {f['n_tokens']} tokens, {f['forwards']} forwards, {f['wall_s']:.2f}s")

    with progress_display({label: max_new_tokens for label in configs}, err) as progress:
        results = run_compare(engine, prompt, ids, configs, trace_dir=trace_dir, progress=progress,
                              trace_prefix=TRACE_PREFIX, on_done=done)
    costs = projection.load(COSTS)
    table = rows(results, costs)
    shown = render_table(table, sampled=False, costs=costs)
    if any(label.endswith(FIXED) for label in results):
        shown.caption = (f"LABEL: cost-aware drafting, what the strategy buys on this machine; LABEL{FIXED}: the "
                         "papers' layout (drafting=fixed, lookup=0), what the algorithm does\n" + shown.caption)
    console.print(shown)
    text = {r["label"]: r["text"].strip() for r in table}
    for r in table:   # each distinct output once, with the runs identical to it
        if r["identical_to_reference"] and r["reference"] != r["label"]:
            continue   # shown with its reference
        same = [x["label"] for x in table if x is not r and x["reference"] == r["label"] and x["identical_to_reference"]]
        console.print(f"── {', '.join([r['label'], *same])} ({_origin(r, results[r['label']], same)}):\n"
                      f"{text[r['label']]}", highlight=False, markup=False)
    traces = [trace_path(trace_dir, label, TRACE_PREFIX) for label in results]
    report = None
    if html:
        report = write_html(results, trace_dir / REPORT_NAME, f"dlm-studio demo: {prompt[:60]}", trace_dir,
                            TRACE_PREFIX)
    console.print("\ntraces:", highlight=False)
    for p in traces:
        console.print(f"  {p}", highlight=False, markup=False)
    if report:
        console.print(f"report: {report}", highlight=False, markup=False)
    return {"results": results, "rows": table, "traces": traces, "report": report}


def _origin(row: dict, result, same: list[str]) -> str:
    """What a shown output is: a reference (with its equals), a run that differs from its reference (from which
    token), or a run on a model an adapter made bidirectional, on which no ar reference runs (against ar on the
    base model instead)."""
    identical = ["identical output"] if same else []
    if row["identical_to_reference"] is None:
        model = result.header["model"]
        name = model.get("adapter_name") or Path(model["adapter"] or model["name"]).name
        k = row["first_difference"]
        to_ar = "identical to ar on the base model" if k is None else f"differs from ar on the base model at token {k}"
        return "; ".join([f"decodes {name}, bidirectional: no ar run on it", to_ar, *identical])
    if row["reference"] == row["label"]:
        return "; ".join(identical or ["reference"])
    return "; ".join([f"differs from {row['reference']} at token {row['reference_first_difference']}", *identical])


def demo_command(prompt: str, strategies: str | None, max_new_tokens: int, trace_dir: Path, html: bool = True,
                 device: str = "auto", dtype: str = "auto", graphs: bool = True) -> None:
    """The body of `dlm-studio demo`: validate every run before loading the embedded model, then run."""
    from studio.engine.engine import Engine

    for config in demo_configs(strategies, max_new_tokens).values():   # every run valid before the model loads
        config.build()
    engine = Engine.load("default", device=device, dtype=dtype, graphs=graphs)
    out = run_demo(engine, prompt, strategies, max_new_tokens, trace_dir, html)
    typer.echo(f"replay a run in the terminal: dlm-studio trace replay {out['traces'][-1]} --speed 2", err=True)

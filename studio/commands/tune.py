"""`dlm-studio tune`: its options, checks and output (the search is studio.evaluation.tune's)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from studio.errors import BadInput
from studio.files import check_writable
from studio.run.config import ModelChoice, RunConfig
from studio.run.options import FORCE, generation_options


@generation_options(exclude=("draft_model", "draft_adapter", "param", "raw", "preset"))
def tune(
    strategy: str = typer.Option(..., "--strategy", "-s", help="The strategy or strategy preset to tune (a "
                                 "preset's parameters are the starting point; the searched ones replace them)."),
    task: Optional[str] = typer.Option(None, "--task", help="A question set (quick, or a JSONL file): quality "
                                       "is its accuracy."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="One prompt per line: quality is the share of "
                                           "outputs identical to ar's."),
    objective: str = typer.Option("tok_s", "--objective", help="tok_s: the median × ar over the prompts (this "
                                  "machine) | tpf: tokens per forward (any machine)."),
    min_accuracy: Optional[float] = typer.Option(None, "--min-accuracy", help="With --task: the chosen point's "
                                                 "least accuracy (a share in [0, 1])."),
    min_agreement: Optional[float] = typer.Option(None, "--min-agreement", help="With --prompts: the least share "
                                                  "of outputs identical to ar's (default 1.0: exact points only)."),
    trials: int = typer.Option(12, "--trials", help="Trials in all (those already in --storage count)."),
    storage: Optional[Path] = typer.Option(None, "--storage", help="The SQLite file the trials live in (default: "
                                           "OUT with .db): a second call goes on where the first stopped."),
    out: Path = typer.Option(..., "--out", help="The strategy preset (.toml) to write; the Pareto figure goes "
                             "beside it (.html)."),
    force: bool = FORCE,
    *, model: ModelChoice, config: RunConfig,
):
    """Search a strategy's parameters for speed against accuracy (or agreement with ar) with Optuna; write the
    fastest point that meets the constraint as a preset, and the Pareto front. --seed seeds the sampler."""
    from studio.evaluation import tune as search

    seed = config.seed
    if (task is None) == (prompts is None):
        raise BadInput("give --task or --prompts (one of them)")
    if task is not None and min_agreement is not None or prompts is not None and min_accuracy is not None:
        raise BadInput("--min-accuracy goes with --task, --min-agreement with --prompts")
    floor = min_accuracy if task is not None else (1.0 if min_agreement is None else min_agreement)
    if floor is None:
        floor = 0.0
    if not 0 <= floor <= 1:
        raise BadInput(f"the constraint is a share in [0, 1], got {floor:g}")
    if trials < 1:
        raise BadInput("--trials must be >= 1")
    if out.suffix != ".toml":
        raise BadInput(f"--out is a strategy preset: a .toml file, got {out}")
    check_writable(out, force)
    from studio.run.bench import bench_length
    base = config.use(strategy)
    base = dataclasses.replace(base, max_new_tokens=bench_length(base, task is not None))   # each trial a bench
    search.space(base)                       # something to tune, before the model loads
    storage = storage or out.with_suffix(".db")
    texts, score, data = _data(task, prompts)
    engine = model.load()
    with _bar(trials) as progress:
        points = search.run(engine, base, texts, score, objective, trials, storage, seed, progress)
    chosen = search.choose(points, floor)
    quality = "accuracy" if task else "agreement with ar"
    speed = "× ar" if objective == "tok_s" else "TPF"        # the objective, by what it measures
    ar_quality = _median([p.ar_quality for p in points if p.ar_quality is not None])
    against = f" (ar's: {ar_quality:.2f})" if ar_quality is not None else ""
    how = (f"{base.label} tuned by dlm-studio tune on {data} ({engine.name}, {search.machine()}, {search.today()}): "
           f"the fastest of {len(points)} trials by {speed} with {quality} >= {floor:g}: {speed} "
           f"{chosen.speed:.2f}, {quality} {chosen.quality:.2f}{against} (trial {chosen.number}, seed {seed})")
    search.write_preset(out, base, chosen, how)
    figure = _figure(points, chosen, objective, quality, base.label, out.with_suffix(".html"))
    front = {p.number for p in search.pareto(points)}
    typer.echo(f"{'trial':>5} {'× ar':>6} {'TPF':>5} {quality:>18} {'= ar':>5}  parameters")
    for p in sorted(points, key=lambda p: -p.speed):
        mark = "*" if p.number == chosen.number else ("+" if p.number in front else " ")
        params = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in p.params.items())
        typer.echo(f"{p.number:>4}{mark} {p.speedup:>6.2f} {p.tpf:>5.2f} {p.quality:>18.2f} "
                   f"{p.agreement:>5.0%}  {params}")
    typer.echo(f"(sorted by the objective, {speed}; * chosen, + on the Pareto front; = ar: outputs identical to "
               "ar's)")
    if ar_quality is not None:
        typer.echo(f"ar's accuracy: {ar_quality:.2f}")
    typer.echo(f"preset: {out}\nfigure: {figure}\ntrials: {storage}")
    if task and min_accuracy is None and ar_quality is not None and chosen.quality < ar_quality:
        typer.echo(f"note: no --min-accuracy, so the fastest trial was chosen at accuracy {chosen.quality:.2f} "
                   f"against ar's {ar_quality:.2f}; rerun with --min-accuracy A --force to choose under a floor "
                   "(the trials stay in the storage: no new ones run)", err=True)
    for p in search.departures(base, points):
        typer.echo(f"warning: {base.label} is lossless, but trial {p.number} gave ar's output on only "
                   f"{p.agreement:.0%} of the prompts: beyond a near-tie of float reduction order this is a bug "
                   "(check it with `dlm-studio compare`)", err=True)


def _median(values: list[float]) -> float | None:
    import statistics
    return statistics.median(values) if values else None


def _data(task: str | None, prompts: Path | None):
    if task is not None:
        from studio.evaluation.questions import load_task, score
        name, questions = load_task(task)
        return [q.prompt for q in questions], lambda report: score(report, name, questions), f"task {name}"
    from studio.run.bench import load_prompts
    texts = load_prompts(prompts)
    return texts, None, f"{len(texts)} prompts of {prompts.name}"


def _figure(points, chosen, objective: str, quality: str, label: str, path: Path) -> Path:
    import plotly.io as pio
    from studio.evaluation.tune import pareto
    from studio.files import atomic_write
    from studio.viz.figures import pareto_figure

    front = {p.number for p in pareto(points)}
    fig = pareto_figure([{"number": p.number, "params": p.params, "speed": p.speed, "quality": p.quality,
                          "front": p.number in front} for p in points], chosen.number,
                        f"dlm-studio tune: {label}", "× ar (median over the prompts)" if objective == "tok_s"
                        else "tokens per forward (median)", quality)
    with atomic_write(path) as f:
        f.write(pio.to_html(fig, full_html=True, include_plotlyjs=True, config={"displaylogo": False}))
    return path


def _bar(total: int):
    from contextlib import contextmanager

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextmanager
    def shown():
        err = Console(stderr=True)
        with Progress(TextColumn("tune"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                      disable=not err.is_terminal) as bar:
            task = bar.add_task("tune", total=total)

            def progress(done: int, n: int) -> None:
                bar.update(task, completed=done)
                if not err.is_terminal:
                    typer.echo(f"tune: trial {done}/{n}", err=True)
            yield progress
    return shown()

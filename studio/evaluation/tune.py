"""`dlm-studio tune`: a strategy's parameters searched for speed against quality with Optuna, written as a preset.

The search space is what the strategy's `Params` fields declare with `param(..., tune=...)`: a (low, high) range
for a number, every choice for a text field. Each trial is a bench (studio.run.bench.run_bench: the strategy
beside `ar`, in lock-step, one repeat) on the prompts or a task's questions, scored twice: speed (`tok_s`: the
median × ar over the prompts, or `tpf`) and quality (a task's accuracy, else the share of outputs identical to
ar's). Optuna's multi-objective TPE sampler is seeded and every trial lives in the SQLite storage, so a second
call with the same storage goes on where the first stopped. The chosen point is the fastest trial whose quality
meets the constraint (`--min-accuracy`, `--min-agreement`; by default agreement 1.0: only exact points).

Every trial also records its agreement with ar. A lossless strategy (`Strategy.lossless`: ar, isd and r-isd at
tau 0 in exact mode, jacobi, jacobi-mr) is tuned for speed alone, its exactness asserted: `departures` names
each of its trials whose outputs were not all ar's, which only a near-tie of float reduction order may explain.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from studio.engine.strategies.params import param_specs
from studio.errors import BadInput
from studio.run.bench import run_bench
from studio.run.config import RunConfig

OBJECTIVES = ("tok_s", "tpf")


@dataclass(frozen=True)
class Point:
    """One finished trial: its parameters, speed (the objective), quality, and the numbers behind them."""
    number: int
    params: dict
    speed: float
    quality: float
    tpf: float
    speedup: float
    agreement: float    # the share of outputs identical to ar's
    ar_quality: float | None = None   # ar's own accuracy in the trial (None: --prompts, or an older storage)


def space(config: RunConfig) -> list:
    """The `ParamSpec`s of the config's strategy that declare a search range or choices."""
    strategy, _ = config.build()
    found = [s for s in param_specs(type(strategy.params)) if s.tune is not None]
    if not found:
        raise BadInput(f"{config.label}: no parameter of {strategy.name} declares a search range (nothing to tune)")
    return found


def _suggest(trial, spec):
    if spec.tune is True:
        return trial.suggest_categorical(spec.name, list(spec.choices))
    if isinstance(spec.tune, list):
        return trial.suggest_categorical(spec.name, spec.tune)
    low, high = spec.tune
    if spec.kind is int:
        return trial.suggest_int(spec.name, int(low), int(high))
    return trial.suggest_float(spec.name, float(low), float(high))


def run(engine, base: RunConfig, texts: list[str], score: Callable[[dict], dict] | None, objective: str,
        n_trials: int, storage: Path, seed: int = 0, progress: Callable[[int, int], None] | None = None) -> list[Point]:
    """Trials up to `n_trials` in `storage` (those already there count); returns every finished one. `score`
    adds `accuracy` to a bench report (a task), else quality is agreement with ar."""
    import optuna

    if objective not in OBJECTIVES:
        raise BadInput(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    specs = space(base)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=f"dlm-studio:{base.label}:{objective}", storage=f"sqlite:///{storage}",
                                directions=["maximize", "maximize"], load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=4))
    ar = base.use("ar")

    def one(trial) -> tuple[float, float]:
        params = {s.name: _suggest(trial, s) for s in specs}
        config = dataclasses.replace(base, params={**base.params, **params})
        report = run_bench(engine, texts, {"ar": ar, "trial": config}, repeats=1, warmup=0, with_transformers=False)
        if score is not None:
            report = score(report)
        row = report["strategies"][1]
        quality = row["accuracy"] if score is not None else row["exact_match_vs_ar"]
        if score is not None:
            trial.set_user_attr("ar_accuracy", report["strategies"][0]["accuracy"])
        trial.set_user_attr("tpf", row["tpf"]["median"])
        trial.set_user_attr("speedup", row["speedup_vs_ar"]["median"])
        trial.set_user_attr("agreement", row["exact_match_vs_ar"])
        speed = row["speedup_vs_ar"]["median"] if objective == "tok_s" else row["tpf"]["median"]
        return speed, quality

    done = sum(t.state.name == "COMPLETE" for t in study.trials)
    for k in range(done, n_trials):
        study.optimize(one, n_trials=1)
        if progress:
            progress(k + 1, n_trials)
    return [Point(t.number, dict(t.params), t.values[0], t.values[1], t.user_attrs["tpf"], t.user_attrs["speedup"],
                  t.user_attrs["agreement"], t.user_attrs.get("ar_accuracy"))
            for t in study.trials if t.state.name == "COMPLETE"]


def departures(base: RunConfig, points: list[Point]) -> list[Point]:
    """The trials of a lossless strategy whose outputs were not all ar's (none for a lossy one)."""
    strategy, _ = base.build()
    return [p for p in points if p.agreement < 1] if strategy.lossless() else []


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point beats on both speed and quality (ties kept), by speed."""
    front = [p for p in points if not any(q.speed >= p.speed and q.quality >= p.quality and
                                          (q.speed, q.quality) != (p.speed, p.quality) for q in points)]
    return sorted(front, key=lambda p: p.speed)


def choose(points: list[Point], min_quality: float) -> Point:
    ok = [p for p in points if p.quality >= min_quality]
    if not ok:
        best = max(p.quality for p in points)
        raise BadInput(f"no trial reached quality {min_quality:g} (the best: {best:.3f}): lower the constraint or "
                       "run more --trials")
    return max(ok, key=lambda p: (p.speed, p.quality))


def write_preset(path: Path, base: RunConfig, point: Point, how: str) -> None:
    """The chosen point as a strategy preset (strategy, params on top of the base preset's, greedy)."""
    strategy, settings = dataclasses.replace(base, params={**base.params, **point.params}).build()
    params = strategy.header_params()
    lines = [f"description = {json.dumps(how, ensure_ascii=False)}", f"strategy = {json.dumps(strategy.name)}", "",
             "[params]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in params.items() if isinstance(v, (int, float, str, bool))]
    lines += ["", "[sampling]", f"temperature = {settings.sampling.temperature!r}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def machine() -> str:
    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else (platform.processor() or "CPU")
    return f"{device}, {os.cpu_count()} cores, torch {torch.__version__}"


def today() -> str:
    return datetime.date.today().isoformat()

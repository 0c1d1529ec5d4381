"""`dlm-studio train …`: make self-distilled data, train adapters, evaluate them (docs/training.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from studio.run.options import DEVICE, DTYPE
from studio.files import Interrupted

train_app = typer.Typer(no_args_is_help=True, help="Convert an AR model into a parallel decoder: data, training, evaluation.")


def _progress():
    """A rich progress bar, a row per stage, with the fields the training commands report."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=Console(stderr=True))


class _Report:
    """Progress of a command's stages: a bar row per stage on a terminal; in a log (a redrawn bar is unreadable in
    a file), a line every `log_every` updates of a stage and at its end."""

    def __init__(self, bar):
        import time

        self.bar, self.tasks, self._clock = bar, {}, time.perf_counter
        self.t0 = self._clock()

    def elapsed(self) -> float:
        return self._clock() - self.t0

    def update(self, stage: str, done: int, total: int, info: str, log_every: int = 1) -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total, info="")
        self.bar.update(self.tasks[stage], completed=done, total=total, info=info)
        if not self.bar.console.is_terminal and (done % log_every == 0 or done == total):
            self.bar.console.print(f"{stage} {done}/{total} · {info} · {self.elapsed():.0f} s",
                                   highlight=False, markup=False)

    def step(self, r, total: int, info: str, stage: str = "train") -> None:
        """A trainer's step record `r`: its accuracy by offset and learning rate after the caller's `info`."""
        acc = " ".join(f"{a:.2f}" for a in r.accuracy[:4])
        self.update(stage, r.step, total, f"{info} · acc {acc} · lr {r.lr:.1e}", log_every=10)


@train_app.command("data")
def data_cmd(
    out: Path = typer.Option(..., "--out", help="The data directory to create (or continue with --resume)."),
    model: str = typer.Option("default", "--model"),
    n_prompts: int = typer.Option(2048, "--n-prompts", help="How many built-in training prompts."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="A file of prompts, one per line, instead."),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens"),
    batch_size: int = typer.Option(64, "--batch-size", help="Prompts decoded at once (one stationary batch)."),
    seed: int = typer.Option(0, "--seed", help="Which sample of the built-in prompts."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run in --out."),
    time_budget: Optional[str] = typer.Option(None, "--time-budget", help="Start no shard after this long "
                                              "(90s, 45m, 2h); --resume continues."),
    device: str = DEVICE,
    dtype: str = DTYPE,
):
    """The base model's own greedy answers (chat template applied), as token-id shards."""
    import time

    from studio.engine.engine import Engine
    from studio.errors import BadInput
    from studio.train import data, prompts as builtin

    if n_prompts < 1 or max_new_tokens < 1 or batch_size < 1:
        raise BadInput("--n-prompts, --max-new-tokens and --batch-size must be >= 1")
    if prompts is not None:
        texts, source = builtin.read_prompt_file(prompts), str(prompts)
        held = set(builtin.eval_prompts())
        overlap = [t for t in texts if t in held]
        if overlap:
            raise BadInput(f"{prompts} contains a held-out evaluation prompt: {overlap[0]!r}")
    else:
        texts, source = builtin.training_prompts(n_prompts, seed), f"builtin seed={seed}"
    budget = _parse_budget(time_budget)
    fresh = _check_data_out(out, resume)   # before the model loads (data.generate checks again)
    existed = out.exists()
    engine = Engine.load(model, device=device, dtype=dtype)
    t0 = time.perf_counter()
    with _progress() as bar:
        report = _Report(bar)

        def tick(done: int, total: int, n_tokens: int) -> None:
            report.update("data", done, total, f"{n_tokens} tokens · {n_tokens / max(1e-9, report.elapsed()):.0f} "
                          "tok/s", log_every=batch_size)

        try:
            m = data.generate(engine, texts, out, max_new_tokens, batch_size=batch_size, resume=resume,
                              progress=tick, meta={"prompts": source},
                              deadline=None if budget is None else t0 + budget)
        except KeyboardInterrupt:
            bar.stop()
            raise Interrupted(_data_kept(out, fresh, existed)) from None
    stopped = "" if sum(m["shard_sizes"]) == len(texts) else \
        f"; stopped by the time budget after {sum(m['shard_sizes'])}/{len(texts)} prompts (--resume continues)"
    typer.echo(f"{out}: {sum(m['shard_sizes'])} sequences, {m['n_tokens']} tokens "
               f"({m['n_answer_tokens']} answer tokens) in {len(m['shards'])} shards{stopped}")


def _check_data_out(out: Path, resume: bool) -> bool:
    """BadInput unless `out` can take this run's data; True when it starts fresh (no manifest yet)."""
    from studio.errors import BadInput
    from studio.train import data

    if (out / data.MANIFEST).exists():
        if not resume:
            raise BadInput(f"{out} already holds training data: use --resume to continue it, or another --out")
        return False
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"{out} exists and is not empty: choose a new --out")
    return True


def _data_kept(out: Path, fresh: bool, existed: bool) -> str:
    """What an interrupted `train data` kept (every shard the manifest lists is whole); a fresh run stopped
    before its manifest leaves nothing behind (the directory was empty or absent when it started)."""
    from studio.train import data

    if (out / data.MANIFEST).is_file():
        kept = data.read_manifest(out)["shard_sizes"]
        return f"{sum(kept)} sequences in {len(kept)} whole shards kept in {out}; continue with --resume"
    if fresh:
        for name in (data.PROMPTS, Path(data.MANIFEST).with_suffix(".tmp").name):
            (out / name).unlink(missing_ok=True)
        if not existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
    return f"stopped before the first shard: nothing kept in {out}"


def _check_train_out(out: Path, resume: bool) -> None:
    """The checks `trainer.train` makes on --out, made before the model loads."""
    from studio.errors import BadInput
    from studio.train.trainer import STATE_JSON

    if resume and not (out / STATE_JSON).is_file():
        raise BadInput(f"nothing to resume in {out} (no {STATE_JSON})")
    if not resume and (out / STATE_JSON).exists():
        raise BadInput(f"{out} already holds a training run: --resume to continue it, or another --out")


def _train_kept(out: Path) -> str:
    """What an interrupted training run left: the checkpoint the trainer saved on the way out, if any."""
    import json

    from studio.train.trainer import STATE_JSON

    try:
        step = json.loads((out / STATE_JSON).read_text(encoding="utf-8"))["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"stopped before the first checkpoint: nothing saved in {out}"
    return f"checkpoint saved in {out} (step {step}); continue with --resume"


def _parse_budget(text: Optional[str]) -> Optional[float]:
    """'90s', '45m', '2h' or plain seconds -> seconds."""
    from studio.errors import BadInput

    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600}
    num, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
    try:
        value = float(num) * unit
    except ValueError:
        raise BadInput(f"--time-budget: expected a duration like 90s, 45m or 2h, got {text!r}") from None
    if not value > 0:
        raise BadInput(f"--time-budget must be positive, got {text!r}")
    return value


def _run_training(kind: str, data_dir: Path, out: Path, model: str, gate: str, resume: bool,
                  time_budget: Optional[str], device: str, dtype: str, **settings) -> None:
    """Shared body of `train idlm`, `train block` and `train mdm`: load, train with a progress bar, summarise."""
    import time

    from studio.engine.engine import Engine
    from studio.errors import BadInput
    from studio.train import data
    from studio.train.objectives import CLEAN_LOSSES, IDLM, MASK_LOSSES, MDM, Block
    from studio.train.trainer import TrainConfig, train

    if gate not in ("mask", "all"):
        raise BadInput(f"--gate must be 'mask' or 'all', got {gate!r}")
    clean_loss = settings.get("clean_loss", "ce")
    if clean_loss not in CLEAN_LOSSES:
        raise BadInput(f"--clean-loss must be one of {', '.join(CLEAN_LOSSES)}, got {clean_loss!r}")
    if clean_loss != "ce" and gate != "all":
        raise BadInput("--clean-loss applies to --gate all (with --gate mask the clean rows are the base model's)")
    if settings.get("mask_loss", "ce") not in MASK_LOSSES:
        raise BadInput(f"--mask-loss must be one of {', '.join(MASK_LOSSES)}, got {settings['mask_loss']!r}")
    budget = _parse_budget(time_budget)
    cfg = TrainConfig(kind=kind, gate=gate, **settings)
    for name in ("steps", "batch_size", "rows_per_seq", "r", "save_every"):
        if getattr(cfg, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be >= 1")
    if not cfg.lr > 0 or not cfg.alpha > 0:
        raise BadInput("--lr and --alpha must be positive")
    if kind == "idlm" and not 2 <= cfg.start_stride <= cfg.stride:
        raise BadInput(f"the curriculum needs 2 <= --start-stride <= --stride, got {cfg.start_stride}..{cfg.stride}")
    if kind == "block" and cfg.block_size < 2:
        raise BadInput("--block-size must be >= 2")
    _check_train_out(out, resume)
    seqs = data.load_sequences(data_dir)
    engine = Engine.load(model, device=device, dtype=dtype)
    if cfg.mask_loss == "kl" and not engine.config.logit_shift:
        raise BadInput(f"--mask-loss kl reads the base model's next-token law: {engine.name} is position-aligned")
    mask_id = engine.model.lm_head.weight.shape[0]
    if kind == "idlm":
        objective = IDLM(mask_id, gate == "all", curriculum=tuple(range(cfg.start_stride, cfg.stride + 1)),
                         clean_loss=cfg.clean_loss, mask_loss=cfg.mask_loss)
    elif kind == "block":
        objective = Block(mask_id, gate == "all", cfg.block_size, shift=engine.config.logit_shift,
                          clean_loss=cfg.clean_loss, mask_loss=cfg.mask_loss)
    else:
        objective = MDM(mask_id, engine.eos_ids(), shift=engine.config.logit_shift)
    t0 = time.perf_counter()
    with _progress() as bar:
        report = _Report(bar)

        def tick(r) -> None:
            clean = "" if r.clean is None else f" clean {r.clean:.3f}"
            report.step(r, cfg.steps, f"loss {r.task:.3f}{clean} · {r.rows_per_s:.0f} rows/s",
                        stage=f"train {kind} --gate {gate}")

        try:
            state = train(engine.model, seqs, objective, cfg, out, resume=resume, time_budget_s=budget, on_step=tick)
        except KeyboardInterrupt:   # the trainer saved a checkpoint on its way out (if it had started)
            bar.stop()
            raise Interrupted(_train_kept(out)) from None
    typer.echo(f"{out}: step {state['step']}/{cfg.steps} ({state['stopped']}), "
               f"{time.perf_counter() - t0:.0f} s; use it with --adapter {out}")


DATA = typer.Option(..., "--data", help="A directory made by `dlm-studio train data`.")
OUT = typer.Option(..., "--out", help="The adapter directory to write (checkpointed as it trains).")
GATE = typer.Option("mask", "--gate", help="mask: LoRA on MASK rows only (lossless R-ISD) | all: every row (I-DLM).")
STEPS = typer.Option(400, "--steps")
BATCH = typer.Option(8, "--batch-size", help="Sequences per step.")
ROWS = typer.Option(96, "--rows", help="Noisy rows trained per sequence per step.")
LR = typer.Option(1e-3, "--lr")
RANK = typer.Option(16, "--rank")
ALPHA = typer.Option(32.0, "--alpha")
SEED = typer.Option(0, "--seed")
SAVE_EVERY = typer.Option(25, "--save-every", help="Checkpoint every this many steps.")
BUDGET = typer.Option(None, "--time-budget", help="Stop (and checkpoint) after this long: 90s, 45m, 2h.")
RESUME = typer.Option(False, "--resume", help="Continue the run in --out where it stopped.")
CLEAN_LOSS = typer.Option("ce", "--clean-loss", help="--gate all: the clean rows' loss. ce: cross-entropy on the "
                          "clean tokens (I-DLM Eq. 2) | kl: KL to the base model's distribution (keeps ISD's output "
                          "close to the base model's).")
MASK_LOSS = typer.Option("ce", "--mask-loss", help="The MASK rows' loss. ce: cross-entropy on the data's token | kl "
                         "(soft targets): KL to the base model's next-token distribution at the target's position.")
INIT = typer.Option(None, "--init", help="Start from this adapter's LoRA and MASK row (same rank; a new "
                    "optimizer and schedule), e.g. an r-isd adapter on to --gate all.")


@train_app.command("idlm")
def idlm_cmd(data: Path = DATA, out: Path = OUT, model: str = typer.Option("default", "--model"), gate: str = GATE,
             stride: int = typer.Option(4, "--stride", help="The last stage of the curriculum N = start .. stride."),
             start_stride: int = typer.Option(2, "--start-stride", help="The first stage of the curriculum."),
             steps: int = STEPS, batch_size: int = BATCH, rows: int = ROWS, lr: float = LR, rank: int = RANK,
             alpha: float = ALPHA, seed: int = SEED, save_every: int = SAVE_EVERY,
             time_budget: Optional[str] = BUDGET, resume: bool = RESUME, init: Optional[Path] = INIT,
             clean_loss: str = CLEAN_LOSS, mask_loss: str = MASK_LOSS, device: str = DEVICE, dtype: str = DTYPE):
    """The introspective-consistency recipe (I-DLM App. E): adapters for isd (--gate all) and r-isd (--gate mask)."""
    _run_training("idlm", data, out, model, gate, resume, time_budget, device, dtype, stride=stride,
                  start_stride=start_stride, steps=steps, batch_size=batch_size, rows_per_seq=rows, lr=lr, r=rank,
                  alpha=alpha, seed=seed, save_every=save_every, init=_init_path(init), clean_loss=clean_loss,
                  mask_loss=mask_loss)


@train_app.command("block")
def block_cmd(data: Path = DATA, out: Path = OUT, model: str = typer.Option("default", "--model"), gate: str = GATE,
              block_size: int = typer.Option(4, "--block-size"), steps: int = STEPS, batch_size: int = BATCH,
              rows: int = ROWS, lr: float = LR, rank: int = RANK, alpha: float = ALPHA, seed: int = SEED,
              save_every: int = SAVE_EVERY, time_budget: Optional[str] = BUDGET, resume: bool = RESUME,
              init: Optional[Path] = INIT, clean_loss: str = CLEAN_LOSS, mask_loss: str = MASK_LOSS,
              device: str = DEVICE, dtype: str = DTYPE):
    """Block diffusion (SDAR-style, random mask ratios): an adapter for blockdiff, s2d2 and simsd."""
    _run_training("block", data, out, model, gate, resume, time_budget, device, dtype, block_size=block_size,
                  steps=steps, batch_size=batch_size, rows_per_seq=rows, lr=lr, r=rank, alpha=alpha, seed=seed,
                  save_every=save_every, init=_init_path(init), clean_loss=clean_loss, mask_loss=mask_loss)


@train_app.command("mdm")
def mdm_cmd(data: Path = DATA, out: Path = OUT, model: str = typer.Option("default", "--model"),
            steps: int = STEPS, batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
            lr: float = LR, rank: int = RANK, alpha: float = ALPHA, seed: int = SEED, save_every: int = SAVE_EVERY,
            time_budget: Optional[str] = BUDGET, resume: bool = RESUME, init: Optional[Path] = INIT,
            device: str = DEVICE, dtype: str = DTYPE):
    """Masked diffusion (Dream's recipe): the AR model into a bidirectional MDM with the logit shift kept, LoRA on
    every row and a MASK row: an adapter for canvas."""
    _run_training("mdm", data, out, model, "all", resume, time_budget, device, dtype, steps=steps,
                  batch_size=batch_size, lr=lr, r=rank, alpha=alpha, seed=seed, save_every=save_every,
                  init=_init_path(init))


@train_app.command("jacobi")
def jacobi_cmd(data: Path = DATA, out: Path = OUT, model: str = typer.Option("default", "--model"),
               block_size: int = typer.Option(16, "--block-size", help="n: the Jacobi block of round 1 (each "
                                              "further round doubles it)."),
               window: int = typer.Option(8, "--window", help="w: the progressive schedule's window of blocks."),
               schedule: str = typer.Option("progressive", "--schedule", help="progressive: the noise rises "
                                            "linearly across each window of blocks | random (the paper's ablation)."),
               rounds: int = typer.Option(1, "--rounds", help="2: record again with the trained model at twice the "
                                          "block and train on (progressive distillation)."),
               ar_weight: float = typer.Option(10.0, "--ar-weight", help="loss = w * AR loss + consistency loss."),
               distill_temperature: float = typer.Option(1.0, "--distill-temperature"),
               steps: int = STEPS, batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
               rows: int = typer.Option(128, "--rows", help="Answer tokens packed per sequence (whole blocks)."),
               record_batch: int = typer.Option(8, "--record-batch", help="Sequences whose trajectories are "
                                                "recorded at once."),
               lr: float = LR, rank: int = RANK, alpha: float = ALPHA, seed: int = SEED,
               save_every: int = SAVE_EVERY, time_budget: Optional[str] = BUDGET, resume: bool = RESUME,
               device: str = DEVICE, dtype: str = DTYPE):
    """Jacobi Forcing (progressive consistency distillation): the model's own Jacobi trajectories packed with the
    noise-aware causal mask, AR loss x w + consistency loss, LoRA on every row: a new model that jacobi and
    jacobi-mr decode in fewer forwards, exactly."""
    import time

    from studio.engine.engine import Engine
    from studio.errors import BadInput
    from studio.train import forcing
    from studio.train.data import load_sequences
    from studio.train.trainer import TrainConfig
    from studio.train.trajectories import SCHEDULES

    if block_size < 2 or window < 1 or rounds < 1 or record_batch < 1 or steps < 1 or batch_size < 1:
        raise BadInput("--block-size must be >= 2; --window, --rounds, --record-batch, --steps and --batch-size >= 1")
    if schedule not in SCHEDULES:
        raise BadInput(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if rows < block_size:
        raise BadInput(f"--rows must hold a whole block: at least --block-size ({block_size}), got {rows}")
    if ar_weight < 0 or not distill_temperature > 0 or not lr > 0 or not alpha > 0 or rank < 1 or save_every < 1:
        raise BadInput("--ar-weight must be >= 0; --distill-temperature, --lr and --alpha positive; --rank and "
                       "--save-every >= 1")
    budget = _parse_budget(time_budget)
    forcing.check_out(out, resume)
    load_sequences(data)                    # a readable data directory, before any model loads
    cfg = TrainConfig(kind="jacobi", gate="all", steps=steps, batch_size=batch_size, rows_per_seq=rows, lr=lr,
                      r=rank, alpha=alpha, seed=seed, save_every=save_every, block_size=block_size, window=window,
                      schedule=schedule, ar_weight=ar_weight, distill_temperature=distill_temperature)
    t0 = time.perf_counter()
    with _progress() as bar:
        report = _Report(bar)

        def tick(r) -> None:
            report.step(r, steps, f"consistency {r.task:.3f} · AR {r.clean:.3f}", stage=f"train n={r.width}")

        try:
            state = forcing.run(lambda adapter: Engine.load(model, adapter=adapter or "none", device=device,
                                                            dtype=dtype),
                                data, out, cfg, rounds, record_batch, budget, report.update, on_step=tick)
        except KeyboardInterrupt:
            bar.stop()
            raise Interrupted(f"stopped; what was recorded and trained so far is kept in {out}: "
                              "continue with --resume") from None
    where = f"{state['stage']}, step {state['step']}/{steps}" if "step" in state else state["stage"]
    typer.echo(f"{out}: {where} ({state['stopped']}), {time.perf_counter() - t0:.0f} s"
               + ("; use it with --adapter " + str(out) if state["stopped"] == "done" else "; continue with --resume"))


@train_app.command("tc")
def tc_cmd(data: Path = DATA, out: Path = OUT, model: str = typer.Option("default", "--model"),
           init: Path = typer.Option(Path("smollm2-mdm"), "--init", help="The masked-diffusion adapter whose "
                                     "trajectories are compressed (and trained on)."),
           preset: str = typer.Option("canvas-cpu", "--preset", help="The canvas decoding that records them."),
           canvas: int = typer.Option(64, "--max-new-tokens", help="The canvas length of the recorded runs."),
           min_agreement: float = typer.Option(0.5, "--min-agreement", help="Keep a trajectory when its answer "
                                               "agrees with the data's (the base model's, cut to the canvas) on "
                                               "this share of tokens (judged again on --resume)."),
           steps: int = STEPS, batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
           lr: float = typer.Option(5e-4, "--lr"), rank: int = RANK, alpha: float = ALPHA, seed: int = SEED,
           save_every: int = SAVE_EVERY, time_budget: Optional[str] = BUDGET, resume: bool = RESUME,
           device: str = DEVICE, dtype: str = DTYPE):
    """Trajectory compression (dInfer App. C.1): the canvas model's own good trajectories, and a loss that makes
    it reveal in one forward what they revealed in several."""
    import time

    from studio.engine.engine import Engine
    from studio.errors import BadInput
    from studio.run.config import RunConfig
    from studio.run.session import run_to_end
    from studio.train import compression
    from studio.train.data import load_sequences
    from studio.train.trainer import STATE_JSON, TrainConfig, train

    if canvas < 1 or steps < 1 or batch_size < 1 or rank < 1 or save_every < 1:
        raise BadInput("--max-new-tokens, --steps, --batch-size, --rank and --save-every must be >= 1")
    if not 0 <= min_agreement <= 1:
        raise BadInput(f"--min-agreement is a share in [0, 1], got {min_agreement:g}")
    if not lr > 0 or not alpha > 0:
        raise BadInput("--lr and --alpha must be positive")
    budget = _parse_budget(time_budget)
    golden = out / "golden.jsonl"
    if resume and not golden.is_file():
        raise BadInput(f"nothing to resume in {out} (no {golden.name})")
    if not resume and out.exists() and any(out.iterdir()):
        raise BadInput(f"{out} exists and is not empty: --resume to continue its run, or another --out")
    init_path = _init_path(init)
    config = RunConfig(strategy=None, preset=preset, temperature=0.0, max_new_tokens=canvas)
    config.build()                              # a known preset with valid parameters, before the model loads
    seqs = load_sequences(data)
    engine = Engine.load(model, adapter=init_path, device=device, dtype=dtype)
    if engine.config.attention == "causal":
        raise BadInput(f"--init {init} is not a masked-diffusion adapter (train one with `train mdm`)")
    fill = next(iter(engine.eos_ids()), None)   # a model without an EOS reveals every cell: nothing to fill

    def run_one(ids: list[int]):
        strategy, settings = config.build()
        r = run_to_end(engine, strategy, settings, "", ids)
        return r.token_ids, r.events

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(kind="tc", gate="all", steps=steps, batch_size=batch_size, lr=lr, r=rank, alpha=alpha,
                      seed=seed, save_every=save_every, init=init_path)
    with _progress() as bar:
        report = _Report(bar)

        def recorded(done: int, total: int, kept: int) -> None:
            report.update("record", done, total, f"golden trajectories {kept}/{done} kept", log_every=10)

        def tick(r) -> None:
            report.step(r, steps, f"loss {r.task:.3f}")

        try:
            # half of a time budget records (the canvas runs go one at a time) and the rest trains on what was kept
            trajs, tried = compression.record(run_one, seqs, canvas, fill, min_agreement, golden, progress=recorded,
                                              deadline=None if budget is None else t0 + budget / 2)
            if not trajs:
                raise BadInput(f"no trajectory agreed with its data answer on {min_agreement:.0%} of the tokens: "
                               "lower --min-agreement")
            base = Engine.load(model, adapter="none", device=device, dtype=dtype)
            objective = compression.Compression(base.model.lm_head.weight.shape[0], base.eos_ids(),
                                                shift=base.config.logit_shift)
            left = None if budget is None else max(0.0, budget - (time.perf_counter() - t0))
            state = train(base.model, trajs, objective, cfg, out, resume=(out / STATE_JSON).is_file(),
                          time_budget_s=left, on_step=tick)
        except KeyboardInterrupt:
            bar.stop()
            raise Interrupted(f"stopped; the trajectories recorded and any checkpoint are kept in {out}: "
                              "continue with --resume") from None
    untried = "" if tried == len(seqs) else f" ({len(seqs) - tried} prompts left for --resume to record)"
    typer.echo(f"{out}: {len(trajs)} golden trajectories of {tried}{untried}, step {state['step']}/{steps} "
               f"({state['stopped']}), {time.perf_counter() - t0:.0f} s; use it with --adapter {out}")


@train_app.command("dflash")
def dflash_cmd(data: list[Path] = typer.Option(..., "--data", metavar="<path>", help="A directory made by `dlm-studio train data`; "
                                               "repeat it to train on several (a run resumed with one more appended "
                                               "computes the new one's features only)."),
               out: Path = typer.Option(..., "--out", help="The drafter directory to write (the "
                                                           "published layout, checkpointed as it trains)."),
               model: str = typer.Option("default", "--model", help="The target (a causal model)."),
               layers: int = typer.Option(1, "--layers", help="The drafter's layers (each the target's shape)."),
               taps: Optional[str] = typer.Option(None, "--taps", help="The target layers it reads, e.g. 2,15,26 "
                                                  "(default: the published rule, one per drafter layer)."),
               block_size: int = typer.Option(16, "--block-size", help="B: the anchor and B - 1 drafts."),
               anchors: int = typer.Option(16, "--anchors", help="Blocks trained per sequence per step."),
               gamma: float = typer.Option(7.0, "--gamma", help="The loss's decay over a block's slots."),
               mask_token: Optional[int] = typer.Option(None, "--mask-token", help="The token whose embedding fills "
                                                        "the draft rows (default: the model's MASK, else its last)."),
               draft_vocab: int = typer.Option(8192, "--draft-vocab", help="The head rows the drafter reads: the N "
                                               "tokens most frequent in the answers (0: the whole vocabulary; may "
                                               "change on --resume)."),
               steps: int = typer.Option(600, "--steps"), batch_size: int = BATCH,
               lr: float = typer.Option(6e-4, "--lr"), seed: int = SEED, save_every: int = SAVE_EVERY,
               time_budget: Optional[str] = BUDGET, resume: bool = RESUME, device: str = DEVICE, dtype: str = DTYPE):
    """DFlash (arXiv 2602.06036): a small block-diffusion drafter conditioned on the target's tapped hidden states,
    which are computed once per answer; only the drafter learns. A drafter for dflash (--draft-model OUT)."""
    import time

    from studio.engine.dflash import default_taps
    from studio.engine.engine import Engine
    from studio.errors import BadInput
    from studio.train import dflash
    from studio.train.data import load_sequences

    if layers < 1 or block_size < 2 or anchors < 1 or steps < 1 or batch_size < 1 or save_every < 1 or draft_vocab < 0:
        raise BadInput("--block-size must be >= 2; --layers, --anchors, --steps, --batch-size and --save-every >= 1; "
                       "--draft-vocab >= 0")
    if not gamma > 0 or not lr > 0:
        raise BadInput("--gamma and --lr must be positive")
    try:
        tap_ids = None if taps is None else [int(t) for t in taps.split(",")]
    except ValueError:
        raise BadInput(f"--taps: expected layer numbers like 2,15,26, got {taps!r}") from None
    budget = _parse_budget(time_budget)
    if not resume and (out / "train_state.json").exists():
        raise BadInput(f"{out} already holds a training run: --resume to continue it, or another --out")
    seqs = [s for d in data for s in load_sequences(d)]   # readable data directories, before the model loads
    engine = Engine.load(model, adapter="none", device=device, dtype=dtype)
    cfg_m = engine.config
    if cfg_m.attention != "causal" or not cfg_m.logit_shift:
        raise BadInput(f"{model!r} is not a causal AR model: a DFlash drafter drafts for one")
    if tap_ids is not None and not all(0 <= t < cfg_m.n_layers for t in tap_ids):
        raise BadInput(f"--taps: {model!r} has layers 0..{cfg_m.n_layers - 1}, got {taps}")
    mask = mask_token if mask_token is not None else (cfg_m.mask_token_id if cfg_m.mask_token_id is not None
                                                      else cfg_m.vocab_size - 1)
    if not 0 <= mask < cfg_m.vocab_size:
        raise BadInput(f"--mask-token must be a token id below {cfg_m.vocab_size}, got {mask}")
    tap_ids = default_taps(cfg_m.n_layers, layers) if tap_ids is None else tap_ids
    cfg = dflash.DFlashConfig(layers=layers, taps=tap_ids, block_size=block_size, mask_token_id=mask,
                              anchors=anchors, gamma=gamma, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                              save_every=save_every, draft_vocab=draft_vocab)
    t0 = time.perf_counter()
    with _progress() as bar:
        report = _Report(bar)

        def tick(r) -> None:
            acc = " ".join(f"{a:.2f}" for a in r.accuracy[:4])
            report.update("train", r.step, steps, f"loss {r.loss:.3f} · acc {acc} · lr {r.lr:.1e}", log_every=10)

        try:
            deadline = None if budget is None else t0 + budget
            n = dflash.extract(engine.model, seqs, cfg.taps, out, cfg.max_len, report.update, deadline)
            if n < len(seqs):
                typer.echo(f"{out}: features of {n}/{len(seqs)} sequences within the time budget; continue with "
                           "--resume")
                return
            left = None if budget is None else max(0.0, budget - (time.perf_counter() - t0))
            state = dflash.train(engine.model, dflash.load_features(out), cfg, out,
                                 resume=(out / "train_state.json").is_file(), time_budget_s=left, on_step=tick)
        except KeyboardInterrupt:
            bar.stop()
            raise Interrupted(f"stopped; the features and the last checkpoint are kept in {out}: continue with "
                              "--resume") from None
    vocab = state["draft_vocab"]
    typer.echo(f"{out}: step {state['step']}/{steps} ({state['stopped']}), {time.perf_counter() - t0:.0f} s; its head "
               f"reads {vocab['tokens']:,} tokens ({vocab['coverage']:.1%} of the answers' tokens)"
               + (f"; use it with -s dflash --draft-model {out}" if state["stopped"] == "done"
                  else "; continue with --resume"))


def _init_path(init: Optional[Path]) -> Optional[str]:
    """--init as recorded in train_state.json: a shipped adapter's name or a directory, made absolute."""
    from studio.presets.shipped import adapter_path

    return None if init is None else str(Path(adapter_path(str(init))).resolve())


@train_app.command("eval")
def eval_cmd(
    adapter: str = typer.Argument(..., help="An adapter directory or a shipped adapter's name."),
    model: str = typer.Option("default", "--model"),
    strategies: Optional[str] = typer.Option(None, "--strategies", "-s",
                                             help="Strategies/presets to run (default: those the adapter was trained for)."),
    n_prompts: int = typer.Option(40, "--n-prompts", help="How many held-out prompts (never trained on)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="A file of prompts, one per line, instead."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    device: str = DEVICE,
    dtype: str = DTYPE,
):
    """TPF, acceptance by draft position, tok/s vs ar and agreement with ar on held-out prompts (greedy). ADAPTER may
    also be a DFlash drafter (`train dflash`): its strategy is dflash on the plain model."""
    import dataclasses
    import json

    from studio.engine.dflash import is_drafter_dir
    from studio.presets.shipped import adapter_path
    from studio.run.compare import compare_configs
    from studio.run.config import RunConfig
    from studio.engine.engine import Engine
    from studio.errors import BadInput
    from studio.train import evaluate, prompts as builtin

    if n_prompts < 1 or max_new_tokens < 1:
        raise BadInput("--n-prompts and --max-new-tokens must be >= 1")
    path = adapter_path(adapter)
    drafter = is_drafter_dir(path)
    configs = compare_configs(strategies or ("dflash" if drafter else evaluate.default_runs(path)),
                              RunConfig(temperature=0.0, max_new_tokens=max_new_tokens))
    if drafter:   # every dflash run drafts with it
        configs = {label: dataclasses.replace(c, params={**c.params, "drafter": path}) if c.build()[0].name == "dflash"
                   else c for label, c in configs.items()}
    configs = evaluate.measuring_every_slot(configs)
    texts = builtin.read_prompt_file(prompts) if prompts else builtin.eval_prompts(n_prompts)
    engine = Engine.load(model, adapter="none" if drafter else path, device=device, dtype=dtype)
    with _progress() as bar:
        report, done = _Report(bar), iter(range(1, len(texts) * len(configs) + 1))

        def tick(i: int, label: str) -> None:
            report.update("eval", next(done), len(texts) * len(configs), f"prompt {i + 1} {label}",
                          log_every=len(configs))

        report = evaluate.evaluate(engine, texts, configs, progress=tick)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(f"{engine.name} + {path}: {len(texts)} held-out prompts, {max_new_tokens} new tokens, greedy\n")
        typer.echo(evaluate.render(report))


@train_app.command("pack")
def pack_cmd(
    adapter: Path = typer.Argument(..., help="A trained adapter (or DFlash drafter) directory."),
    out: Path = typer.Argument(..., help="Where to write the packed copy (must not exist)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp16 | fp32: the stored weights' type."),
    strategies: Optional[str] = typer.Option(None, "--strategies",
                                             help="Write studio.toml: the strategies that use it by default."),
    model: str = typer.Option("default", "--model", help="studio.toml: the model preset it was trained for."),
    description: str = typer.Option("", "--description", help="studio.toml: one line about it."),
):
    """A compact, shippable copy of an adapter: the PEFT files with weights in --dtype, the training
    record (train_state.json, train_log.jsonl) alongside, optimizer moments left out. A DFlash drafter (`train
    dflash`) is packed the same way, in its published layout."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from studio.engine.dflash import CONFIG, WEIGHTS, is_drafter_dir, load_drafter
    from studio.engine.lora import CONFIG_FILE, WEIGHTS_FILE, read_adapter
    from studio.engine.lazy_tensors import read_safetensors
    from studio.errors import BadInput

    types = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in types:
        raise BadInput(f"--dtype must be one of {', '.join(types)}, got {dtype!r}")
    drafter = is_drafter_dir(adapter)
    config, weights = (CONFIG, WEIGHTS) if drafter else (CONFIG_FILE, WEIGHTS_FILE)
    load_drafter(adapter) if drafter else read_adapter(adapter)   # a valid one, or one line and exit 2
    if out.exists():
        raise BadInput(f"{out} exists: choose a new directory")
    out.mkdir(parents=True)
    tensors = {k: (v.to(types[dtype]) if v.is_floating_point() else v).contiguous()   # a drafter's token ids stay
               for k, v in read_safetensors(adapter / weights).items()}
    save_file(tensors, str(out / weights), metadata={"format": "pt"})
    shutil.copy(adapter / config, out / config)
    for f in ("train_state.json", "train_log.jsonl"):
        if (adapter / f).is_file():
            shutil.copy(adapter / f, out / f)
    if strategies:
        names = [s.strip() for s in strategies.split(",") if s.strip()]
        (out / "studio.toml").write_text(f"model = {json.dumps(model)}\nstrategies = {json.dumps(names)}\n"
                                         f"description = {json.dumps(description)}\n", encoding="utf-8")
    size = (out / weights).stat().st_size / 1e6
    typer.echo(f"{out}: {len(tensors)} tensors, the floats in {dtype}, {size:.1f} MB")

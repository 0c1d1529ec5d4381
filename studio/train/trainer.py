"""The training loop shared by `train idlm`, `train block` and `train mdm`: AdamW, warmup + cosine, time box, checkpoints.

An output directory is a usable adapter at every checkpoint (adapter_config.json +
adapter_model.safetensors, loadable by `--adapter` and by peft) plus
  train_state.json         the run's settings, the step reached, the data fingerprint
  train_state.safetensors  AdamW's moments, by tensor name
  train_log.jsonl          one line per step: loss, masked loss, clean loss, lr, block width, accuracy by slot
`resume=True` reloads all three and continues at the next step; the batch of step k depends only on
(seed, k), so a resumed run trains on exactly what an uninterrupted one would have.
Checkpoints are written to temporary names and renamed: an interrupt never leaves a half-written adapter.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch

from studio.errors import BadInput
from studio.interrupts import uninterruptible
from studio.train.data import Sequence
from studio.train.objectives import Objective
from studio.train.trainable import Trainable

STATE_JSON = "train_state.json"
STATE_TENSORS = "train_state.safetensors"
LOG = "train_log.jsonl"


@dataclass
class TrainConfig:
    kind: str                    # idlm | block | mdm | jacobi
    gate: str                    # mask | all (mdm: all)
    steps: int = 400
    batch_size: int = 8
    rows_per_seq: int = 96       # noisy rows trained per sequence per step (mdm: every answer position is one)
    lr: float = 1e-3
    warmup: float = 0.05         # fraction of steps
    weight_decay: float = 0.0
    r: int = 16
    alpha: float = 32.0
    seed: int = 0
    stride: int = 4              # idlm: the last curriculum stage N (curriculum start_stride .. N)
    start_stride: int = 2        # idlm: the first stage (= stride: train at N only, e.g. from --init)
    block_size: int = 4          # block; jacobi: n, the Jacobi block the trajectories were recorded at
    save_every: int = 25
    max_len: int = 320           # sequences are cut to this many tokens
    init: str | None = None      # an adapter to start from (its LoRA and MASK row; fresh optimizer and schedule)
    clean_loss: str = "ce"       # gate all: ce (the clean tokens, I-DLM Eq. 2) | kl (the base model's law)
    mask_loss: str = "ce"        # idlm, block: ce (the data's token) | kl (soft targets: the base model's law)
    window: int = 8              # jacobi: the progressive schedule's window of blocks
    schedule: str = "progressive"   # jacobi: progressive | random (the paper's ablation)
    ar_weight: float = 10.0      # jacobi: loss = ar_weight * L_AR + L_consistency
    distill_temperature: float = 1.0   # jacobi: the consistency loss's temperature


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine to 10% of the peak."""
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def begin_step(opt, cfg, step: int) -> tuple[torch.Generator, float]:
    """Step `step`'s learning rate set on `opt`, and its generator: a pure function of (seed, step), so a resumed
    run draws what an uninterrupted one does."""
    lr = lr_at(cfg, step)
    for g in opt.param_groups:
        g["lr"] = lr
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + step), lr


def batch_for_step(seqs: list[Sequence], cfg: TrainConfig, step: int) -> list[Sequence]:
    """The sequences of step `step`: epochs of seeded permutations, a pure function of (seed, step)."""
    n = len(seqs)
    first = step * cfg.batch_size
    out = []
    for i in range(first, first + cfg.batch_size):
        epoch, k = divmod(i, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
        out.append(seqs[int(perm[k])])
    return out


@dataclass
class StepReport:
    step: int
    loss: float
    task: float
    clean: float | None
    lr: float
    width: int
    accuracy: list[float]        # greedy hit rate of the noisy rows by draft slot (this step)
    rows_per_s: float


def train(model, seqs: list[Sequence], objective: Objective, cfg: TrainConfig, out: str | Path,
          resume: bool = False, time_budget_s: float | None = None,
          on_step: Callable[[StepReport], None] | None = None) -> dict:
    """Train until cfg.steps or the time budget; returns the final train_state. Ctrl+C saves first."""
    root = Path(out)
    seqs = [dataclasses.replace(s, tokens=s.tokens[:cfg.max_len]) for s in seqs]   # a Trajectory stays one
    seqs = [s for s in seqs if len(s.tokens) - s.prompt_len >= objective.min_answer()]
    if not seqs:
        raise BadInput("no training sequence has a long enough answer")
    state, init = _start(root, cfg, len(seqs), resume)
    trainable = Trainable(model, cfg.r, cfg.alpha, seed=cfg.seed, init=init)
    tensors = trainable.named_tensors()
    opt = torch.optim.AdamW([t for _, t in tensors], lr=cfg.lr, weight_decay=cfg.weight_decay)
    if resume:
        _load_optimizer(root, opt, tensors)
    n_slots = objective.n_slots()
    t_start = time.perf_counter()
    step = state["step"]
    try:
        while step < cfg.steps:
            if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
                state["stopped"] = "time budget"
                break
            t0 = time.perf_counter()
            gen, lr = begin_step(opt, cfg, step)
            width = objective.block_width(step / cfg.steps)
            batch = objective.make_batch(batch_for_step(seqs, cfg, step), cfg.rows_per_seq, step / cfg.steps, gen)
            trainable.bind()
            losses = objective.loss(model, batch, n_slots)
            opt.zero_grad(set_to_none=True)
            losses.total.backward()
            torch.nn.utils.clip_grad_norm_([t for _, t in tensors], 1.0)
            n_counted = int(losses.counted.nonzero().max()) + 1 if losses.counted.any() else 0
            acc = (losses.correct / losses.counted.clamp(min=1))[:n_counted].tolist()   # slots this objective has
            rows = int((batch.targets != -100).sum())
            report = _take_step(root, opt, state, lambda: StepReport(
                step + 1, float(losses.total.detach()), losses.task, losses.clean, lr, width, acc,
                rows / max(1e-9, time.perf_counter() - t0)))
            step = report.step
            if on_step:
                on_step(report)
            if step % cfg.save_every == 0 or step == cfg.steps:
                _save(root, trainable, opt, tensors, state, objective)
        else:
            state["stopped"] = "done"
    except KeyboardInterrupt:
        state["stopped"] = "interrupted"
        _save(root, trainable, opt, tensors, state, objective)
        raise
    state["train_s"] = state.get("train_s", 0.0) + time.perf_counter() - t_start
    _save(root, trainable, opt, tensors, state, objective)
    return state


@uninterruptible   # a Ctrl+C waits for the step to be whole: the weights, train_state's step and the log agree
def _take_step(root: Path, opt, state: dict, report_at: Callable[[], StepReport]) -> StepReport:
    """The optimizer's step and its record (`report_at()`, made once the step is taken)."""
    opt.step()
    report = report_at()
    state["step"] = report.step
    _append_log(root, report)
    return report


def _start(root: Path, cfg: TrainConfig, n_seqs: int, resume: bool):
    """A fresh state, or the saved one (same settings) with the adapter to continue from."""
    from studio.engine.lora import read_adapter

    if resume:
        f = root / STATE_JSON
        if not f.is_file():
            raise BadInput(f"nothing to resume in {root} (no {STATE_JSON})")
        state = json.loads(f.read_text(encoding="utf-8"))
        saved = state.get("config", {})
        defaults = {f.name: f.default for f in fields(TrainConfig)}   # settings added since it was saved
        differ = [k for k, v in asdict(cfg).items() if k != "steps" and saved.get(k, defaults[k]) != v]
        if differ:
            raise BadInput(f"cannot resume {root}: it was trained with {differ[0]}={saved.get(differ[0])!r}, "
                           f"now {getattr(cfg, differ[0])!r}")
        state["config"] = asdict(cfg)
        return state, read_adapter(root)
    if (root / STATE_JSON).exists():
        raise BadInput(f"{root} already holds a training run: --resume to continue it, or another --out")
    init = None
    if cfg.init is not None:
        init = read_adapter(cfg.init)
        if init.r != cfg.r:
            raise BadInput(f"--init {cfg.init} has rank {init.r}; train it on with --rank {init.r}")
    root.mkdir(parents=True, exist_ok=True)
    (root / LOG).write_text("", encoding="utf-8")
    return {"config": asdict(cfg), "step": 0, "n_sequences": n_seqs}, init


@uninterruptible   # safetensors' writer garbles an interrupt; a checkpoint is written whole or not at all
def _save(root: Path, trainable: Trainable, opt, tensors, state: dict, objective: Objective) -> None:
    from safetensors.torch import save_file

    tmp = root / ".checkpoint"
    tmp.mkdir(exist_ok=True)
    cfg = state["config"]
    trainable.save(tmp, block_size=cfg["block_size"] if cfg["kind"] == "block" else None, adapted_rows=cfg["gate"],
                   attention=objective.trained_attention)
    moments = {}
    for i, (name, _) in enumerate(tensors):
        st = opt.state.get(opt.param_groups[0]["params"][i], {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                moments[f"{name}.{key}"] = st[key].detach().contiguous()
        if "step" in st:
            moments[f"{name}.step"] = st["step"].detach().reshape(1).float()
    save_file(moments, str(tmp / STATE_TENSORS))
    (tmp / STATE_JSON).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    for f in ("adapter_config.json", "adapter_model.safetensors", STATE_TENSORS, STATE_JSON):  # state last
        os.replace(tmp / f, root / f)
    tmp.rmdir()


def _load_optimizer(root: Path, opt, tensors) -> None:
    from studio.engine.lazy_tensors import read_safetensors

    saved = read_safetensors(root / STATE_TENSORS)
    params = opt.param_groups[0]["params"]
    for i, (name, _) in enumerate(tensors):
        if f"{name}.exp_avg" in saved:
            opt.state[params[i]] = {"step": saved[f"{name}.step"][0].clone(),
                                    "exp_avg": saved[f"{name}.exp_avg"].clone(),
                                    "exp_avg_sq": saved[f"{name}.exp_avg_sq"].clone()}


def _append_log(root: Path, r: StepReport) -> None:
    with open(root / LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(r)) + "\n")

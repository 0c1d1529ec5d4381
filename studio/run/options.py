"""The command-line options every generation command shares, declared once.

`generation_options` adds them to a Typer command: the command declares `model: ModelChoice` and
`config: RunConfig` parameters and receives them built from the options. `--strategy`
stays each command's own (one name for `run`, a comma list for `compare`). `train` uses DEVICE and DTYPE;
studio.engine.device resolves and checks their values.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import typer

from studio.errors import BadInput
from studio.run.config import ModelChoice, RunConfig, parse_param, strategy_or_preset

DEVICE = typer.Option("auto", "--device", help="auto (CUDA when available) | cpu | cuda.")
DTYPE = typer.Option("auto", "--dtype", help="auto (bf16 on CUDA, fp32 on the CPU) | fp32 | bf16 | fp16.")
GRAPHS = typer.Option(True, "--graphs/--no-graphs", help="CUDA graphs for decode-sized forwards (on CUDA only; "
                      "--no-graphs runs every forward eagerly).")
FORCE = typer.Option(False, "--force", help="Overwrite files that exist (default: refuse, before any work).")
# the commands' own --strategy: one name (run, chat, tui) or a comma list (compare, bench)
# (named here, not read from the registry: `--help` does not load torch; a test holds the list to the registry)
STRATEGY = typer.Option(None, "--strategy", "-s", help="ar, isd, r-isd, jacobi, jacobi-mr, lookup-tree, dflash, blockdiff, "
                        "s2d2, simsd, canvas, gemma-canvas, or a strategy preset (default: --preset's, else the model "
                        "preset's, else ar).")
STRATEGIES = typer.Option("ar,isd", "--strategy", "-s", help="Comma-separated strategies or presets (ar is always "
                          "added, first: the baseline).")

# name -> (annotation, Typer option): the ModelChoice fields
MODEL_OPTIONS = {
    "model": (str, typer.Option("default", "--model", help="'default', a model preset, a HF directory, a .gguf, or "
              "random:NAME (random weights of smollm2-135m, qwen3-0.6b, qwen3-8b or llama3-8b: for speed "
              "measurements).")),
    "adapter": (Optional[str], typer.Option(None, "--adapter", help="A PEFT LoRA adapter directory or a shipped "
                "adapter's name; 'none' = the plain model. Default: on the default model, each strategy's shipped "
                "adapter (studio/presets/adapters).")),
    "draft_model": (Optional[str], typer.Option(None, "--draft-model", help="simsd: the draft dLLM (default: self "
                    "draft); dflash: a DFlash drafter directory (default: the one shipped for the model).")),
    "draft_adapter": (Optional[str], typer.Option(None, "--draft-adapter", help="simsd: an adapter for the draft "
                      "model.")),
    "device": (str, DEVICE),
    "dtype": (str, DTYPE),
    "graphs": (bool, GRAPHS),
    "quant": (str, typer.Option("none", "--quant", help="none | int8 (CPU, CUDA) | fp8 (CUDA, compute capability "
              "8.9+): the layers' projections, the experts and the head as 1-byte weights with a scale per row (half "
              "the bytes a bf16 step streams; another model, to which the lossless strategies are exact).")),
    "compile": (bool, typer.Option(False, "--compile/--no-compile", help="The forward through torch.compile "
                "(inductor): each new forward layout compiles at its first use (tens of seconds on a small CPU), "
                "then the embedded model's steps take ~0.8-0.95x the eager ones' time (CPU, 2 threads).")),
    "tp": (int, typer.Option(1, "--tp", help="Tensor parallelism: split the model across N ranks (processes started "
           "here; gloo on the CPU, NCCL on GPUs). Under torchrun: the launch's world size.")),
    "ep": (int, typer.Option(1, "--ep", help="Expert parallelism for an MoE model: its experts placed whole across N "
           "ranks, the attention split across the same ranks (1 or --tp's N; --ep N alone means --tp N too).")),
    "raw": (bool, typer.Option(False, "--raw", help="Do not apply the chat template.")),
}

# name -> (annotation, Typer option): the RunConfig fields besides the strategy
RUN_OPTIONS = {
    "preset": (Optional[str], typer.Option(None, "--preset", help="A strategy preset name or TOML file.")),
    "max_new_tokens": (Optional[int], typer.Option(None, "--max-new-tokens", help="Default: the strategy preset's, "
                       "else the model preset's, else 128.")),
    "temperature": (Optional[float], typer.Option(None, "--temperature", help="0 = greedy (the default).")),
    "top_k": (Optional[int], typer.Option(None, "--top-k", help="Sample from the k most likely tokens (0: off).")),
    "top_p": (Optional[float], typer.Option(None, "--top-p", help="Nucleus sampling mass (1.0: off).")),
    "seed": (int, typer.Option(0, "--seed", help="Seeds sampling and draft initialisation.")),
    "param": (list[str], typer.Option([], "--param", "-p", help="Strategy parameter KEY=VALUE (repeatable).")),
    "stop": (list[str], typer.Option([], "--stop", help="Stop string (repeatable).")),
}


def model_choice(values: dict) -> ModelChoice:
    return ModelChoice(values["model"], values["adapter"], values["draft_model"], values["draft_adapter"],
                       values["device"], values["dtype"], values["graphs"], chat_template=not values["raw"],
                       tp=values["tp"], ep=values["ep"], quant=values["quant"],
                       compile=values["compile"])


def run_config(strategy: str | None, values: dict) -> RunConfig:
    """The run the options describe: `-s` names a strategy or a strategy preset (as in compare); with neither `-s`
    nor --preset, `RunConfig.build` takes the model preset's recommendation (a LLaDA preset: canvas), else `ar`."""
    preset = values["preset"]
    if strategy is not None:
        named_strategy, named_preset = strategy_or_preset(strategy)
        if named_preset and preset:
            raise BadInput(f"-s {strategy} is a preset: give it or --preset {preset}, not both")
        strategy, preset = named_strategy, named_preset or preset
    config = RunConfig(strategy, preset, dict(parse_param(p) for p in values["param"]), values["temperature"],
                       values["top_k"], values["top_p"], values["max_new_tokens"], values["seed"],
                       tuple(values["stop"]), model=values.get("model", "default"))
    config.build()   # a bad value or preset: one line before anything loads
    return config


def say_when_measuring_costs() -> None:
    """One line on stderr before a cost table is measured (the first cost-aware run on a model pauses for it), and
    one after when the machine was too busy for it to be trusted."""
    from studio.engine import cost_model
    cost_model.on_measure = lambda text: typer.echo(f"dlm-studio: {text}", err=True)


def generation_options(exclude: tuple[str, ...] = ()):
    """Decorate a command so that it takes the shared options (less those named in `exclude`, which get their
    defaults). The command's `model` parameter receives a `ModelChoice`, its `config` parameter a `RunConfig`
    built with the command's own `strategy` parameter (None: the preset's strategy, else `ar`); a command whose
    strategy option is a list names it `strategies` and makes its runs with `RunConfig.use`."""
    defaults = {name: option.default for name, (_, option) in {**MODEL_OPTIONS, **RUN_OPTIONS}.items()}
    shared = {name: spec for name, spec in {**MODEL_OPTIONS, **RUN_OPTIONS}.items() if name not in exclude}

    def decorate(command):
        own = [p for p in inspect.signature(command).parameters.values() if p.name not in ("model", "config")]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
                 for name, (annotation, option) in shared.items()]

        @functools.wraps(command)
        def wrapper(**kwargs):
            say_when_measuring_costs()
            values = {**defaults, **{name: kwargs.pop(name) for name in shared}}
            kwargs["model"] = model_choice(values)
            kwargs["config"] = run_config(kwargs.get("strategy"), values)
            return command(**kwargs)
        wrapper.__signature__ = inspect.Signature(own + added)
        # Typer reads types from the annotations: the shared options' must replace `model` and `config`'s
        wrapper.__annotations__ = {**{p.name: command.__annotations__[p.name] for p in own},
                                   **{name: annotation for name, (annotation, _) in shared.items()}}
        return wrapper
    return decorate

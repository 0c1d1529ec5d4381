"""The `dlm-studio` command line (DESIGN §2.1). Exit codes: 0 ok, 2 bad input, 1 internal error."""
from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Optional

import typer

from studio.errors import BadInput

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="A local studio for parallel decoding of language models.")
models_app = typer.Typer(no_args_is_help=True, help="List and inspect models.")
app.add_typer(models_app, name="models")

DEMO_PROMPT = "Write a numbered list of five fruits."


# -- options shared by the generation commands -----------------------------------------------
def _parse_param(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise BadInput(f"--param expects KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: keep it as a string
    return key.strip(), value


def build_run(strategy: Optional[str], preset: Optional[str], params: list[str], max_new_tokens: Optional[int],
              temperature: Optional[float], top_k: Optional[int], top_p: Optional[float], seed: int,
              stop: list[str]):
    """Merge preset and CLI flags into (Strategy, Settings). CLI flags win."""
    from studio.engine.sampling import SamplingParams
    from studio.engine.strategies import make_strategy
    from studio.presets import load_strategy_preset
    from studio.session import Settings

    base = load_strategy_preset(preset) if preset else None
    name = strategy or (base.strategy if base else None)
    if name is None:
        raise BadInput("give a strategy with -s/--strategy or a --preset")
    merged = dict(base.params) if base and base.strategy == name else {}
    merged.update(_parse_param(p) for p in params)
    sampling = dict(base.sampling) if base else {}
    for key, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if value is not None:
            sampling[key] = value
    mnt = max_new_tokens or (base.max_new_tokens if base else None) or 128
    return make_strategy(name, merged), Settings(max_new_tokens=mnt, sampling=SamplingParams(**sampling),
                                                 seed=seed, stop=tuple(stop))


def _metrics_line(f: dict, strategy: str, events: list[dict]) -> str:
    verified = any(e["t"] in ("accept", "reject") for e in events)
    acc = f"{f['accept_rate']:.2f}" if verified else "n/a"
    return (f"[{strategy}] {f['n_tokens']} tokens  {f['forwards']} forwards  TPF {f['tpf']:.2f}  "
            f"accept {acc}  {f['tok_s']:.1f} tok/s  prefill {f['prefill_s']:.2f}s  stop {f['stop_reason']}")


class LiveMetrics:
    """A live metrics line on stderr (only when stderr is a terminal); consumes events only."""

    def __init__(self, strategy: str):
        self.strategy, self.n_tokens, self.forwards, self.t0 = strategy, 0, 0, None

    def __call__(self, e: dict) -> None:
        if e["t"] == "forward" and e["role"] != "prefill":
            self.forwards += 1
        elif e["t"] == "emit":
            self.n_tokens += len(e["tok"])
        if self.t0 is None and e["t"] == "forward" and e["role"] != "prefill":
            self.t0 = e["ms"]
        elapsed = (e["ms"] - (self.t0 or e["ms"])) / 1000
        tpf = self.n_tokens / self.forwards if self.forwards else 0.0
        rate = self.n_tokens / elapsed if elapsed > 0 else 0.0
        sys.stderr.write(f"\r\x1b[2K[{self.strategy}] {self.n_tokens} tok  {self.forwards} fwd  "
                         f"TPF {tpf:.2f}  {rate:.1f} tok/s")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\r\x1b[2K")


# -- commands ------------------------------------------------------------------------------------
@app.command()
def run(
    prompt: str = typer.Argument(..., help="The prompt (wrapped in the model's chat template unless --raw)."),
    strategy: Optional[str] = typer.Option(None, "--strategy", "-s", help="ar, isd, r-isd, ..."),
    preset: Optional[str] = typer.Option(None, "--preset", help="A strategy preset name or TOML file."),
    model: str = typer.Option("default", "--model", help="'default', a model preset, a HF directory or a .gguf."),
    adapter: Optional[str] = typer.Option(None, "--adapter", help="A PEFT LoRA adapter directory."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="0 = greedy (the default)."),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    seed: int = typer.Option(0, "--seed"),
    param: list[str] = typer.Option([], "--param", "-p", help="Strategy parameter KEY=VALUE (repeatable)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write the step trace (JSON Lines)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
):
    """Generate text for PROMPT with one strategy, streaming tokens as they become final."""
    from studio.engine.engine import Engine
    from studio.session import Session, encode_prompt

    strat, settings = build_run(strategy, preset, param, max_new_tokens, temperature, top_k, top_p, seed, stop)
    engine = Engine.load(model, adapter=adapter)
    ids = encode_prompt(engine, prompt, chat=not raw)
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
    typer.echo(_metrics_line(result.footer, strat.name, result.events), err=True)
    if trace:
        typer.echo(f"trace: {trace}", err=True)


@app.command()
def demo(
    prompt: str = typer.Option(DEMO_PROMPT, "--prompt"),
    strategies: str = typer.Option("ar,isd", "--strategies", "-s"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir"),
):
    """The studio's main job on the embedded model: one prompt through each strategy, greedy, with traces."""
    from studio.engine.engine import Engine
    from studio.session import Session, encode_prompt

    engine = Engine.load("default")
    typer.echo(f"model: {engine.name} ({engine.config.arch}, {engine.source}; loaded in {engine.load_s:.1f}s"
               f"{' from cache' if engine.from_cache else ''})", err=True)
    ids = encode_prompt(engine, prompt)
    trace_dir.mkdir(parents=True, exist_ok=True)
    typer.echo(f"prompt: {prompt}\n")
    results = {}
    for name in strategies.split(","):
        strat, settings = build_run(name.strip(), None, [], max_new_tokens, 0.0, None, None, 0, [])
        path = trace_dir / f"demo-{strat.name}.jsonl"
        res = Session(engine, strat, settings).run(prompt, ids, trace_path=str(path))
        results[strat.name] = res
        typer.echo(f"── {strat.name} " + "─" * 40)
        typer.echo(res.footer["text"].strip())
        typer.echo(_metrics_line(res.footer, strat.name, res.events))
        typer.echo(f"trace: {path}\n")
    if "ar" in results:
        ref = results["ar"].token_ids
        for name, res in results.items():
            if name != "ar":
                same = "identical to" if res.token_ids == ref else "differs from"
                typer.echo(f"{name}: output {same} ar (greedy)")


@models_app.command("list")
def models_list():
    """The embedded default and every cached model."""
    from studio.engine.weights import list_models
    for m in list_models():
        cached = "cached" if m.get("cached") else "not cached"
        typer.echo(f"{m['name']:<32} {m['source']:<10} {cached:<11} {m.get('path', '')}")


@models_app.command("info")
def models_info(spec: str = typer.Argument("default", help="'default', a model preset, a directory or a .gguf")):
    """Architecture, size and capabilities of a model."""
    from studio.engine.engine import Engine
    engine = Engine.load(spec)
    cfg = engine.config
    n_params = sum(p.numel() for p in {id(p): p for p in engine.model.parameters()}.values())
    typer.echo(f"name:          {engine.name}\nsource:        {engine.source}\narch:          {cfg.arch}")
    typer.echo(f"parameters:    {n_params / 1e6:.1f} M\nlayers:        {cfg.n_layers}  dim {cfg.dim}  "
               f"heads {cfg.n_heads}/{cfg.n_kv_heads} (q/kv)  head_dim {cfg.head_dim}  ffn {cfg.ffn_dim}")
    typer.echo(f"vocab:         {cfg.vocab_size}\ncontext:       {cfg.max_seq_len}\nrope theta:    {cfg.rope_theta:g}")
    typer.echo(f"tied head:     {cfg.tie_embeddings}\nlogit shift:   {cfg.logit_shift}  "
               f"(hidden i predicts token i+1)\nmask token:    {cfg.mask_token_id}\nblock size:    {cfg.block_size}")
    typer.echo(f"eos ids:       {engine.eos_ids()}\nload time:     {engine.load_s:.2f}s"
               f"{' (from cache)' if engine.from_cache else ''}")


def main() -> None:
    """Typer handles usage errors (exit 2); our BadInput becomes one line on stderr and exit 2."""
    try:
        app()
    except BadInput as e:
        typer.echo(f"dlm-studio: error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # an internal error: one line, the traceback only on request
        if os.environ.get("DLM_STUDIO_DEBUG"):
            raise
        typer.echo(f"dlm-studio: internal error: {type(e).__name__}: {e} (set DLM_STUDIO_DEBUG=1 for a traceback)",
                   err=True)
        sys.exit(1)

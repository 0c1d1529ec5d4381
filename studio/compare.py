"""Side-by-side comparison: several strategies on one prompt, seed and sampling setting, in one process.

`ar` always runs (first) as the baseline that speed and agreement are measured against.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from studio.engine.strategies import STRATEGIES
from studio.errors import BadInput
from studio.session import RunResult, Session


@dataclass
class RunSpec:
    label: str          # what the user asked for (a strategy or preset name)
    strategy: str | None
    preset: str | None


def parse_specs(items: str, preset: str | None = None) -> list[RunSpec]:
    """`ar,isd,isd-n4` -> specs; an item is a strategy name or a strategy preset name. `ar` is added first."""
    from studio.presets import list_presets
    presets = set(list_presets("strategies"))
    specs = []
    for item in [s.strip() for s in items.split(",") if s.strip()] + ([preset] if preset else []):
        if item in STRATEGIES:
            specs.append(RunSpec(item, item, None))
        elif item in presets or item.endswith(".toml"):
            specs.append(RunSpec(Path(item).stem, None, item))
        else:
            raise BadInput(f"unknown strategy or preset {item!r} (strategies: {', '.join(STRATEGIES)}; "
                           f"presets: {', '.join(sorted(presets))})")
    if not any(s.strategy == "ar" for s in specs):
        specs.insert(0, RunSpec("ar", "ar", None))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise BadInput(f"a strategy is listed twice: {','.join(labels)}")
    return specs


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(result: RunResult, baseline: RunResult) -> str:
    k = first_difference(baseline.token_ids, result.token_ids)
    return "yes" if k is None else f"no (token {k})"


def rows(results: dict[str, RunResult]) -> list[dict]:
    """One row per run: the numbers the table, --json and reports show (all from footers/events)."""
    base = results["ar"]
    out = []
    for label, r in results.items():
        f = r.footer
        verified = any(e["t"] in ("accept", "reject") for e in r.events)
        out.append({"label": label, "strategy": r.header["strategy"], "params": r.header["params"],
                    "n_tokens": f["n_tokens"], "forwards": f["forwards"], "tpf": f["tpf"],
                    "accept_rate": f["accept_rate"] if verified else None, "tok_s": f["tok_s"],
                    "speed_vs_ar": f["tok_s"] / base.footer["tok_s"] if base.footer["tok_s"] else None,
                    "identical_to_ar": first_difference(base.token_ids, r.token_ids) is None,
                    "first_difference": first_difference(base.token_ids, r.token_ids),
                    "stop_reason": f["stop_reason"], "text": f["text"]})
    return out


def render_table(table_rows: list[dict], sampled: bool):
    from rich.table import Table
    t = Table(title="compare", title_justify="left")
    for col in ("strategy", "tokens", "forwards", "TPF", "accept", "tok/s", "× ar", "same as ar"):
        t.add_column(col, justify="left" if col in ("strategy", "same as ar") else "right")
    for r in table_rows:
        same = "yes" if r["identical_to_ar"] else f"no (token {r['first_difference']})"
        acc = "—" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
        speed = "—" if r["speed_vs_ar"] is None else f"{r['speed_vs_ar']:.2f}×"
        t.add_row(r["label"], str(r["n_tokens"]), str(r["forwards"]), f"{r['tpf']:.2f}", acc,
                  f"{r['tok_s']:.1f}", speed, same)
    if sampled:
        t.caption = "sampled runs: lossless strategies match ar in distribution, not token for token"
    return t


def run_compare(engine, prompt: str, prompt_ids: list[int], specs: list[RunSpec], make_run, trace_dir=None,
                progress=None) -> dict[str, RunResult]:
    """Run each spec one after another. `make_run(spec) -> (Strategy, Settings)`; `progress(label, event)`."""
    results = {}
    for spec in specs:
        strategy, settings = make_run(spec)
        path = str(Path(trace_dir) / f"{spec.label}.jsonl") if trace_dir else None
        sinks = [lambda e, label=spec.label: progress(label, e)] if progress else []
        results[spec.label] = Session(engine, strategy, settings).run(prompt, prompt_ids, sinks=sinks,
                                                                      trace_path=path)
    return results

"""`train eval`: what an adapter buys on the held-out prompts, every strategy against `ar` in one process.

Greedy, interleaved per prompt (ar first, then each strategy), after one warm-up round. Per strategy:
TPF (all tokens / all forwards), acceptance overall and by draft position, decode tok/s and its ratio to
ar's (pooled, and the median of per-prompt ratios), prompts whose output is identical to its reference's, and
token agreement (the share of the reference's tokens that the run reproduces at the same position). A run's
reference is `ar` on the model it decodes (`studio.run.compare`): for r-isd on an adapter of every row, the
base model, whose `ar` run then joins the table. On an adapter that makes the model bidirectional (`train mdm`)
no `ar` reference runs: `ar` runs on the base model, and the canvas runs are measured against it (another model).
A strategy that plans its drafts runs with `drafting="fixed"`, and one that can copy drafts from its context with
`lookup=0`, unless told otherwise (`measuring_every_slot`): the adapter's acceptance by slot is what is measured, a
cost-aware run would leave slots undrafted and a looked-up draft is not the adapter's.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from studio.run.compare import make_runs, rows as compare_rows
from studio.run.config import RunConfig
from studio.run.session import drive, encode_prompt
from studio.events.metrics import Tally, tok_per_s

# the runs that can use an adapter of each recipe (train_state.json's kind and gate)
RUNS_FOR = {("idlm", "mask"): "r-isd", ("idlm", "all"): "isd,r-isd", ("block", "mask"): "blockdiff,s2d2,simsd",
            ("block", "all"): "blockdiff,s2d2,simsd", ("mdm", "all"): "canvas"}
EVERY_MASK_STRATEGY = "isd,r-isd,blockdiff,s2d2,simsd"


def default_runs(adapter_dir: str | Path) -> str:
    """The strategies an adapter was trained for (all MASK-reading ones when it was not trained here)."""
    f = Path(adapter_dir) / "train_state.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))["config"]
        return RUNS_FOR[(cfg["kind"], cfg["gate"])]
    except (OSError, ValueError, KeyError, TypeError):
        return EVERY_MASK_STRATEGY


@dataclass
class Pooled:
    """One strategy's runs over the prompts: their events counted together, timing and agreement with ar."""
    tally: Tally = field(default_factory=Tally)
    decode_s: float = 0.0
    identical: int = 0
    agree: int = 0               # tokens equal to ar's at the same position
    ar_tokens: int = 0
    ratios: list[float] = field(default_factory=list)   # per-prompt tok/s ÷ ar tok/s

    @property
    def tok_s(self) -> float:
        return tok_per_s(self.tally.decoded, self.decode_s)


# what each run measuring the adapter's own drafts is given, where its strategy has the parameter and the user did
# not set it
MEASURING = {"drafting": "fixed", "lookup": 0}


def measuring_every_slot(configs: Mapping[str, RunConfig]) -> dict[str, RunConfig]:
    """`configs` with every strategy drafting each slot from the adapter alone (`MEASURING`), where not told
    otherwise."""
    out = {}
    for label, c in configs.items():
        params = c.build()[0].params
        unset = {k: v for k, v in MEASURING.items() if hasattr(params, k) and k not in c.params}
        out[label] = dataclasses.replace(c, params={**c.params, **unset}) if unset else c
    return out


def evaluate(engine, prompts: list[str], configs: Mapping[str, RunConfig], progress=None) -> dict:
    """Returns {model, adapter, prompts, max_new_tokens, rows: [...]} (rows: ar first, as `compare_configs` puts
    it; the runs greedy)."""
    max_new_tokens = configs["ar"].build()[1].max_new_tokens
    if engine.config.attention != "causal":   # an adapter made it bidirectional (train mdm): ar runs on the base model
        configs = {**configs, "ar": dataclasses.replace(configs["ar"], adapter="none")}
    ids = [encode_prompt(engine, p) for p in prompts]
    for run in make_runs(engine, prompts[0], ids[0][:16], configs).values():   # warm-up, not counted
        drive([run])
    pooled: dict[str, Pooled] = {}   # the configs' runs and the references they need (see studio.run.compare)
    for i, prompt in enumerate(prompts):
        results = {}
        for label, run in make_runs(engine, prompt, ids[i], configs).items():   # one at a time: timed alone
            drive([run])
            results[label] = run.result
            if progress and label in configs:
                progress(i, label)
        for row in _with_references(compare_rows(results), results):
            t, f = pooled.setdefault(row["label"], Pooled()), results[row["label"]].footer
            reference = results[row["reference"]].token_ids
            t.tally.feed_all(results[row["label"]].events)
            t.decode_s += f["wall_s"] - f["prefill_s"]
            t.identical += row["identical_to_reference"]
            t.agree += sum(a == b for a, b in zip(reference, row["token_ids"]))
            t.ar_tokens += len(reference)
            if row["speed_vs_ar"] is not None:
                t.ratios.append(row["speed_vs_ar"])
    ar_rate = pooled["ar"].tok_s
    reference_of = {row["label"]: row["reference"] for row in _with_references(compare_rows(results), results)}
    rows = []
    for label, t in pooled.items():
        acc = t.tally.acceptance
        first = results[label].header   # the last prompt's run: its strategy and parameters are every prompt's
        rows.append({"label": label, "strategy": first["strategy"], "params": first["params"],
                     "tokens": t.tally.n_tokens, "forwards": t.tally.forwards, "tpf": t.tally.tpf,
                     "accept_rate": acc.rate if acc.verified else None, "accept_by_slot": acc.by_pos,
                     "tok_s": t.tok_s, "speed_vs_ar": t.tok_s / ar_rate if ar_rate else 0.0,
                     "speed_vs_ar_median": statistics.median(t.ratios) if t.ratios else None,
                     "reference": reference_of[label], "identical_prompts": t.identical,
                     "token_agreement": t.agree / max(1, t.ar_tokens)})
    return {"model": engine.name, "adapter": engine.adapter, "prompts": prompts, "max_new_tokens": max_new_tokens,
            "rows": rows}


def _with_references(table: list[dict], results: dict) -> list[dict]:
    """The compare rows, a row whose reference could not run (no ar decodes a bidirectional model) measured
    against the `ar` baseline on the base model instead, and labelled so."""
    out = []
    for row in table:
        if row["reference"] not in results:
            row = {**row, "reference": "ar", "identical_to_reference": row["identical_to_ar"]}
        out.append(row)
    return out


def render(report: dict) -> str:
    """The eval table as Markdown (the form the README and the adapters' README use)."""
    n = len(report["prompts"])
    head = "| strategy | TPF | accept | accept by slot | tok/s | × ar | identical (to) | token agreement |\n" \
           "|---|---|---|---|---|---|---|---|\n"
    lines = []
    for r in report["rows"]:
        acc = "—" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
        slots = " ".join("—" if x is None else f"{x:.2f}" for x in r["accept_by_slot"]) or "—"
        lines.append(f"| {r['label']} | {r['tpf']:.2f} | {acc} | {slots} | {r['tok_s']:.1f} | "
                     f"{r['speed_vs_ar']:.2f}× | {r['identical_prompts']}/{n} ({r['reference']}) | "
                     f"{r['token_agreement']:.1%} |")
    return head + "\n".join(lines)

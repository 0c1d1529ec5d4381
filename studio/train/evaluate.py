"""`train eval`: what an adapter buys on the held-out prompts, every strategy against `ar` in one process.

Greedy, interleaved per prompt (ar first, then each strategy), after one warm-up round. Per strategy:
TPF (all tokens / all forwards), acceptance overall and by draft position, decode tok/s and its ratio to
ar's (pooled, and the median of per-prompt ratios), prompts whose output is identical to ar's, and token
agreement (the share of ar's tokens that the run reproduces at the same position).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from studio.run.compare import RunSpec, first_difference
from studio.run.session import Session, encode_prompt
from studio.events.metrics import Tally, tok_per_s

# the runs that can use an adapter of each recipe (train_state.json's kind and gate)
RUNS_FOR = {("idlm", "mask"): "r-isd", ("idlm", "all"): "isd,r-isd", ("block", "mask"): "blockdiff,s2d2,simsd",
            ("block", "all"): "blockdiff,s2d2,simsd"}
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


def evaluate(engine, prompts: list[str], specs: list[RunSpec], max_new_tokens: int = 128, progress=None) -> dict:
    """Returns {model, adapter, prompts, max_new_tokens, rows: [...]} (rows: ar first)."""
    from studio.run.config import RunConfig

    runs = {s.label: RunConfig(s.strategy, preset=s.preset, max_new_tokens=max_new_tokens, temperature=0.0).build()
            for s in specs}
    ids = [encode_prompt(engine, p) for p in prompts]
    for label, (strategy, settings) in runs.items():      # warm-up, not counted
        Session(engine, strategy, settings).run(prompts[0], ids[0][:16])
    pooled = {label: Pooled() for label in runs}
    for i, prompt in enumerate(prompts):
        ar_ids, ar_tok_s = None, None
        for label, (strategy, settings) in runs.items():
            r = Session(engine, strategy, settings).run(prompt, ids[i])
            t, f = pooled[label], r.footer
            t.tally.feed_all(r.events)
            t.decode_s += f["wall_s"] - f["prefill_s"]
            if ar_ids is None:
                ar_ids, ar_tok_s = r.token_ids, f["tok_s"]
            t.identical += first_difference(ar_ids, r.token_ids) is None
            t.agree += sum(a == b for a, b in zip(ar_ids, r.token_ids))
            t.ar_tokens += len(ar_ids)
            if ar_tok_s:
                t.ratios.append(f["tok_s"] / ar_tok_s)
            if progress:
                progress(i, label)
    ar_rate = pooled[specs[0].label].tok_s
    rows = []
    for label, t in pooled.items():
        acc = t.tally.acceptance
        rows.append({"label": label, "strategy": runs[label][0].name, "params": runs[label][0].header_params(),
                     "tokens": t.tally.n_tokens, "forwards": t.tally.forwards, "tpf": t.tally.tpf,
                     "accept_rate": acc.rate if acc.verified else None, "accept_by_slot": acc.by_pos,
                     "tok_s": t.tok_s, "speed_vs_ar": t.tok_s / ar_rate if ar_rate else 0.0,
                     "speed_vs_ar_median": statistics.median(t.ratios) if t.ratios else None,
                     "identical_prompts": t.identical, "token_agreement": t.agree / max(1, t.ar_tokens)})
    return {"model": engine.name, "adapter": engine.adapter, "prompts": prompts, "max_new_tokens": max_new_tokens,
            "rows": rows}


def render(report: dict) -> str:
    """The eval table as Markdown (the form the README and the adapters' README use)."""
    n = len(report["prompts"])
    head = "| strategy | TPF | accept | accept by slot | tok/s | × ar | identical | token agreement |\n" \
           "|---|---|---|---|---|---|---|---|\n"
    lines = []
    for r in report["rows"]:
        acc = "—" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
        slots = " ".join("—" if x is None else f"{x:.2f}" for x in r["accept_by_slot"]) or "—"
        lines.append(f"| {r['label']} | {r['tpf']:.2f} | {acc} | {slots} | {r['tok_s']:.1f} | "
                     f"{r['speed_vs_ar']:.2f}× | {r['identical_prompts']}/{n} | {r['token_agreement']:.1%} |")
    return head + "\n".join(lines)

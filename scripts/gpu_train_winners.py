"""The GPU campaign's verdicts (scripts/gpu-train.sh): which new adapters beat the shipped ones.

Reads DIR/eval-NAME.out (the new adapter's `train eval --json`) and DIR/eval-NAME-shipped.out (the shipped one's, on
the same held-out prompts). A new adapter wins when its strategies' mean TPF is higher and it is as exact: no fewer
outputs identical to their reference on any strategy, and (canvas, which makes no exactness promise) a token
agreement no more than a point lower. With nothing shipped to beat, it wins when every output equals its reference.
Winners are packed (`train pack`, bf16: an adapter, or a DFlash drafter in its published layout) as
DIR/winners/<shipped name>; DIR/winners.md has the table.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SHIPPED_AS = {"risd": ("smollm2-risd", "r-isd"), "jacobi": ("smollm2-jacobi", "jacobi,jacobi-mr"),
              "mdm": ("smollm2-mdm", "canvas"), "tc": ("smollm2-mdm", "canvas"), "isd": ("smollm2-isd", "isd"),
              "block": ("smollm2-block", "blockdiff,s2d2,simsd"), "dflash": ("smollm2-dflash", "dflash")}
CANVAS = ("canvas",)


def summary(report: dict) -> dict:
    rows = [r for r in report["rows"] if r["label"] != "ar" and not r["label"].startswith("ar ·")]
    return {"tpf": sum(r["tpf"] for r in rows) / max(1, len(rows)), "n": len(report["prompts"]),
            "rows": {r["label"]: r for r in rows}}


def verdict(new: dict, old: dict | None) -> tuple[bool, str]:
    for label, r in new["rows"].items():
        canvas = r["strategy"] in CANVAS
        if old is None:
            if not canvas and r["identical_prompts"] < new["n"]:
                return False, f"{label}: {r['identical_prompts']}/{new['n']} identical to {r['reference']}"
            continue
        before = old["rows"].get(label)
        if before is None:
            continue
        if canvas and r["token_agreement"] < before["token_agreement"] - 0.01:
            return False, f"{label}: agreement {r['token_agreement']:.1%} < {before['token_agreement']:.1%}"
        if not canvas and r["identical_prompts"] < before["identical_prompts"]:
            return False, f"{label}: {r['identical_prompts']} identical < {before['identical_prompts']}"
    if old is not None and new["tpf"] <= old["tpf"]:
        return False, f"TPF {new['tpf']:.2f} <= shipped {old['tpf']:.2f}"
    return True, f"TPF {new['tpf']:.2f}" + ("" if old is None else f" > shipped {old['tpf']:.2f}")


def main(root: Path) -> int:
    lines = ["| adapter | new TPF | shipped TPF | verdict |", "|---|---|---|---|"]
    best: dict[str, tuple[float, str]] = {}
    for name, (shipped, strategies) in SHIPPED_AS.items():
        f = root / f"eval-{name}.out"
        if not f.is_file() or not f.read_text().strip():
            continue
        new = summary(json.loads(f.read_text()))
        g = root / f"eval-{name}-shipped.out"
        old = summary(json.loads(g.read_text())) if g.is_file() and g.read_text().strip() else None
        won, why = verdict(new, old)
        was = "—" if old is None else f"{old['tpf']:.2f}"
        lines.append(f"| {name} | {new['tpf']:.2f} | {was} | {'wins' if won else 'kept the shipped one'}: {why} |")
        if won and new["tpf"] > best.get(shipped, (0.0, ""))[0]:
            best[shipped] = (new["tpf"], name)
    for shipped, (_, name) in best.items():
        out = root / "winners" / shipped
        if out.exists():
            continue
        subprocess.run([sys.executable, "-m", "studio", "train", "pack", str(root / name), str(out), "--strategies",
                        SHIPPED_AS[name][1], "--description", f"{shipped}: trained by scripts/gpu-train.sh"],
                       check=True)
    (root / "winners.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

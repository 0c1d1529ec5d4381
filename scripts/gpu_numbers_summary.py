"""One screen of `make gpu-numbers`: reads the steps' outputs in DIR, writes DIR/summary.json and prints a table;
`--readme README.md` puts the table between the README's `<!-- gpu-numbers -->` markers. Steps that did not run or
failed are listed as such; a number is never made up for them.

    python scripts/gpu_numbers_summary.py gpu-numbers [--readme README.md]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import date
from pathlib import Path

# nominal HBM bandwidth in TB/s by the device name CUDA reports (vendor data sheets)
NOMINAL_TBPS = {"H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100": 3.35, "A100-SXM4-80GB": 2.039,
                "A100 80GB PCIe": 1.935, "A100": 1.555, "L40S": 0.864, "GH200": 4.0, "B200": 8.0}
MARKERS = ("<!-- gpu-numbers -->", "<!-- /gpu-numbers -->")


def nominal_tbps(device: str) -> float | None:
    return next((tb for name, tb in NOMINAL_TBPS.items() if name in device), None)


def load(dir: Path, name: str):
    path = dir / name
    if not path.exists() or not path.stat().st_size:
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def row(report: dict | None, label: str) -> dict | None:
    if report is None:
        return None
    return next((s for s in report["strategies"] if s["label"] == label), None)


def median(stat) -> float | None:
    return None if stat is None else stat["median"]


def summarise(dir: Path, device: str, copy_gbps: float | None) -> dict:
    steps = {}
    for line in (dir / "steps.txt").read_text().splitlines() if (dir / "steps.txt").exists() else []:
        name, _, what = line.partition(": ")
        if what:
            steps[name] = what
    nominal = nominal_tbps(device)
    out = {"date": date.today().isoformat(), "device": device, "nominal_tbps": nominal, "copy_gbps": copy_gbps,
           "steps": steps}
    tests = (dir / "cuda-tests.txt").read_text() if (dir / "cuda-tests.txt").exists() else ""
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tests))
    out["cuda_tests"] = counts or None
    ar = {}
    for variant, name in (("bf16", "ar.json"), ("compiled", "ar-compiled.json"), ("int8", "ar-int8.json"),
                          ("fp8", "ar-fp8.json")):
        report = load(dir, name)
        tok_s = median(row(report, "ar")["tok_s"]) if row(report, "ar") else None
        if tok_s is None:
            continue
        gbps = tok_s * report["model"]["step_bytes"] / 1e9
        ar[variant] = {"tok_s": tok_s, "step_gb": report["model"]["step_bytes"] / 1e9, "gbps": gbps,
                       "share_of_nominal": gbps / (nominal * 1e3) if nominal else None,
                       "share_of_copy": gbps / copy_gbps if copy_gbps else None}
    if "bf16" in ar:
        for v in ar.values():
            v["x_bf16"] = v["tok_s"] / ar["bf16"]["tok_s"]
    out["ar"] = ar
    isd = row(load(dir, "isd-oracle-0.85.json"), "isd-n4")   # the paper's layout: drafting fixed, its ideal TPF known
    if isd:
        speed, tpf = median(isd["speedup_vs_ar"]), median(isd["tpf"])
        out["isd"] = {"tpf": tpf, "ideal_tpf": isd["expected_tpf"], "x_ar": speed,
                      "of_ideal": speed / isd["expected_tpf"] if isd["expected_tpf"] else None}
    moe = load(dir, "moe-forwards.json")
    if moe:
        out["moe"] = {"model": moe["name"], "step_vs_dense": moe.get("moe_step_vs_dense"),
                      "layer_vs_dense": moe.get("moe_layer_vs_dense"), "graphs": moe.get("graphs")}
    canvas = load(dir, "canvas-dual.json")
    if canvas:
        dual = row(canvas, "fast-dllm-dual")
        twin = next((s for s in canvas["strategies"] if s["label"].startswith("fast-dllm-dual ·")), None)
        if dual and twin:
            out["canvas"] = {"model": canvas["model"]["name"], "dual_tok_s": median(dual["tok_s"]),
                             "no_cache_tok_s": median(twin["tok_s"]),
                             "x_no_cache": median(dual["tok_s"]) / median(twin["tok_s"]),
                             "same_as_no_cache": dual.get("exact_match_vs_reference")}
    forwards = load(dir, "forwards.json")
    if forwards:
        out["forwards"] = {f["shape"]: f["ratio"] for f in forwards["forwards"]}
        out["cost_table"] = forwards.get("by_rows")
    out["concurrency"] = {}
    for path in sorted(dir.glob("concurrency-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        report = load(dir, path.name)
        if report:
            out["concurrency"][path.stem.split("-")[1]] = {s["label"]: median(s["tok_s"]) for s in report["strategies"]}
    return out


def pct(x) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def table(s: dict) -> list[str]:
    lines = ["| what | measured |", "|---|---|"]
    t = s["cuda_tests"]
    lines.append(f"| CUDA-marked tests | {', '.join(f'{n} {k}' for k, n in t.items()) if t else 'did not run'} |")
    bw = (f"nominal {s['nominal_tbps']} TB/s" if s["nominal_tbps"] else "nominal unknown") + \
        (f", copy {s['copy_gbps'] / 1e3:.2f} TB/s" if s["copy_gbps"] else "")
    for variant, a in s["ar"].items():
        versus = f" ({a['x_bf16']:.2f}× bf16)" if variant != "bf16" and "x_bf16" in a else ""
        lines.append(f"| AR {variant}, batch 1, CUDA graphs | **{a['tok_s']:.0f} tok/s**{versus}: "
                     f"{a['step_gb']:.1f} GB a step at {a['gbps']:.0f} GB/s = {pct(a['share_of_nominal'])} of nominal, "
                     f"{pct(a['share_of_copy'])} of copy ({bw}) |")
    if not s["ar"]:
        lines.append("| AR | did not run |")
    if "isd" in s:
        i = s["isd"]
        lines.append(f"| ISD N=4, `--oracle-accept 0.85` | TPF {i['tpf']:.2f} (ideal {i['ideal_tpf']:.2f}), "
                     f"**{i['x_ar']:.2f}× ar** = {i['of_ideal']:.2f} of the ideal TPF |")
    if "moe" in s and s["moe"]["step_vs_dense"]:
        m = s["moe"]
        lines.append(f"| MoE step, {m['model']}{' under graphs' if m['graphs'] else ' eager'} | "
                     f"**{m['step_vs_dense']:.2f}×** a dense step of its active width |")
    if "canvas" in s:
        c = s["canvas"]
        lines.append(f"| canvas `fast-dllm-dual`, {c['model']} | {c['dual_tok_s']:.0f} tok/s = "
                     f"**{c['x_no_cache']:.2f}×** its `cache=none` twin ({c['no_cache_tok_s']:.0f} tok/s) |")
    if "forwards" in s:
        f = s["forwards"]
        lines.append("| forwards × the 1-token step | " + "; ".join(f"{k} {v:.2f}×" for k, v in f.items()) + " |")
    if s["concurrency"]:
        lines.append("| concurrency (tok/s) | " + "; ".join(
            f"{c}: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()) for c, r in s["concurrency"].items()) + " |")
    not_run = [f"{k} ({v})" for k, v in s["steps"].items() if not v.startswith("rc 0")]
    if not_run:
        lines.append(f"| steps that failed or did not run | {'; '.join(not_run)} |")
    return lines


def write_readme(readme: Path, s: dict, lines: list[str]) -> None:
    text = readme.read_text()
    start, end = MARKERS
    if start not in text or end not in text:
        sys.exit(f"{readme}: no {start} ... {end} markers to put the table between")
    head = f"{s['date']}, {s['device']}, `make gpu-numbers` (scripts/gpu-numbers.sh), summary.json:"
    body = "\n".join([start, head, "", *lines, end])
    readme.write_text(text[:text.index(start)] + body + text[text.index(end) + len(end):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--readme", type=Path, help="put the table into this README between its markers")
    args = parser.parse_args()
    summary_path = args.dir / "summary.json"
    if args.readme and summary_path.exists():   # a summary made on the GPU machine, brought back
        s = json.loads(summary_path.read_text())
    else:
        device, copy_gbps = "no CUDA device", None
        try:
            import torch
            if torch.cuda.is_available():
                from studio.engine.forward_cost import copy_bandwidth
                device, copy_gbps = torch.cuda.get_device_name(), copy_bandwidth(torch.device("cuda"))
        except ImportError:
            pass
        s = summarise(args.dir, device, copy_gbps)
        summary_path.write_text(json.dumps(s, indent=1))
    lines = table(s)
    print("\n".join(lines))
    if args.readme:
        write_readme(args.readme, s, lines)


if __name__ == "__main__":
    main()

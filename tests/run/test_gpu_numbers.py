"""scripts/gpu-numbers.sh (make gpu-numbers) as a dry run on the CPU -- the decoding steps' commands exist and write
what the summary reads, a scheme the device lacks is one line, a step past the run's budget is skipped (the `bench
forwards` steps are left out: their command is tests/run/test_bench.py's, and calibrating costs a minute here) -- and
scripts/gpu_numbers_summary.py on a run's outputs: the bandwidth shares, the ratios the targets are read from, and
the README's table between its markers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_numbers_summary as summary  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-numbers")
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "DIR": str(tmp / "out"), "TOKENS": "8",
           "MODEL": "random:smollm2-135m@1", "STEP_TIMEOUT": "300", "STEPS": "ar int8 fp8 isd"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-numbers.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    return tmp / "out", r


def test_the_steps_run_on_the_cpu_and_the_summary_reads_them(dry_run):
    out, r = dry_run
    steps = (out / "steps.txt").read_text()
    for name in ("ar", "ar-int8", "isd-oracle-0.85"):
        assert f"{name}: rc 0" in steps, (steps, r.stdout[-3000:])
    assert "ar-fp8: rc 2" in steps and "--quant fp8 needs an NVIDIA GPU" in (out / "ar-fp8.log").read_text()
    assert r.returncode == 1 and "1 step(s) failed" in steps   # the exit status counts the failed steps
    s = json.loads((out / "summary.json").read_text())
    assert set(s["ar"]) == {"bf16", "int8"} and s["ar"]["int8"]["step_gb"] < s["ar"]["bf16"]["step_gb"] / 3
    assert s["isd"]["ideal_tpf"] == pytest.approx(2.58, abs=0.01) and s["isd"]["tpf"] > 1
    assert "| AR int8, batch 1, CUDA graphs |" in r.stdout and "ar-fp8 (rc 2" in r.stdout


def test_the_shares_and_ratios_are_read_against_the_card_and_the_readme_takes_the_table(dry_run, tmp_path):
    out, _ = dry_run
    forwards = {"name": "random:llada2-mini", "graphs": True, "moe_step_vs_dense": 1.6, "moe_layer_vs_dense": 3.0,
                "forwards": [{"shape": "1-token step", "ratio": 1.0}, {"shape": "7-token extend", "ratio": 1.1}],
                "by_rows": {"plain_ms": [9.0, 9.5]}}
    (out / "moe-forwards.json").write_text(json.dumps(forwards))   # the shape bench forwards --json gives
    (out / "forwards.json").write_text(json.dumps(forwards))
    s = summary.summarise(out, "NVIDIA H200", copy_gbps=4000.0)
    assert s["moe"]["step_vs_dense"] == 1.6 and s["forwards"]["7-token extend"] == 1.1 and s["cost_table"]
    bf16 = s["ar"]["bf16"]
    assert s["nominal_tbps"] == 4.8 and bf16["share_of_nominal"] == pytest.approx(bf16["gbps"] / 4800)
    assert bf16["share_of_copy"] == pytest.approx(bf16["gbps"] / 4000) and s["ar"]["int8"]["x_bf16"] > 0
    assert s["isd"]["of_ideal"] == pytest.approx(s["isd"]["x_ar"] / s["isd"]["ideal_tpf"])
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{summary.MARKERS[0]}\nold table\n{summary.MARKERS[1]}\nafter\n")
    summary.write_readme(readme, s, summary.table(s))
    text = readme.read_text()
    assert "old table" not in text and "NVIDIA H200" in text and text.endswith("after\n")
    assert "of nominal" in text and text.count(summary.MARKERS[0]) == 1


def test_a_step_past_the_run_s_budget_is_skipped_and_listed(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "DIR": str(tmp_path), "BUDGET": "0",
           "STEPS": "ar isd"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-numbers.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    steps = (tmp_path / "steps.txt").read_text()
    assert r.returncode == 0 and "ar: skipped" in steps and "isd-oracle-0.85: skipped" in steps
    assert "ar (skipped" in r.stdout   # the summary lists it

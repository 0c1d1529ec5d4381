"""scripts/gpu-train.sh (make gpu-train) end to end on the CPU, on a one-layer random model of the embedded model's
shape with a one-minute training budget: every stage runs, leaves a loadable adapter, is evaluated, and the exact
ones are packed as winners."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studio.engine.lora import read_adapter

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_the_gpu_campaign_runs_every_stage_on_the_cpu(tmp_path):
    out = tmp_path / "campaign"
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "DTYPE": "fp32", "DIR": str(out),
           "MODEL": "random:smollm2-135m@1", "SHIPPED": "0", "N_PROMPTS": "8", "MAX_NEW": "24", "DATA_BATCH": "8",
           "BATCH": "2", "N_EVAL": "1", "EVAL_NEW": "16", "JACOBI_BLOCK": "8", "CANVAS": "16",
           "SECONDS_PER_STAGE": "30 10 10 10 10 10 10 10", "STEPS_PER_STAGE": "3 3 3 2 2 2 3", "DFLASH_TAPS": "0"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-train.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    steps = (out / "steps.txt").read_text()
    assert r.returncode == 0, (steps, r.stdout[-3000:], r.stderr[-3000:])
    for name in ("data", "risd", "jacobi", "mdm", "tc", "isd", "block", "dflash", "eval-risd", "eval-jacobi",
                 "eval-tc", "eval-dflash", "winners"):
        assert f"{name}: rc 0" in steps, steps
    assert json.loads((out / "data" / "manifest.json").read_text())["shard_sizes"] == [8]
    for name in ("risd", "jacobi", "mdm", "tc", "isd", "block"):
        state = json.loads((out / name / "train_state.json").read_text())
        assert state["step"] >= 1, name
        read_adapter(out / name)
    assert json.loads((out / "tc" / "train_state.json").read_text())["config"]["init"] == str(out / "mdm")
    report = json.loads((out / "eval-risd.out").read_text())
    assert [row["label"] for row in report["rows"]] == ["ar", "r-isd"]
    table = (out / "winners.md").read_text()
    assert "| risd |" in table and "| jacobi |" in table
    assert (out / "winners" / "smollm2-risd" / "adapter_model.safetensors").is_file()   # r-isd is exact by design
    assert json.loads((out / "dflash" / "train_state.json").read_text())["step"] >= 1
    assert [row["label"] for row in json.loads((out / "eval-dflash.out").read_text())["rows"]] == ["ar", "dflash"]
    assert (out / "winners" / "smollm2-dflash" / "model.safetensors").is_file()   # exact by design, nothing shipped

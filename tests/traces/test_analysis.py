"""`trace analyze` (studio.traces.analysis): every table on a trace made by hand, the target entropy the verifier
records on the real path, and the CLI's JSON and HTML page (opened in Chromium where it is installed)."""
from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
import torch
from typer.testing import CliRunner

from studio.cli import app
from studio.events import Trace, forward, make
from studio.traces import analysis
from tests.support.dlm import full_forward_row, generate
from tests.support.tiny import tiny_engine


def _fwd(step, rows, ms, role="verify"):
    return forward(step, 0.0, role=role, n_tokens=rows, lora_rows=0, wall_ms=ms)


def _emit(step, pos, ms=0.0):
    return make("emit", step, ms, pos=pos, tok=[5] * len(pos), text="x" * len(pos))


HAND = Trace(header={"strategy": "isd", "params": {}}, footer={"n_tokens": 6, "forwards": 3, "tpf": 2.0}, events=[
    _fwd(0, 9, 40.0, "prefill"), _emit(0, [0], 50.0),
    # step 1: slots 1-2 accepted (entropies 0.1, 0.7), slot 3 rejected (entropy 3.0)
    _fwd(1, 4, 20.0), make("accept", 1, 60.0, pos=[1, 2], tok=[1, 2], p=[1.0, 1.0], q=[0.9, 0.3], h=[0.1, 0.7]),
    make("reject", 1, 60.0, pos=3, tok=4, p=0.0, q=0.5, h=3.0), _emit(1, [1, 2, 3], 70.0),
    # step 2: one draft at position 17 rejected, no entropy recorded; an extend then commits the correction
    _fwd(2, 2, 10.0), make("reject", 2, 80.0, pos=17, tok=4, p=0.0, q=0.99),
    _fwd(2, 1, 5.0, "extend"), _emit(2, [4], 90.0),
    _fwd(3, 1, 5.0, "extend"), _emit(3, [5], 100.0)])


def test_the_tables_of_a_trace_made_by_hand():
    a = analysis.analyze(HAND)
    assert (a["verified"], a["accepted"], a["rate"]) == (4, 2, 0.5)
    assert [(r["slot"], r["verified"], r["accepted"]) for r in a["by_slot"]] == [(1, 2, 1), (2, 1, 1), (3, 1, 0)]
    assert [(r["from"], r["verified"], r["accepted"]) for r in a["by_position"]] == [(0, 3, 2), (16, 1, 0)]
    entropy = {r["from"]: (r["verified"], r["accepted"]) for r in a["by_entropy"]}
    assert entropy[0.0] == (1, 1) and entropy[0.5] == (1, 1) and entropy[2.0] == (1, 0)
    assert sum(r["verified"] for r in a["by_entropy"]) == 3                 # the draft without h is in no bin
    confidence = {r["from"]: (r["verified"], r["accepted"]) for r in a["by_confidence"]}
    assert confidence[0.8] == (1, 1) and confidence[0.2] == (1, 1) and confidence[0.4] == (1, 0)
    assert confidence[0.95] == (1, 0) and a["by_confidence"][-1]["to"] == 1.0
    assert a["by_role"] == {"verify": {"forwards": 1, "rows": 4, "tokens": 3, "tpf": 3.0},
                            "extend": {"forwards": 3, "rows": 4, "tokens": 2, "tpf": 2 / 3}}
    t = a["time"]
    assert [(r["rows"], r["forwards"], r["total_ms"]) for r in t["by_rows"]] == [(1, 2, 10.0), (2, 1, 10.0),
                                                                                (4, 1, 20.0)]
    assert t["forward_ms"] == 40.0 and t["decode_ms"] == 50.0 and t["other_ms"] == 10.0
    assert a["calibration"] is None                                          # nothing was unmasked


def test_calibration_counts_the_last_fill_of_each_position_against_the_reference():
    events = [make("unmask", 1, 0.0, pos=[0, 1, 2], tok=[7, 8, 9], conf=[0.95, 0.6, 0.4]),
              make("remask", 2, 0.0, pos=[2], tok=[0]), make("unmask", 3, 0.0, pos=[2], tok=[3], conf=[0.99])]
    reference = [make("emit", 1, 0.0, pos=[0, 1, 2], tok=[7, 1, 3], text="abc")]
    rows = {r["confidence"]: r for r in analysis.calibration(events, [7, 1, 3])}
    assert (rows[0.5]["filled"], rows[0.5]["right"]) == (3, 2)                # 0.95 right, 0.6 wrong, 0.99 right
    assert (rows[0.9]["filled"], rows[0.9]["right"]) == (2, 2) and rows[0.99]["share"] == 1.0
    trace = Trace(header={"strategy": "canvas"}, footer=None, events=events)
    for strategy in ("canvas", "ar"):      # its own exact twin, or ar: the exact output of every lossless rule
        ref = Trace(header={"strategy": strategy}, footer=None, events=reference)
        assert analysis.analyze(trace, ref)["calibration"] == analysis.calibration(events, [7, 1, 3])
    other = Trace(header={"strategy": "jacobi-mr"}, footer=None, events=reference)
    assert analysis.analyze(trace, other)["calibration"] is None     # another rule's run is no reference


def test_the_verifier_records_the_target_entropy_of_each_verified_position():
    """Greedy jacobi on a tiny model: each accept/reject's h is the entropy of a plain causal forward's next-token
    law at that position (the raw logits' softmax)."""
    engine = tiny_engine("llama", vocab=16)
    prompt = [1, 2, 3, 1, 2]
    r = generate(engine, "jacobi", {"block_size": 4}, prompt=prompt, n=16)
    checked = 0
    for e in r.events:
        if e["t"] not in ("accept", "reject"):
            continue
        positions, hs = (e["pos"], e["h"]) if e["t"] == "accept" else ([e["pos"]], [e["h"]])
        for pos, h in zip(positions, hs):
            ids = prompt + list(r.token_ids[:pos])
            logp = torch.log_softmax(full_forward_row(engine.model, ids).float(), -1)
            assert h == pytest.approx(float(-(logp.exp() * logp).sum()), abs=1e-4)
            checked += 1
    assert checked >= 3


def test_trace_analyze_json_and_a_page_chromium_opens(tmp_path):
    engine = tiny_engine("llama", vocab=16)
    generate(engine, "jacobi", {"block_size": 4}, n=16, trace=str(tmp_path / "jacobi.jsonl"))
    generate(engine, "ar", n=16, trace=str(tmp_path / "ar.jsonl"))
    files = [str(tmp_path / "ar.jsonl"), str(tmp_path / "jacobi.jsonl")]
    page = tmp_path / "analysis.html"
    res = CliRunner().invoke(app, ["trace", "analyze", *files, "--json", "--html", str(page)])
    assert res.exit_code == 0, (res.output, res.exception)
    got = {d["label"]: d for d in map(json.loads, res.stdout.splitlines())}
    assert got["ar"]["verified"] == 0 and got["jacobi"]["verified"] > 0 and got["jacobi"]["by_entropy"]
    assert sum(r["verified"] for r in got["jacobi"]["by_slot"]) == got["jacobi"]["verified"]
    html = page.read_text()
    for title in ("Acceptance by draft slot", "Acceptance by position in the answer", "Acceptance by the target",
                  "Acceptance by the draft", "Calibration of the unmasking confidence", "Tokens per forward by the",
                  "Forward time by row count", "Where the decode time went"):   # (apostrophes are escaped)
        assert title in html, title
    assert "<script" not in html
    text = CliRunner().invoke(app, ["trace", "analyze", *files]).stdout
    assert "jacobi (" in text and "by entropy:" in text
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed: the page was checked as text only")
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<svg") == 8 and "Acceptance by the target" in dom
    assert math.isfinite(got["jacobi"]["time"]["forward_ms"])


def test_an_empty_chart_keeps_its_title_whole_and_says_why_below_it():
    """A set of traces without a diffusion run has no calibration to draw: the reason is a line of its own (it had
    been appended to the title, which a narrow panel then cut)."""
    import re
    from studio.viz.analysis_figures import grouped_bars
    svg = grouped_bars("Calibration of the unmasking confidence", "c", "share", [], [],
                       empty="no unmasked tokens, or no reference run")
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    assert texts[:2] == ["Calibration of the unmasking confidence", "no unmasked tokens, or no reference run"]

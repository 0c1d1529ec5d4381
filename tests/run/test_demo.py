"""The demo's canvas row: a strategy that decodes no AR model runs where an adapter is shipped for it (smollm2-mdm on
the default model), decoding that other model, and is shown against `ar` on the base model, labelled so."""
from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from studio.presets import shipped
from studio.run.demo import demo_configs, run_demo
from studio.train.trainable import Trainable
from tests.support.tiny import tiny_engine


def test_the_default_model_s_demo_has_a_canvas_row_and_other_models_not():
    on_default = demo_configs(None, 64)
    assert list(on_default)[-1] == "canvas-cpu" and on_default["canvas-cpu"].build()[0].name == "canvas"
    assert "canvas-cpu" not in demo_configs(None, 64, "tiny-llama")   # nothing shipped for canvas there


@pytest.fixture
def mdm_shipped(tmp_path, monkeypatch):
    """presets/adapters stand-in: an (untrained) adapter declaring bidirectional attention, shipped for canvas on
    the tiny model."""
    engine = tiny_engine("llama", vocab=16)
    engine.model.config = engine.config = dataclasses.replace(engine.config, mask_token_id=None)
    path = tmp_path / "tiny-mdm"
    Trainable(engine.model, r=2, alpha=4).save(path, adapted_rows="all", attention="bidirectional")
    (path / shipped.META).write_text('model = "tiny-llama"\nstrategies = ["canvas"]\n')
    monkeypatch.setattr(shipped, "ADAPTERS_DIR", tmp_path)
    shipped._entries.cache_clear()
    yield tiny_engine("llama", vocab=16)
    shipped._entries.cache_clear()


def test_the_demo_runs_canvas_on_the_shipped_mdm_adapter_against_ar_on_the_base_model(mdm_shipped, tmp_path):
    console = Console(width=160, record=True)
    out = run_demo(mdm_shipped, "abcab", "isd,canvas-cpu", max_new_tokens=8, trace_dir=tmp_path / "tr", html=False,
                   console=console, err_console=Console(file=io.StringIO()))
    twin = "canvas-cpu · cache=none"   # the cached canvas run's exact reference, beside it
    assert list(out["results"]) == ["ar", "isd", "isd · fixed", "canvas-cpu", twin]   # no ar reference for a
    # bidirectional model
    rows = {r["label"]: r for r in out["rows"]}
    cached, exact = rows["canvas-cpu"], rows[twin]
    assert cached["reference"] == twin and cached["identical_to_reference"] is not None
    assert exact["reference"] == "ar · tiny-mdm" and exact["identical_to_reference"] is None
    header = out["results"][twin].header
    assert header["model"]["adapter_name"] == "tiny-mdm" and header["strategy"] == "canvas"
    assert header["params"]["cache"] == "none" and out["results"]["canvas-cpu"].header["params"]["cache"] == "dual"
    assert out["results"]["ar"].header["model"]["adapter"] is None
    text = console.export_text()
    assert "— (ar · tiny-mdm did not run)" in text
    k = exact["first_difference"]
    against = "identical to ar on the base model" if k is None else f"differs from ar on the base model at token {k}"
    labels = f"{twin}, canvas-cpu" if cached["identical_to_reference"] else twin
    assert f"── {labels} (decodes tiny-mdm, bidirectional: no ar run on it; {against}" in text
    if not cached["identical_to_reference"]:
        assert f"── canvas-cpu (differs from {twin} at token {cached['reference_first_difference']}):" in text

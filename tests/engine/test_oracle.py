"""bench --oracle-accept: accept decisions become Bernoulli(P) draws for every verifying strategy (they all
verify through DecodeContext.verify); measured acceptance and TPF against P and the closed form; the report."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
from typer.testing import CliRunner

from studio.cli import app
from studio.engine.engine import Engine
from studio.engine.sampling import SamplingParams
from studio.engine.strategies import make_strategy
from studio.engine.strategies.isd import expected_tpf
from studio.errors import BadInput
from studio.run.session import Settings, run_to_end
from tests.support.tiny import tiny_dlm, tiny_engine


def oracle_run(engine, name, params, p, n, temperature=0.0, seed=0):
    s = Settings(max_new_tokens=n, sampling=SamplingParams(temperature), seed=seed, oracle_accept=p)
    return run_to_end(engine, make_strategy(name, params), s, "", [1, 2, 3])


def verdicts(result) -> tuple[int, int]:
    """(accepted, rejected) drafts over a run."""
    accepted = sum(len(e["pos"]) for e in result.events if e["t"] == "accept")
    return accepted, sum(e["t"] == "reject" for e in result.events)


@pytest.mark.parametrize("name, params, make", [
    ("isd", {"stride": 4}, tiny_engine), ("r-isd", {"stride": 3}, tiny_engine),
    ("jacobi", {"block_size": 4}, tiny_engine), ("jacobi-mr", {"block_size": 4, "pool_size": 2}, tiny_engine),
    ("s2d2", {"policy": "always", "cache": "causal"}, tiny_dlm), ("simsd", {}, tiny_dlm)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_oracle_one_accepts_every_verified_draft(name, params, make, temperature):
    r = oracle_run(make(), name, params, 1.0, 24, temperature)
    accepted, rejected = verdicts(r)
    assert accepted > 0 and rejected == 0 and r.footer["accept_rate"] == 1.0
    assert r.header["params"]["oracle_accept"] == 1.0   # a trace made under the oracle says so


@pytest.mark.parametrize("stride, p", [(4, 0.5), (6, 0.8)])
def test_oracle_acceptance_and_tpf_follow_p(stride, p):
    """Over a long run: the accepted share of verified drafts is within binomial bounds of P, and the measured
    TPF is ISD's closed form (2 + P + ... + P^(N-2)) / (2 - P^(N-1))."""
    engine = tiny_engine()
    engine.model.config = engine.config = dataclasses.replace(engine.config, max_seq_len=2048)
    r = oracle_run(engine, "isd", {"stride": stride, "drafting": "fixed"}, p, 1200)
    accepted, rejected = verdicts(r)
    n = accepted + rejected
    assert n > 500 and abs(accepted / n - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert r.footer["tpf"] == pytest.approx(expected_tpf(p, stride), rel=0.05)
    assert make_strategy("isd", {"stride": stride, "drafting": "fixed"}).expected_tpf(p) == expected_tpf(p, stride)
    assert make_strategy("isd", {"stride": stride}).expected_tpf(p) is None   # auto: the draft count varies


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """`dlm-studio bench` in-process on a tiny engine, two prompts, one repeat, no transformers."""
    engine = tiny_engine()
    monkeypatch.setattr(Engine, "load", staticmethod(lambda spec, adapter=None, **kw: engine))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc\npon\n")

    def invoke(*args):
        return CliRunner().invoke(app, ["bench", "--prompts", str(prompts), "--no-transformers", "--repeats", "1",
                                        "--warmup", "0", "--max-new-tokens", "12", *args])
    return invoke


def test_bench_oracle_reports_expected_tpf_and_no_agreement(bench, tmp_path):
    fixed = tmp_path / "isd-fixed.toml"   # the closed form is fixed drafting's; auto plans its draft count
    fixed.write_text('strategy = "isd"\n[params]\nstride = 4\ndrafting = "fixed"\n[sampling]\ntemperature = 0.0\n')
    res = bench("-s", f"{fixed},isd,jacobi", "--oracle-accept", "0.5", "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(res.stdout)
    by = {s["label"]: s for s in rep["strategies"]}
    assert rep["oracle_accept"] == 0.5
    assert by["isd-fixed"]["expected_tpf"] == pytest.approx(expected_tpf(0.5, 4))
    assert by["ar"]["expected_tpf"] is None and by["jacobi"]["expected_tpf"] is None and by["isd"]["expected_tpf"] is None
    assert [by[k]["exact_match_vs_ar"] for k in ("ar", "isd-fixed", "jacobi")] == [1.0, None, None]
    html = tmp_path / "bench.html"
    res = bench("-s", str(fixed), "--oracle-accept", "0.5", "--html", str(html))
    assert res.exit_code == 0, (res.output, res.exception)
    assert "TPF expected" in res.stdout and "1.47" in res.stdout and "oracle acceptance 0.5" in res.stdout
    assert "TPF expected" in html.read_text()


def test_bench_without_the_oracle_reports_agreement_and_no_expectation(bench):
    rep = json.loads(bench("-s", "isd", "--json").stdout)
    assert rep["oracle_accept"] is None
    assert all(s["expected_tpf"] is None and s["exact_match_vs_ar"] is not None for s in rep["strategies"])
    assert "TPF expected" not in bench("-s", "isd").stdout


@pytest.mark.parametrize("p", ["0", "1.5"])
def test_bench_oracle_out_of_range_is_bad_input(bench, p):
    res = bench("-s", "isd", "--oracle-accept", p)
    assert isinstance(res.exception, BadInput) and "--oracle-accept must be in (0, 1]" in str(res.exception)

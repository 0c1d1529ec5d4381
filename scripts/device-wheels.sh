#!/usr/bin/env bash
# Wheels for a GPU machine whose Python has torch, Triton and transformers but not the rest of what `python -m studio`
# and the CUDA tests import (the 'cuda' image used in 2026-11 lacks these). Downloads this venv's versions of
# them for CPython 3.12 on x86-64 into .whl/ (git-ignored through .git/info/exclude); there, before
# `PYTHON=python3 scripts/gpu-numbers.sh`:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Found by running the CUDA tests' collection and every gpu-numbers step on the CPU with an import hook that refused
# every package the image's list lacks.
set -euo pipefail
PACKAGES="typer pydantic pydantic_core typing-inspection annotated-types platformdirs gguf rich typing_extensions"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=$(.venv/bin/pip list --format=freeze 2>/dev/null | python3 -c '
import sys
want = {n.lower().replace("_", "-") for n in sys.argv[1].split()}
for line in sys.stdin:
    name, _, version = line.strip().partition("==")
    if name.lower().replace("_", "-") in want:
        print(f"{name}=={version}")' "$PACKAGES")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
ls .whl

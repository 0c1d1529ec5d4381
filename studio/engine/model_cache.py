"""Where converted models live (`cache_dir()`), and finding a trace's tokenizer there. Torch-free, so a
replay that only reads a trace can show token texts without loading a model."""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/dlm-studio/models`, else the platform's user cache dir + `/models`."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "dlm-studio" / "models"
    import platformdirs
    return Path(platformdirs.user_cache_dir("dlm-studio")) / "models"


def trace_token_text(header: Mapping[str, Any]) -> Callable[[int], str] | None:
    """The token texts of the tokenizer a trace header names, when this machine has it: a model directory named
    by the header, or a cached conversion (the embedded model, any GGUF loaded here) whose tokenizer has the
    header's name and vocabulary size. None otherwise: a replay then knows only the texts the trace emitted."""
    tok = header.get("tokenizer") or {}
    name, vocab = tok.get("name"), tok.get("vocab_size")
    model = (header.get("model") or {}).get("name")
    if not isinstance(name, str) or not name:
        return None
    found = _find_tokenizer(name, vocab if isinstance(vocab, int) else None, model if isinstance(model, str) else "")
    return found.token_text if found is not None else None


@lru_cache(maxsize=8)
def _find_tokenizer(name: str, vocab: int | None, model: str):
    from studio.engine.tokenizer import Tokenizer
    from studio.errors import BadInput
    model_dir = Path(model).expanduser()
    candidates = [model_dir] if model and model_dir.is_dir() else []
    root = cache_dir()
    if root.is_dir():   # read only the small config of each entry, and load the tokenizer of a match
        candidates += sorted(d for d in root.iterdir() if _named(d) == name)
    for d in candidates:
        try:
            tok = Tokenizer.from_dir(d)
        except (BadInput, OSError, ValueError):
            continue
        if tok.name == name and (vocab is None or tok.vocab_size <= vocab):
            return tok
    return None


def _named(d: Path) -> str | None:
    """The tokenizer name our cache wrote in `d` (None when unreadable), to skip loading the wrong ones."""
    try:
        return json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("name")
    except (OSError, ValueError, AttributeError):
        return None

"""Writing files safely: what every command that writes a trace, a report or an export uses.

- `check_writable(path, force)` before any work: an existing file is a one-line BadInput unless `force`, and
  a missing directory fails at once (not after a model load and a long run).
- `atomic_write(path)` / `atomic_path(path)` for whole files (exports, reports): the content goes to a
  temporary name in the same directory, is fsynced and renamed into place (`os.replace`), so the final name
  holds either the old file or the complete new one; an exception or Ctrl+C removes the temporary file.
  (Traces are not written this way: they grow line by line so that an interrupted run leaves a truncated
  trace the reader can still read.)
- `safe_name(text)` for names that become file names (strategy, preset or run names): never a path.
- `Interrupted`: Ctrl+C after a command kept what it could; `studio.cli.main` prints its message, exit 130.
"""
from __future__ import annotations

import os
import re
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from studio.errors import BadInput


class Interrupted(Exception):
    """The user interrupted a command (Ctrl+C) that has saved what it could; the message says what was kept.
    Not a KeyboardInterrupt on purpose: Typer would turn that into a silent exit and lose the message."""


def read_user_text(path: str | os.PathLike, what: str) -> str:
    """A file the user named, as UTF-8 text; BadInput saying which `what` ("prompts file") could not be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise BadInput(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def check_writable(path: str | os.PathLike, force: bool = False) -> Path:
    """`path` can be written: its directory exists and it is not an existing file (unless `force`) nor a
    directory. Call it before any work, so that a clash never costs a run. Returns `path` as a Path."""
    path = Path(path)
    if path.is_dir():
        raise BadInput(f"{path} is a directory")
    if path.exists() and not force:
        raise BadInput(f"{path} exists; add --force to overwrite")
    parent = path.parent
    if not parent.is_dir():
        raise BadInput(f"{path}: cannot write: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"{path}: cannot write: permission denied in {parent}")
    return path


def _temp_name(path: Path) -> Path:
    # hidden, in the same directory (same file system: os.replace is atomic), unique per writer
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path next to `path` for a writer that wants a file name (pyarrow, safetensors);
    on success the file is fsynced and renamed to `path`, on any exception (Ctrl+C included) removed.
    OSError (no directory, no permission, disk full) becomes a one-line BadInput."""
    path = Path(path)
    tmp = _temp_name(path)
    try:
        try:
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            raise BadInput(f"{path}: cannot write: {e.strerror or e}") from None
    except BaseException:
        _unlink(tmp)
        raise
    _fsync_dir(path.parent)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8",
                 newline: str | None = None) -> Iterator[IO]:
    """`open(path, mode)` for a whole new file, made atomic: see `atomic_path`. The file is created with
    the usual permissions (0666 less the umask), never 0600 as `tempfile` would."""
    if "w" not in mode or "+" in mode:
        raise ValueError(f"atomic_write writes a new file: mode 'w' or 'wb', not {mode!r}")
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        binary = "b" in mode
        with open(fd, mode, encoding=None if binary else encoding, newline=None if binary else newline) as f:
            yield f
            f.flush()


def safe_name(text: str, fallback: str = "run", max_len: int = 80) -> str:
    """A file name made of `text`: letters, digits, '-', '_' and '.' kept, every run of anything else (a '/',
    a NUL, a space) one '-'; no leading or trailing '.' or '-' (so never '.', '..', a hidden file or an
    option-like name); `fallback` when nothing is left. Always one path component in the directory it joins:
    '../../x' -> 'x', '/etc/passwd' -> 'etc-passwd'."""
    name = re.sub(r"[^\w.-]+", "-", str(text))[:max_len].strip(".-")
    return name or fallback

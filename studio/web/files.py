"""Files in and out of the page: uploaded traces (size-limited, read by the trace reader and nothing else)
and downloads of a run (JSONL, Parquet, Perfetto, HTML report) written into the app's own temp folder."""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

from studio.errors import BadInput
from studio.events import Trace, TraceWriter, read_trace
from studio.files import atomic_path, safe_name
from studio.traces.export import export

MAX_UPLOAD_BYTES = 20 * 2**20
DOWNLOADS = {"JSONL trace": "jsonl", "Parquet": "parquet", "Perfetto": "perfetto", "HTML report": "html"}
_SUFFIX = {"jsonl": ".jsonl", "parquet": ".parquet", "perfetto": ".perfetto.json", "html": ".html"}


def read_upload(path: str | os.PathLike, limit: int = MAX_UPLOAD_BYTES) -> tuple[str, Trace]:
    """(file name, trace) of an uploaded file; BadInput naming the file (not the server's temp path)."""
    path = Path(path)
    size = path.stat().st_size
    if size > limit:
        raise BadInput(f"{path.name}: {size / 2**20:.1f} MB is over the {limit / 2**20:.0f} MB upload limit")
    try:
        return path.name, read_trace(path, allow_truncated=True)
    except BadInput as e:
        raise BadInput(str(e).replace(str(path), path.name)) from None


class Downloads:
    """A temp folder for the files the page offers, removed with the app."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dlm-studio-web-"))
        weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)

    def write(self, trace: Trace, fmt: str, stem: str) -> Path:
        """`trace` as `fmt` (a value of DOWNLOADS) in a folder of its own (names never clash between tabs)."""
        out = Path(tempfile.mkdtemp(dir=self.root)) / (safe_name(stem, max_len=60) + _SUFFIX[fmt])
        if fmt == "jsonl":
            with atomic_path(out) as tmp, TraceWriter(tmp, trace.header) as writer:
                for e in trace.events:
                    writer.write(e)
                writer.close(trace.footer)   # a truncated trace stays truncated
        else:
            export(trace, fmt, out)           # atomic too (studio.traces.export)
        return out

    def folder(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self.root))

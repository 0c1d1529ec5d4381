"""Where a Ctrl+C must wait. The CLI raises KeyboardInterrupt at once, except while a module is being imported or a
function marked `@uninterruptible` runs: C libraries garble an interrupt raised in Python code they call (torch
imports numpy from C and carries on without it; safetensors turns it into "could not determine the shape of object
type 'torch.storage.UntypedStorage'", which read as a corrupt file). There it is held until the code is over
(`studio.cli._hold_interrupts`)."""
from __future__ import annotations

from types import CodeType, FrameType

_MARKED: set[CodeType] = set()


def uninterruptible(fn):
    """A Ctrl+C inside `fn` (C code calling back into Python) is held until `fn` returns."""
    _MARKED.add(fn.__code__)
    return fn


def must_wait(frame: FrameType | None) -> bool:
    """Whether an interrupt arriving in `frame` must be held: an import or an @uninterruptible call is under way."""
    while frame is not None:
        if frame.f_code in _MARKED or frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False

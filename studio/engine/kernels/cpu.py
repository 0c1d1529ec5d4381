"""The CPU's decode-sized projection kernel (`skinny.c`): 1-4 rows through an fp32 weight, each weight row read once,
every row's result the same bits whatever the row count (docs/architecture.md#cpu-projections).

Compiled at first use with the machine's C compiler for this very CPU (`-march=native`) into the user cache, keyed by
the source, the compiler and the CPU, and loaded with ctypes: no build step at install, nothing to ship per
platform. Where no compiler works, or DLM_STUDIO_CPU_KERNEL=0, `skinny()` is None and the projections keep torch's
kernels (`studio.engine.kernels.projection.linear`). DLM_STUDIO_CPU_ISA=x86-64-v3 (or x86-64-v2, or any `-march` name) builds it
for that baseline instead of this CPU: the instructions a user's machine without AVX-512 runs, tested on this one."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from studio.engine.model_cache import cache_dir
from studio.errors import BadInput

MAX_ROWS = 4   # the kernel's register blocking: past it the loads of x bound the kernel, and oneDNN is as fast
# int8 weights: a quarter of fp32's bytes, so the loads of x bind later and the kernel keeps every decode-sized
# forward (no packed copy to fall back on)
INT8_MAX_ROWS = 16
MAX_RANK = 64  # lora_rows keeps a row's low-rank activations on the stack
SOURCE = Path(__file__).with_name("skinny.c")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


def _flags() -> list[str]:
    """The compiler's flags: for this CPU, or for the baseline DLM_STUDIO_CPU_ISA names."""
    isa = os.environ.get("DLM_STUDIO_CPU_ISA", "native")
    if not isa.replace("-", "").replace("_", "").isalnum():
        raise BadInput(f"DLM_STUDIO_CPU_ISA must be an -march name (native, x86-64-v3, x86-64-v2), got {isa!r}")
    return [f"-march={isa}", *FLAGS]


def _cpu_id() -> str:
    """What the binary is built for: the CPU's model and flags (a cache shared between machines must not hand one
    CPU's instructions to another)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        fields = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(fields))
    except OSError:
        return platform.processor() or platform.machine()


def _build(cc: str) -> Path | None:
    source, flags = SOURCE.read_bytes(), _flags()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(), _cpu_id().encode(),
                                     sys.platform.encode()])).hexdigest()[:16]
    lib = cache_dir().parent / "kernels" / f"skinny-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.parent / f"{lib.name}.{os.getpid()}.tmp"
    done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(tmp)], capture_output=True, timeout=120)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        return None
    tmp.replace(lib)   # atomic: a second process never loads a half-written library
    return lib


@functools.cache
def _library():
    if os.environ.get("DLM_STUDIO_CPU_KERNEL", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path)) if path else None
    except (OSError, subprocess.SubprocessError):
        return None
    if lib is not None:
        lib.skinny.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
        lib.skinny.restype = None
        lib.skinny_i8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        lib.skinny_i8.restype = None
        lib.lora_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5 + [ctypes.c_float]
        lib.lora_rows.restype = None
    return lib


def available() -> bool:
    """Whether the kernel built and loaded here (it is built on the first call: ~0.2 s)."""
    return _library() is not None


def _fits(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can read the tensors by pointer: contiguous fp32 (a weight of another dtype beside fp32
    activations would be read as garbage)."""
    return all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors)


def skinny(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """x [R, D] @ w.T for 1 <= R <= MAX_ROWS, contiguous fp32 CPU tensors, as [R, N]; None where the kernel is not
    available or the operands do not fit it."""
    lib = _library()
    if lib is None or not 1 <= x.shape[0] <= MAX_ROWS or not _fits(w, x):
        return None
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    lib.skinny(w.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0], w.shape[1], x.shape[0], torch.get_num_threads())
    return y


def skinny_int8(w: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """x [R, D] @ (w * scale[:, None]).T for int8 w [N, D] with fp32 row scales [N], 1 <= R <= INT8_MAX_ROWS,
    contiguous CPU tensors, as [R, N]; None where the kernel is not available or the operands do not fit it. Rows go
    in blocks of 4, so a row's result is the same bits at every row count up to INT8_MAX_ROWS."""
    lib = _library()
    if (lib is None or not 1 <= x.shape[0] <= INT8_MAX_ROWS or w.dtype != torch.int8 or not w.is_contiguous()
            or not _fits(scale, x)):
        return None
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    lib.skinny_i8(w.data_ptr(), scale.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0], w.shape[1], x.shape[0],
                  torch.get_num_threads())
    return y


def lora_rows(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    """y += scale * (x @ a.T) @ b.T in place, for x [R, D] and y [R, N] (a run of gated rows), contiguous fp32 CPU
    tensors, y's rows maybe strided (a slice of a fused product); False (and y untouched) where the kernel is not
    available or the operands do not fit it."""
    lib = _library()
    if lib is None or a.shape[0] > MAX_RANK or not _fits(x, a, b) or y.dtype != torch.float32 or y.stride(-1) != 1:
        return False
    lib.lora_rows(x.data_ptr(), y.data_ptr(), a.data_ptr(), b.data_ptr(), x.shape[0], x.shape[1], y.shape[1],
                  a.shape[0], y.stride(0), scale)
    return True

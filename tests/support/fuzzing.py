"""Shared helpers for the property-based fuzzers of every file/string reader (tests/reliability/test_fuzz_*.py).

The property, for every reader and every input: a normal return (that passes the reader's own validity
check) or `studio.errors.BadInput` with a non-empty one-line message; never another exception, never a hang.

Profiles, chosen by the environment variable DLM_FUZZ:
  unset / "ci"  `make test`: derandomized (the same cases every run), bounded so that all fuzz tests
                together stay within about a minute on one core (>= 1,000 cases in all);
  "long"        `make fuzz`: 10x the examples of every test, random (a failure prints the blob to reproduce
                it), and a per-reader tally of outcomes at the end of the session.
Both: no example database and Hypothesis' caches under $TMPDIR (nothing is written into the repository),
a 2 s deadline per case (a slower case fails: a hang) and a hard 10 s alarm that interrupts a case which
never returns.

Seeds are valid inputs built in code (a tiny GGUF, a safetensors file, a PEFT adapter directory) or taken
from the repository (tests/support/fixtures/*.jsonl traces, studio/presets/*/*.toml); the mutation strategies below break
them: truncation, bit flips, splices, injected bytes, and structural edits that put a wrong type, a huge
integer, NaN/inf, non-UTF-8 bytes or deep nesting into one field. A failing input is also written to
$TMPDIR/dlm-fuzz-failures/ so a regression test can keep it literally.

Test modules load this file as a pytest plugin (`pytest_plugins = ["tests.support.fuzzing"]`) for the tally; it
is imported first as a plain module, hence PYTEST_DONT_REWRITE (its checks raise AssertionError themselves).
"""
from __future__ import annotations

import atexit
import copy
import hashlib
import json
import math
import os
import shutil
import signal
import struct
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
from hypothesis import HealthCheck, currently_in_test_context, note, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from studio.errors import BadInput

# ---------------------------------------------------------------------------------------------
# profiles
# ---------------------------------------------------------------------------------------------
# Hypothesis keeps caches (not examples: database=None below) in ./.hypothesis; keep even those out of the repo.
set_hypothesis_home_dir(str(Path(tempfile.gettempdir()) / "dlm-fuzz-hypothesis"))
PROFILE = os.environ.get("DLM_FUZZ") or "ci"
SCALE = {"ci": 1, "long": 10}
_COMMON = dict(deadline=2000, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much, HealthCheck.large_base_example])
settings.register_profile("ci", max_examples=30, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=300, derandomize=False, **_COMMON)
if PROFILE not in SCALE:
    raise RuntimeError(f"DLM_FUZZ={PROFILE!r}: use 'ci' (the default) or 'long'")
settings.load_profile(PROFILE)


def examples(n_ci: int) -> int:
    """`n_ci` examples under the ci profile, 10x that under long."""
    return n_ci * SCALE[PROFILE]


def fuzz(n_ci: int):
    """The settings decorator of one fuzz test: the loaded profile with `examples(n_ci)` cases."""
    return settings(max_examples=examples(n_ci))


# ---------------------------------------------------------------------------------------------
# the one assertion: a valid result or a one-line BadInput
# ---------------------------------------------------------------------------------------------
HARD_TIMEOUT_S = 10
TALLY: dict[str, dict[str, float]] = defaultdict(lambda: {"cases": 0, "valid": 0, "BadInput": 0, "other": 0,
                                                          "slowest_s": 0.0})
FAILURES = Path(tempfile.gettempdir()) / "dlm-fuzz-failures"
_TMP = Path(tempfile.mkdtemp(prefix="dlm-fuzz-"))
atexit.register(shutil.rmtree, _TMP, True)
_counter = [0]


class Hang(BaseException):
    """Raised by the hard alarm inside a reader that does not return (a BaseException, so that a reader's
    `except Exception` cannot turn it into a BadInput; `_fired` catches even that)."""


_fired = [False]


def _alarm(signum, frame):
    _fired[0] = True
    raise Hang(f"no result after {HARD_TIMEOUT_S} s")


def case_path(name: str) -> Path:
    """A fresh path in the session's temp dir (new names, never rewritten in place: a GGUF or safetensors
    reader may still map the previous case's file)."""
    _counter[0] += 1
    return _TMP / f"{_counter[0]:06d}-{name}"


_previous: list[Path] = []


def write_case(name: str, data: bytes | dict[str, bytes]) -> Path:
    """Write one case: bytes -> a file, {file name: bytes} -> a directory of files. Returns the path.
    The previous case's file is removed (unlinked: safe even if it is still mapped), so a long run
    does not fill the temp dir."""
    while _previous:
        old = _previous.pop()
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    p = case_path(name)
    _previous.append(p)
    if isinstance(data, dict):
        p.mkdir()
        for fname, content in data.items():
            if content is not None:
                (p / fname).write_bytes(content)
    else:
        p.write_bytes(data)
    return p


def _show(data: Any, limit: int = 600) -> str:
    r = repr(data)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} chars in all)"


def _save(reader: str, data: Any) -> Path | None:
    """Keep a failing input where a regression test can be made from it."""
    try:
        FAILURES.mkdir(parents=True, exist_ok=True)
        if isinstance(data, dict) and all(isinstance(v, (bytes, type(None))) for v in data.values()):
            digest = hashlib.sha1(b"".join(v or b"" for v in data.values())).hexdigest()[:12]
            out = FAILURES / f"{reader}-{digest}"
            out.mkdir(exist_ok=True)
            for k, v in data.items():
                if v is not None:
                    (out / k).write_bytes(v)
            return out
        blob = data if isinstance(data, bytes) else repr(data).encode("utf-8", "backslashreplace")
        out = FAILURES / f"{reader}-{hashlib.sha1(blob).hexdigest()[:12]}.bin"
        out.write_bytes(blob)
        return out
    except OSError:
        return None


def check_reader(reader: str, call: Callable[[], Any], data: Any = None, *, names: tuple[str, ...] = (),
                 valid: Callable[[Any], None] | None = None) -> Any:
    """Run `call()` (one reader on one input) and return its result or the BadInput it raised.

    Accepted: a normal return for which `valid(result)` (if given) does not raise, or a BadInput whose
    message is non-empty, one line and (if `names` is given) contains one of `names` (the file it is
    about). Anything else fails the test with `data`, the input, attached (and saved under FAILURES).
    """
    tally = TALLY[reader]
    tally["cases"] += 1
    alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, HARD_TIMEOUT_S)
    _fired[0] = False
    t0 = time.perf_counter()
    outcome, problem, result = "valid", None, None
    try:
        result = call()
    except BadInput as e:
        outcome, result = "BadInput", e
        msg = str(e)
        if not msg.strip():
            problem = "BadInput with an empty message"
        elif "\n" in msg or "\r" in msg:
            problem = f"BadInput message is not one line: {msg[:300]!r}"
        elif names and not any(n in msg for n in names):
            problem = f"BadInput message names none of {names}: {msg[:300]!r}"
    except (Exception, Hang) as e:  # noqa: BLE001 -- the whole point: any other exception is a defect
        outcome, problem = "other", f"{type(e).__name__}: {str(e)[:300]!r}"
        result = e
    finally:
        elapsed = time.perf_counter() - t0
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    if _fired[0]:
        outcome, problem = "other", f"a hang: no result after {HARD_TIMEOUT_S} s (then {problem or outcome})"
    if outcome == "valid" and valid is not None:
        try:
            valid(result)
        except AssertionError as e:
            outcome, problem = "other", f"invalid result: {e}"
    tally["slowest_s"] = max(tally["slowest_s"], elapsed)
    if problem is not None:
        tally["other"] += 1
        saved = _save(reader, data)
        raise AssertionError(f"{reader}: {problem}\n  input: {_show(data)}\n  saved: {saved}") from (
            result if isinstance(result, BaseException) else None)
    tally[outcome] += 1
    if currently_in_test_context():
        note(f"{reader}: {outcome} in {elapsed * 1000:.1f} ms" + (f": {result}" if outcome == "BadInput" else ""))
    return result


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Under DLM_FUZZ=long: cases per reader and their outcomes."""
    if PROFILE != "long" or not TALLY:
        return
    tr = terminalreporter
    tr.section("fuzz outcomes per reader")
    tr.write_line(f"{'reader':<18} {'cases':>7} {'valid':>7} {'BadInput':>9} {'other':>6} {'slowest':>10}")
    total = 0
    for reader in sorted(TALLY):
        t = TALLY[reader]
        total += int(t["cases"])
        tr.write_line(f"{reader:<18} {int(t['cases']):>7} {int(t['valid']):>7} {int(t['BadInput']):>9} "
                      f"{int(t['other']):>6} {t['slowest_s'] * 1000:>8.1f}ms")
    tr.write_line(f"{'total':<18} {total:>7}")


# ---------------------------------------------------------------------------------------------
# byte-level mutations
# ---------------------------------------------------------------------------------------------
NON_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3", b"\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x00",
            b"\xef\xbb\xbf", b"\r", b"\n", b"\x1e", b"\xe2\x80\xa8"]


def _offset(n: int, focus: int = 0):
    """An offset in [0, n): uniform, or (half the time) inside the first `focus` bytes (the header)."""
    whole = st.integers(0, max(n - 1, 0))
    return st.one_of(st.integers(0, max(min(focus, n) - 1, 0)), whole) if focus else whole


@st.composite
def truncated(draw, seed: bytes, focus: int = 0) -> bytes:
    """`seed` cut at a random offset (the empty input included)."""
    return seed[:draw(_offset(len(seed) + 1, focus))]


@st.composite
def bit_flipped(draw, seed: bytes, focus: int = 0, max_flips: int = 8) -> bytes:
    """`seed` with 1..max_flips random bits flipped."""
    b = bytearray(seed)
    for _ in range(draw(st.integers(1, max_flips))):
        i = draw(_offset(len(b), focus))
        b[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(b)


@st.composite
def spliced(draw, seed: bytes, donors: tuple[bytes, ...] = (), focus: int = 0) -> bytes:
    """`seed` with a chunk of itself, of a donor or of non-UTF-8 bytes inserted, overwritten or deleted."""
    source = draw(st.sampled_from(("self", "donor", "bad") if donors else ("self", "bad")))
    if source == "bad":
        chunk = draw(st.sampled_from(NON_UTF8)) * draw(st.integers(1, 3))
    else:
        donor = seed if source == "self" else draw(st.sampled_from(donors))
        a = draw(st.integers(0, len(donor)))
        chunk = donor[a:a + draw(st.integers(0, 512))]
    at = draw(_offset(len(seed) + 1, focus))
    op = draw(st.sampled_from(("insert", "overwrite", "delete", "duplicate")))
    if op == "insert":
        return seed[:at] + chunk + seed[at:]
    if op == "overwrite":
        return seed[:at] + chunk + seed[at + len(chunk):]
    n = draw(st.integers(1, 64))
    if op == "delete":
        return seed[:at] + seed[at + n:]
    return seed[:at] + seed[at:at + n] * draw(st.integers(2, 4)) + seed[at + n:]


# ---------------------------------------------------------------------------------------------
# structural mutations of JSON / TOML documents
# ---------------------------------------------------------------------------------------------
class Raw(bytes):
    """Bytes that dump_json / dump_toml write verbatim: numbers Python cannot print, deep nesting, non-UTF-8."""

    def __repr__(self) -> str:
        return f"Raw({_show(bytes(self), 80)})"


DEPTHS = (64, 1000, 100_000)
_BIG_DIGITS = b"9" * 5000  # past Python's 4300-digit int/str conversion limit
_RAW_COMMON = [Raw(_BIG_DIGITS), Raw(b"-" + _BIG_DIGITS), Raw(b"1e999999"), Raw(b"-1e999999"), Raw(b"0." + _BIG_DIGITS)]
RAW_JSON = _RAW_COMMON + [Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"), Raw(b'"\xff\xfe"'), Raw(b'"\xed\xa0\x80"'),
                          Raw(b'"\\ud800"'), Raw(b'"a\\u0000b"')] + \
    [Raw(b"[" * d + b"]" * d) for d in DEPTHS] + [Raw(b'{"a":' * d + b"1" + b"}" * d) for d in DEPTHS]
RAW_TOML = _RAW_COMMON + [Raw(b"nan"), Raw(b"inf"), Raw(b"-inf"), Raw(b'"\xff\xfe"'), Raw(b"1979-05-27"),
                          Raw(b"1979-05-27T07:32:00Z"), Raw(b"07:32:00"), Raw(b"0x" + b"f" * 4000),
                          Raw(b"'''\nmulti\nline'''"), Raw(b'"\\u0000"')] + \
    [Raw(b"[" * d + b"]" * d) for d in DEPTHS] + [Raw(b"{a = " * d + b"1" + b"}" * d) for d in DEPTHS]
HUGE_INTS = [2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**60, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1, -2**63, -2**64,
             10**30, 10**308, 10**400, 0]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 0.5, -1.5]


def _nested(depth: int, fmt: str) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v] if fmt == "json" or depth % 2 else {"a": v}
    return v


def bad_values(fmt: str = "json"):
    """A value that may be the wrong type, out of range, non-finite, huge, deep or not even encodable: a
    family first (each equally likely), then a value of it."""
    raw = RAW_JSON if fmt == "json" else RAW_TOML
    scalars = st.one_of(st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
    families = {
        "wrong type": st.one_of(st.none() if fmt == "json" else st.booleans(), st.booleans(), st.text(max_size=20),
                                st.just([]), st.just({}), st.integers(-3, 3), st.floats(-2, 2)),
        "huge int": st.one_of(st.sampled_from(HUGE_INTS), st.integers()),
        "non-finite": st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats()),
        "raw": st.sampled_from([r for r in raw if not r.startswith((b"[[", b"{a"))]),
        "deep": st.one_of(st.sampled_from([r for r in raw if r.startswith((b"[[", b"{a"))]),
                          st.integers(1, 40).map(lambda d: _nested(d, fmt))),
        "string": st.one_of(st.sampled_from(["", " ", "x" * 100_000, "\n", "\x7f", "\u2028", "\x00"]),
                            st.text(max_size=20)),
        "container": st.one_of(st.lists(scalars, max_size=4),
                               st.dictionaries(st.text(max_size=6), scalars, max_size=3)),
    }
    return st.sampled_from(sorted(families)).flatmap(families.__getitem__)


def _paths(obj: Any, prefix: tuple = (), max_items: int = 3) -> list[tuple]:
    """Every path into `obj` (dict keys; of a list only the first and last few items)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,), max_items)
    elif isinstance(obj, list):
        idx = list(range(len(obj)))
        for i in sorted(set(idx[:max_items] + idx[-max_items:])):
            out += _paths(obj[i], prefix + (i,), max_items)
    return out


@st.composite
def mutated_doc(draw, doc: Any, fmt: str = "json", keys: tuple[str, ...] = (), root_ok: bool = True) -> Any:
    """A deep copy of `doc` with one node replaced by a bad value, deleted, or a (known or random) key added.
    `keys`: field names worth adding (the reader's own vocabulary)."""
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p or root_ok]
    path = draw(st.sampled_from(paths))
    op = draw(st.sampled_from(("replace", "replace", "delete", "add")))
    if op == "replace" or (op == "delete" and not path):
        value = draw(bad_values(fmt))
        if not path:
            return value
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = value
        return doc
    node = doc
    for k in path[:-1 if op == "delete" else None]:
        node = node[k]
    if op == "delete":
        del node[path[-1]]
    elif isinstance(node, dict):
        key = draw(st.sampled_from(keys) if keys and draw(st.booleans()) else st.text(max_size=8))
        node[key] = draw(bad_values(fmt))
    elif isinstance(node, list):
        node.insert(draw(st.integers(0, len(node))), draw(bad_values(fmt)))
    else:  # a scalar: replace it instead
        return draw(mutated_doc(doc, fmt, keys, root_ok)) if paths != [()] else draw(bad_values(fmt))
    return doc


def dump_json(obj: Any) -> bytes:
    """JSON bytes of `obj`, Raw values verbatim, non-finite floats as Python's NaN/Infinity tokens."""
    if isinstance(obj, Raw):
        return bytes(obj)
    if obj is None or isinstance(obj, bool):
        return {None: b"null", True: b"true", False: b"false"}[obj]
    if isinstance(obj, int):
        return str(obj).encode()
    if isinstance(obj, float):
        if math.isnan(obj):
            return b"NaN"
        return b"Infinity" if obj == math.inf else b"-Infinity" if obj == -math.inf else repr(obj).encode()
    if isinstance(obj, str):
        return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if isinstance(obj, (list, tuple)):
        return b"[" + b",".join(dump_json(v) for v in obj) + b"]"
    if isinstance(obj, dict):
        return b"{" + b",".join(dump_json(str(k)) + b":" + dump_json(v) for k, v in obj.items()) + b"}"
    raise TypeError(f"cannot dump {type(obj).__name__}")


def _toml_str(s: str) -> bytes:
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f").encode("utf-8", "surrogatepass")


def _toml_value(v: Any) -> bytes:
    if isinstance(v, Raw):
        return bytes(v)
    if isinstance(v, bool):
        return b"true" if v else b"false"
    if isinstance(v, int):
        return str(v).encode()
    if isinstance(v, float):
        if math.isnan(v):
            return b"nan"
        return b"inf" if v == math.inf else b"-inf" if v == -math.inf else repr(v).encode()
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return b"[" + b", ".join(_toml_value(x) for x in v) + b"]"
    if isinstance(v, dict):
        return b"{" + b", ".join(_toml_str(str(k)) + b" = " + _toml_value(x) for k, x in v.items()) + b"}"
    if v is None:
        return b'""'  # TOML has no null
    raise TypeError(f"cannot dump {type(v).__name__}")


def dump_toml(doc: Any) -> bytes:
    """TOML bytes of a document: one `key = value` line per top-level key, tables inline."""
    if not isinstance(doc, dict):
        return b"value = " + _toml_value(doc) + b"\n"
    return b"".join(_toml_str(str(k)) + b" = " + _toml_value(v) + b"\n" for k, v in doc.items())


# ---------------------------------------------------------------------------------------------
# GGUF: a writer that can also write what GGUFWriter refuses (wrong types, non-UTF-8, lying lengths)
# ---------------------------------------------------------------------------------------------
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
           U64: "<Q", I64: "<q", F64: "<d"}
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8
GGUF_ALIGN = 32


class _Out:
    """Bytes being written, and where every length/count/offset field went (for the lying-length family)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.fields: list[tuple[str, int, str]] = []   # (kind, offset, struct format) of each length-like field

    def put(self, fmt: str, v: Any, kind: str = "") -> None:
        if kind:
            self.fields.append((kind, len(self.buf), fmt))
        self.buf += struct.pack(fmt, v)

    def string(self, s: str | bytes, kind: str = "string length") -> None:
        b = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
        self.put("<Q", len(b), kind)
        self.buf += b

    def value(self, t: int, v: Any) -> None:
        if t == STR:
            self.string(v, "value string length")
        elif t == ARR and isinstance(v, Raw):
            self.buf += v  # a hand-made array body (deep nesting the recursive writer could not write)
        elif t == ARR:
            item_t, items = v
            self.put("<I", item_t, "array item type")
            self.put("<Q", len(items), "array length")
            for x in items:
                self.value(item_t, x)
        elif t in _SCALAR:
            self.put(_SCALAR[t], v)
        else:
            raise ValueError(f"unknown GGUF value type {t}")


def gguf_bytes(kv: list[tuple[str | bytes, int, Any]], tensors: list[tuple[str | bytes, list[int], int, bytes]],
               version: int = 3, offsets: list[int] | None = None) -> tuple[bytes, list[tuple[int, str]]]:
    """A GGUF file: `kv` = [(key, value type, value)] (an ARR value is (item type, items)), `tensors` =
    [(name, GGUF dims (fastest first), ggml type, data bytes)]. `offsets` overrides the tensor data offsets.
    Returns (bytes, the (kind, offset, format) of every length/count/type/offset field)."""
    out = _Out()
    out.buf += b"GGUF"
    out.put("<I", version)
    out.put("<Q", len(tensors), "tensor count")
    out.put("<Q", len(kv), "metadata count")
    for key, t, v in kv:
        out.string(key, "key length")
        out.put("<I", t, "value type")
        out.value(t, v)
    data = bytearray()
    for i, (name, dims, ggml_type, blob) in enumerate(tensors):
        out.string(name, "tensor name length")
        out.put("<I", len(dims), "tensor dimension count")
        for d in dims:
            out.put("<Q", d, "tensor dimension")
        out.put("<I", ggml_type, "tensor type")
        out.put("<Q", len(data) if offsets is None else offsets[i], "tensor offset")
        data += blob
        data += b"\0" * (-len(data) % GGUF_ALIGN)
    out.buf += b"\0" * (-len(out.buf) % GGUF_ALIGN)
    return bytes(out.buf + data), out.fields


TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "h", "e", "l", "o", "he", "ll", "hell", "hello", "Ġ"]
TINY_MERGES = ["h e", "l l", "he ll", "hell o"]


def tiny_gguf_spec(arch: str = "llama") -> tuple[list, list]:
    """(kv, tensors) of a valid tiny GGUF: 1 layer, dim 32, 4 heads (2 KV) of 8, ffn 32, a 12-token
    byte-level BPE vocabulary; the embedding is Q8_0, the others F16/F32 (three read paths)."""
    import gguf

    V, D, H, KV, HD, F = len(TINY_TOKENS), 32, 4, 2, 8, 32
    kv = [
        ("general.architecture", STR, arch), ("general.name", STR, "tiny"), ("general.alignment", U32, GGUF_ALIGN),
        (f"{arch}.block_count", U32, 1), (f"{arch}.context_length", U32, 256), (f"{arch}.embedding_length", U32, D),
        (f"{arch}.feed_forward_length", U32, F), (f"{arch}.attention.head_count", U32, H),
        (f"{arch}.attention.head_count_kv", U32, KV), (f"{arch}.rope.freq_base", F32, 10000.0),
        (f"{arch}.attention.layer_norm_rms_epsilon", F32, 1e-5), (f"{arch}.rope.dimension_count", U32, HD),
        (f"{arch}.vocab_size", U32, V),
        ("tokenizer.ggml.model", STR, "gpt2"), ("tokenizer.ggml.pre", STR, "smollm"),
        ("tokenizer.ggml.tokens", ARR, (STR, TINY_TOKENS)),
        ("tokenizer.ggml.token_type", ARR, (I32, [3, 3, 3] + [1] * (V - 3))),
        ("tokenizer.ggml.merges", ARR, (STR, TINY_MERGES)),
        ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.eos_token_id", U32, 2),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
        ("tokenizer.chat_template", STR, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
        # entries the reader ignores, there so that every kind of array (and its count) can be damaged
        ("tokenizer.ggml.scores", ARR, (F32, [0.0] * V)), ("general.tags", ARR, (STR, ["tiny", "fuzz"])),
        ("dlm.fuzz.bytes", ARR, (U8, [1, 2, 3])), ("dlm.fuzz.nested", ARR, (ARR, [(I32, [1, 2]), (BOOL, [True])])),
    ]
    rng = np.random.default_rng(0)

    def f16(*shape):
        return rng.standard_normal(shape).astype(np.float16).tobytes()

    def f32(*shape):
        return (rng.random(shape) + 0.5).astype(np.float32).tobytes()

    emb = gguf.quants.quantize(rng.standard_normal((V, D)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    tensors = [
        ("token_embd.weight", [D, V], GGML_Q8_0, emb.tobytes()),
        ("output_norm.weight", [D], GGML_F32, f32(D)),
        ("output.weight", [D, V], GGML_F16, f16(V, D)),
        ("blk.0.attn_norm.weight", [D], GGML_F32, f32(D)),
        ("blk.0.attn_q.weight", [D, H * HD], GGML_F16, f16(H * HD, D)),
        ("blk.0.attn_k.weight", [D, KV * HD], GGML_F16, f16(KV * HD, D)),
        ("blk.0.attn_v.weight", [D, KV * HD], GGML_F16, f16(KV * HD, D)),
        ("blk.0.attn_output.weight", [H * HD, D], GGML_F16, f16(D, H * HD)),
        ("blk.0.ffn_norm.weight", [D], GGML_F32, f32(D)),
        ("blk.0.ffn_gate.weight", [D, F], GGML_F16, f16(F, D)),
        ("blk.0.ffn_up.weight", [D, F], GGML_F16, f16(F, D)),
        ("blk.0.ffn_down.weight", [F, D], GGML_F16, f16(D, F)),
    ]
    return kv, tensors


def gguf_header_size(data: bytes) -> int:
    """Where the tensor data of a (valid) GGUF starts: mutations aimed at the header stay before it."""
    import gguf
    p = write_case("header.gguf", data)
    try:
        return int(gguf.GGUFReader(str(p)).data_offset)
    finally:
        p.unlink()


GGUF_VALUE_TYPES = st.sampled_from(range(13))


def gguf_values(depth: int = 0):
    """(type, value) pairs, valid or absurd, for a GGUF metadata entry."""
    def scalar(t: int):
        fmt = _SCALAR[t]
        if t == BOOL:
            return st.booleans()
        if t in (F32, F64):
            special = [x for x in SPECIAL_FLOATS if t == F64 or abs(x) < 3e38 or not math.isfinite(x)]
            return st.one_of(st.sampled_from(special), st.floats(width=32 if t == F32 else 64))
        bits = struct.calcsize(fmt) * 8
        lo, hi = (0, 2**bits - 1) if fmt[1].isupper() else (-2**(bits - 1), 2**(bits - 1) - 1)
        return st.one_of(st.sampled_from([lo, hi, 0, 1, 2, 3, 8]), st.integers(lo, hi))
    strings = st.one_of(st.text(max_size=12), st.sampled_from(NON_UTF8),
                        st.sampled_from(["llama", "qwen2", "gpt2", ""]),
                        st.just("x" * 70_000))
    options = [st.sampled_from(sorted(_SCALAR)).flatmap(lambda t: scalar(t).map(lambda v: (t, v))),
               strings.map(lambda s: (STR, s))]
    if depth < 3:
        options.append(st.sampled_from(sorted(_SCALAR) + [STR]).flatmap(
            lambda t: st.lists(scalar(t) if t != STR else strings, max_size=6).map(lambda xs: (ARR, (t, xs)))))
        options.append(gguf_values(depth + 1).map(lambda tv: (ARR, (tv[0], [tv[1]] * 2)) if tv[0] != ARR
                                                   else (ARR, (ARR, [tv[1]]))))
    return st.one_of(*options)


def deep_gguf_array(depth: int) -> tuple[int, Any]:
    """An ARR value nested `depth` arrays deep (each holding one array; a u8 at the bottom)."""
    return ARR, Raw(struct.pack("<IQ", ARR, 1) * depth + struct.pack("<IQB", U8, 1, 1))


# ---------------------------------------------------------------------------------------------
# safetensors: a writer from a header dict (so a structurally mutated header still gets a right length)
# ---------------------------------------------------------------------------------------------
def safetensors_bytes(header: Any, data: bytes, length: int | None = None) -> bytes:
    """8-byte little-endian header length (or `length`, a lie), the header JSON (space-padded to 8), data."""
    h = dump_json(header)
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def split_safetensors(blob: bytes) -> tuple[dict, bytes]:
    """(header dict, data bytes) of a valid safetensors file."""
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


SAFETENSORS_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2",
                      "U16", "U32", "U64", "C64", "F4", "F6_E2M3", "E8M0", "f32", "", "F32 ", "\u0000"]

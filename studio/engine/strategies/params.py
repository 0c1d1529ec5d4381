"""Typed parameters for strategies and policies: a dataclass of defaults, checked against user input."""
from __future__ import annotations

import dataclasses
import math
import sys

from studio.errors import BadInput


_MAX_FLOAT_INT = int(sys.float_info.max)


def _short(v) -> str:
    """repr(v), at most 60 characters (a value can be a huge number or a deep list)."""
    try:
        r = repr(v)
    except (ValueError, RecursionError):  # an int of 4300+ digits, a list nested too deep to print
        r = f"<{type(v).__name__}>"
    return r if len(r) <= 60 else r[:57] + "..."


def parse_params(owner: str, params_cls, params: dict):
    """Build `params_cls(**params)`, refusing unknown names and values of the wrong type (BadInput).
    Each field's type is its default's type; ints are accepted for floats, bools only for bools."""
    known = {f.name: f for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise BadInput(f"{owner} has no parameter {_short(unknown[0])} (parameters: {', '.join(known) or 'none'})")
    p = params_cls(**params)
    for f in known.values():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        value, expected = getattr(p, f.name), type(default)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > _MAX_FLOAT_INT:  # float() would raise OverflowError
                raise BadInput(f"{owner} parameter {f.name!r} must be finite, got {_short(value)}")
            setattr(p, f.name, float(value))
        elif not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise BadInput(f"{owner} parameter {f.name!r} must be {expected.__name__}, got {_short(value)}")
        # TOML ints (0xfff...) can have any size; none beyond int64 is a usable count or size
        if expected is int and not -2**63 <= value < 2**63:
            raise BadInput(f"{owner} parameter {f.name!r} is out of range, got {_short(value)}")
        if expected is float and not math.isfinite(getattr(p, f.name)):
            raise BadInput(f"{owner} parameter {f.name!r} must be finite, got {_short(value)}")
    return p

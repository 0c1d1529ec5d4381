"""Typed parameters for strategies and policies: a dataclass of defaults, checked against user input."""
from __future__ import annotations

import dataclasses
import math

from studio.errors import BadInput


def parse_params(owner: str, params_cls, params: dict):
    """Build `params_cls(**params)`, refusing unknown names and values of the wrong type (BadInput).
    Each field's type is its default's type; ints are accepted for floats, bools only for bools."""
    known = {f.name: f for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise BadInput(f"{owner} has no parameter {unknown[0]!r} (parameters: {', '.join(known) or 'none'})")
    p = params_cls(**params)
    for f in known.values():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        value, expected = getattr(p, f.name), type(default)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(p, f.name, float(value))
        elif not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise BadInput(f"{owner} parameter {f.name!r} must be {expected.__name__}, got {value!r}")
        if expected is float and not math.isfinite(getattr(p, f.name)):
            raise BadInput(f"{owner} parameter {f.name!r} must be finite, got {value!r}")
    return p

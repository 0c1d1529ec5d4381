"""Typed parameters for strategies and policies: a dataclass of defaults, checked against user input.

Each field is declared with `param`, which records what the interfaces say about it (help text, the values a
text field accepts, the role a UI shows it under); `param_specs` reads that back for the TUI and the web form.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

from studio.errors import BadInput


_MAX_FLOAT_INT = int(sys.float_info.max)

# Roles: the parameter a UI shows under a generic name, whatever the strategy calls it
N = "n"        # N: tokens per forward at best (isd's stride, the block size of jacobi and block diffusion)
TAU = "tau"    # τ: the acceptance or confidence threshold (isd's tau, block diffusion's threshold)
ROLE_LABELS = {N: "N", TAU: "τ"}


def param(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
          choices: tuple[str, ...] | None = None, role: str | None = None,
          tune: tuple[float, float] | list | bool | None = None) -> Any:
    """A `Params` field: its default (or `factory` for a mutable one) and its metadata. `choices`: the
    values a text field accepts (the strategy's validation must accept exactly these); `role`: N or TAU;
    `tune`: what `dlm-studio tune` searches -- (low, high) for a number, a list of the values a number may take
    (where only some in a range are valid: a block size that must divide the canvas), True for every choice."""
    if role is not None and role not in ROLE_LABELS:
        raise ValueError(f"unknown parameter role {role!r}")
    if (tune is True and not choices or isinstance(tune, tuple) and not tune[0] < tune[1]
            or isinstance(tune, list) and len(tune) < 2):
        raise ValueError(f"tune is (low, high) or a list of values for a number, or True for a parameter with "
                         f"choices, got {tune!r}")
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "role": role, "tune": tune}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ParamSpec:
    """What an interface shows of one parameter."""
    name: str
    kind: type                       # the default's type: int, float, bool, str or dict
    default: object
    help: str
    choices: tuple[str, ...] | None  # the values a text field accepts; None: any text (or not text)
    role: str | None                 # N, TAU or None
    tune: tuple[float, float] | list | bool | None   # what `tune` searches: a range, values, every choice, nothing


def param_specs(params_cls) -> tuple[ParamSpec, ...]:
    """The fields of a `Params` dataclass, with the metadata `param` gave them."""
    out = []
    for f in dataclasses.fields(params_cls):
        default = _default(f)
        out.append(ParamSpec(f.name, type(default), default, f.metadata.get("help", ""),
                             f.metadata.get("choices"), f.metadata.get("role"), f.metadata.get("tune")))
    return tuple(out)


def role_param(params_cls, role: str) -> str | None:
    """The name of the parameter with `role` (N or TAU), or None when the strategy has none."""
    return next((s.name for s in param_specs(params_cls) if s.role == role), None)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


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
        value, expected = getattr(p, f.name), type(_default(f))
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

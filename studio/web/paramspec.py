"""What a strategy's parameter form shows, read from the strategy itself: the fields of its `Params`
dataclass (name, type, default), the comment beside each field as help text, and, for text fields the
strategy only accepts a few values of, those values.

Nothing here is written per strategy: a new strategy or parameter appears in the web form as soon as its
`Params` has it. The allowed values of a text field are the words of its comment (and of the same field's
comment in a parent class) that building the strategy accepts; the strategy's own validation decides.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from functools import lru_cache

from studio.engine.strategies import STRATEGIES, make_strategy
from studio.errors import BadInput

_FIELD_COMMENT = re.compile(r"^\s*(\w+)\s*:[^#]*#\s*(.*)$")
_WORD = re.compile(r"[A-Za-z][\w-]*")


@dataclass(frozen=True)
class ParamField:
    strategy: str
    name: str
    kind: type                       # int, float, bool, str or dict (the default's type)
    default: object
    help: str
    choices: tuple[str, ...] | None  # the accepted values of a text field; None: free text

    @property
    def key(self) -> str:
        """The keyword the web API knows this field by, e.g. `jacobi_mr_block_size`."""
        return f"{self.strategy}_{self.name}".replace("-", "_")


@lru_cache(maxsize=None)
def param_fields(strategy: str) -> tuple[ParamField, ...]:
    cls = STRATEGIES[strategy]
    comments = _field_comments(cls.Params)
    out = []
    for f in dataclasses.fields(cls.Params):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        help_lines = comments.get(f.name, [])
        choices = None
        if isinstance(default, str):
            choices = _accepted_words(strategy, f.name, default, help_lines)
        out.append(ParamField(strategy, f.name, type(default), default, help_lines[0] if help_lines else "", choices))
    return tuple(out)


def _field_comments(params_cls) -> dict[str, list[str]]:
    """field -> the comments beside it, the most derived class's first (a subclass may only add fields)."""
    out: dict[str, list[str]] = {}
    for klass in params_cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):   # no source (a frozen build): forms go without help text
            continue
        for line in source.splitlines():
            m = _FIELD_COMMENT.match(line)
            if m:
                out.setdefault(m.group(1), []).append(m.group(2).strip())
    return out


def _accepted_words(strategy: str, name: str, default: str, comments: list[str]) -> tuple[str, ...] | None:
    """The values of a text field that the strategy accepts, from the words of its comments; None when the
    strategy accepts any text there (then no word list can be complete)."""
    if _accepts(strategy, name, "\x00 not a value"):
        return None
    words = dict.fromkeys([default] + [w for c in comments for w in _WORD.findall(c)])
    return tuple(w for w in words if w == default or _accepts(strategy, name, w))


def _accepts(strategy: str, name: str, value: str) -> bool:
    try:
        make_strategy(strategy, {name: value})
    except BadInput:
        return False
    return True


def toml_inline(value: dict) -> str:
    """A dict field as the TOML inline table the form shows and `runconfig.parse_value` reads back."""
    import json
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + "}"

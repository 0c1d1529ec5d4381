"""What a strategy's parameter form shows, read from the strategy itself: the fields of its `Params` dataclass
with the metadata each declares (`studio.engine.strategies.params.param_specs`): name, type, default, help
text, the values a text field accepts and the N/τ role.

Nothing here is written per strategy: a new strategy or parameter appears in the web form as soon as its
`Params` has it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from studio.engine.strategies import STRATEGIES
from studio.engine.strategies.params import ROLE_LABELS, ParamSpec, param_specs


BRIEF_CHARS = 80   # a field's help line in the form: about two lines of a 140-pixel field's width


@dataclass(frozen=True)
class ParamField(ParamSpec):
    strategy: str

    @property
    def key(self) -> str:
        """The keyword the web API knows this field by, e.g. `jacobi_mr_block_size`."""
        return f"{self.strategy}_{self.name}".replace("-", "_")

    @property
    def brief(self) -> str:
        """The line under the field: its help, cut to BRIEF_CHARS at a word (the whole help is in the form's "What
        these parameters do")."""
        if len(self.help) <= BRIEF_CHARS:
            return self.help
        return self.help[:BRIEF_CHARS].rsplit(" ", 1)[0] + " …"

    @property
    def label(self) -> str:
        """The field's name, and the role it plays, e.g. `stride (N)`."""
        return f"{self.name} ({ROLE_LABELS[self.role]})" if self.role else self.name


def param_fields(strategy: str) -> tuple[ParamField, ...]:
    return tuple(ParamField(**vars(spec), strategy=strategy) for spec in param_specs(STRATEGIES[strategy].Params))


def toml_inline(value: dict) -> str:
    """A dict field as the TOML inline table the form shows and `studio.run.config.parse_value` reads back."""
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + "}"

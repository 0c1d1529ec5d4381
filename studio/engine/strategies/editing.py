"""LLaDA2.1's token-to-token editing (T2T), shared by every strategy that edits: after a forward over the open block,
a filled (non-prompt) position whose prediction differs from its token and is more probable than `tau_edit` takes
the prediction. Mask-to-token filling (M2T) stays the strategy's own rule; edits never touch MASKs, the prompt or an
earlier block."""
from __future__ import annotations


def select_edits(current: list[int], predicted: list[int], conf: list[float], editable: list[bool],
                 tau_edit: float) -> list[int]:
    """Indices i where `editable[i]`, `predicted[i] != current[i]` and `conf[i] > tau_edit`."""
    return [i for i, (cur, new, c, ok) in enumerate(zip(current, predicted, conf, editable))
            if ok and new != cur and c > tau_edit]

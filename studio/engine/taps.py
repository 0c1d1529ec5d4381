"""Hidden states of chosen layers, kept from a model's forwards: what a DFlash drafter is conditioned on.

`LayerTaps` hooks the layers' outputs (the residual stream after layer t: Hugging Face's hidden_states[t + 1]) and
hands out the last forward's, concatenated in tap order. Hooks run in eager forwards only: a CUDA graph replay or a
compiled step does not call them, so a run that taps runs eagerly (`Strategy.graph_tokens`).
"""
from __future__ import annotations

import torch


class LayerTaps:
    def __init__(self, model, layers: tuple[int, ...] | list[int]):
        self.layers = tuple(layers)
        self._out: dict[int, torch.Tensor] = {}
        blocks = model.model.layers
        self._hooks = [blocks[t].register_forward_hook(self._keeper(t)) for t in self.layers]

    def _keeper(self, t: int):
        def keep(module, args, output):
            self._out[t] = output
        return keep

    def take(self) -> torch.Tensor:
        """The last forward's tapped outputs [B, T, taps x D], in tap order (cleared: each forward's are taken once)."""
        if len(self._out) != len(self.layers):
            raise RuntimeError("no tapped forward since the last take()")
        out = torch.cat([self._out[t] for t in self.layers], dim=-1)
        self._out = {}
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._out = [], {}

    def __enter__(self) -> "LayerTaps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""DiffusionGemma's generation loop: canvases of uniform noise denoised by the bidirectional decoder pass, each finished
canvas committed through the causal encoder pass (studio.engine.gemma).

Per canvas of C tokens: x = uniform noise over the vocabulary. Per step n = N, N-1, ..., 1: the decoder's logits over
x (self-conditioned on the previous step's), divided by the temperature t_min + (t_max - t_min) * n / N; a token
drawn at every position and the argmax taken; the positions accepted by the entropy bound (sorted by entropy, a
position is accepted while the entropies before it sum to at most the bound: at least one per step) keep their drawn
token and every other position is drawn again from uniform noise -- including ones accepted earlier. The canvas is
done when the argmax canvas is stable (equal to the last `stability` ones) and confident (mean entropy below
`confidence`), or after N steps; the argmax canvas is committed. A canvas with an EOS ends the generation, the
tokens after it dropped.

The draws follow transformers' DiffusionGemmaGenerationMixin.generate call for call (canvas noise, then per step a
multinomial and the renoise draw), so with the same seed and the same logits it commits the same tokens.
Design: docs/families.md#diffusiongemma.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.distributions import Categorical

from studio.errors import BadInput


@dataclass(frozen=True)
class CanvasParams:
    """The checkpoint's generation_config.json defaults."""
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    max_steps: int = 48
    stability: int = 1          # steps the argmax canvas must stay the same (0: always stable)
    confidence: float = 0.005   # mean entropy below which the canvas is confident

    def __post_init__(self):
        if self.entropy_bound <= 0 or self.max_steps < 1 or self.stability < 0 or self.confidence <= 0:
            raise BadInput("canvas parameters: entropy_bound and confidence > 0, max_steps >= 1, stability >= 0")
        if not 0 < self.t_min <= self.t_max:
            raise BadInput(f"canvas temperatures must satisfy 0 < t_min <= t_max, got {self.t_min}, {self.t_max}")


class Passes(Protocol):
    """The model's two passes at absolute positions: `encode` commits ids [1, T] starting at `start`; `decode` returns
    raw (soft-capped) logits [1, C, V] of a canvas starting at `start`, self-conditioned on `sc` (None: none)."""
    vocab_size: int

    def encode(self, ids: torch.Tensor, start: int) -> None: ...

    def decode(self, canvas: torch.Tensor, start: int, sc: torch.Tensor | None) -> torch.Tensor: ...


@dataclass
class DenoiseStep:
    """One decoder pass of a canvas, what a view of it needs."""
    remaining: int              # n: N on the first step, counting down
    argmax: list[int]           # the argmax canvas after this step (the committed one, on the last)
    accepted: list[bool]        # positions that kept their drawn token this step (the rest were renoised)
    mean_entropy: float
    done: bool                  # stable and confident: the canvas's last step


@dataclass
class Generation:
    tokens: list[int]                                       # committed, up to and including the first EOS
    canvases: list[list[DenoiseStep]] = field(default_factory=list)

    @property
    def decoder_passes(self) -> int:
        return sum(len(c) for c in self.canvases)


def temperature(remaining: int, p: CanvasParams) -> torch.Tensor:
    """t_min + (t_max - t_min) * n / N in fp32, as transformers computes it (n an int32 tensor)."""
    return p.t_min + (p.t_max - p.t_min) * (torch.tensor(remaining, dtype=torch.int32) / p.max_steps)


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """[.., C] bool: sorted ascending, a position is accepted while the entropies sorted before it sum to <= bound."""
    ordered, order = torch.sort(entropy, dim=-1)
    keep = torch.cumsum(ordered, dim=-1) - ordered <= bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


def denoise_canvas(passes: Passes, start: int, length: int, p: CanvasParams,
                   gen: torch.Generator) -> list[DenoiseStep]:
    """Denoise one canvas at positions [start, start + length); its committed tokens are the last step's argmax."""
    V = passes.vocab_size
    canvas = torch.randint(0, V, (1, length), generator=gen)
    history = torch.full((p.stability, 1, length), -1, dtype=torch.long)
    sc, steps = None, []
    for n in range(p.max_steps, 0, -1):
        logits = passes.decode(canvas, start, sc) / temperature(n, p)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        drawn = torch.multinomial(probs.view(-1, V), 1, generator=gen).view(1, length)
        argmax = logits.argmax(dim=-1)
        entropy = Categorical(logits=logits).entropy()
        accepted = entropy_bound_accept(entropy, p.entropy_bound)
        canvas = torch.where(accepted, drawn, torch.randint(0, V, (1, length), generator=gen))
        stable = bool((history == argmax[None]).all()) if p.stability else True
        if p.stability:
            history = torch.roll(history, -1, dims=0)
            history[-1] = argmax
        mean_entropy = entropy.mean()
        done = stable and bool(mean_entropy < p.confidence)   # compared in fp32, as transformers does
        steps.append(DenoiseStep(n, argmax[0].tolist(), accepted[0].tolist(), float(mean_entropy), done))
        sc = logits
        if done:
            break
    return steps


def generate(passes: Passes, prompt: list[int], max_new_tokens: int, canvas_length: int, p: CanvasParams,
             gen: torch.Generator, eos_ids: set[int]) -> Generation:
    """Canvas after canvas (ceil(max_new_tokens / canvas_length) at most) until one holds an EOS."""
    out = Generation(tokens=[])
    start, ids = 0, torch.tensor([prompt])
    for _ in range(-(-max_new_tokens // canvas_length)):
        passes.encode(ids, start)
        start += ids.shape[1]
        steps = denoise_canvas(passes, start, canvas_length, p, gen)
        out.canvases.append(steps)
        committed = steps[-1].argmax
        eos = next((i for i, t in enumerate(committed) if t in eos_ids), None)
        out.tokens += committed if eos is None else committed[:eos + 1]
        if eos is not None:
            break
        ids = torch.tensor([committed])
    return out


class ModelPasses:
    """`Passes` on the engine's DiffusionGemma and a KV cache of its own."""

    def __init__(self, model, max_len: int):
        self.model, self.kv = model, model.new_cache(max_len)
        self.vocab_size = model.config.vocab_size

    def encode(self, ids: torch.Tensor, start: int) -> None:
        with torch.inference_mode():
            self.model.encode(ids, torch.arange(start, start + ids.shape[1])[None], self.kv)
        self.kv.commit(ids.shape[1])

    def decode(self, canvas: torch.Tensor, start: int, sc: torch.Tensor | None) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(canvas, torch.arange(start, start + canvas.shape[1])[None], self.kv,
                              self_conditioning=sc)

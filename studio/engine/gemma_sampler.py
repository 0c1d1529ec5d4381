"""DiffusionGemma's sampler: one canvas of uniform noise and what each decoder pass over it decides
(transformers' DiffusionGemmaGenerationMixin: the linear temperature schedule, the entropy-bound sampler, the
stable-and-confident stop). The loop around it -- the passes, the commits, the events -- is the `gemma-canvas`
strategy (studio.engine.strategies.gemma_canvas).

A canvas of C tokens starts as uniform noise over the vocabulary. At step n = N, N-1, ..., 1 the decoder's logits
over it are divided by the temperature t_min + (t_max - t_min) * n / N; a token is drawn at every position and the
argmax taken; the draws the entropy bound accepts (sorted by entropy, a position is accepted while the entropies
before it sum to at most the bound: at least one per step) make the next canvas and every other position is drawn
again from uniform noise -- including ones accepted earlier. The canvas is done when the argmax canvas is stable
(equal to the last `stability` ones) and confident (mean entropy below `confidence`), or after N steps; its argmax
canvas is what is committed.

The draws follow transformers' generate call for call (the canvas noise, then per step a multinomial and the renoise
draw) on the run's generator, so with the same seed and the same logits the same tokens are committed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributions import Categorical


@dataclass(frozen=True)
class Schedule:
    """The loop's numbers (the checkpoint's generation_config.json defaults are the strategy's)."""
    max_steps: int          # N: decoder passes per canvas at most
    t_min: float
    t_max: float
    entropy_bound: float
    stability: int          # steps the argmax canvas must stay the same (0: always stable)
    confidence: float       # mean entropy below which the canvas is confident (0: never, every canvas runs N steps)

    def temperature(self, remaining: int) -> torch.Tensor:
        """t_min + (t_max - t_min) * n / N in fp32, as transformers computes it (n an int32 tensor)."""
        n = torch.tensor(remaining, dtype=torch.int32)
        return self.t_min + (self.t_max - self.t_min) * (n / self.max_steps)


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """[.., C] bool: sorted ascending, a position is accepted while the entropies sorted before it sum to <= bound."""
    ordered, order = torch.sort(entropy, dim=-1)
    keep = torch.cumsum(ordered, dim=-1) - ordered <= bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


@dataclass
class DenoiseStep:
    """What one decoder pass decided, per canvas position ([C] tensors)."""
    drawn: torch.Tensor         # the token drawn from the tempered distribution
    drawn_prob: torch.Tensor    # its probability
    accepted: torch.Tensor      # bool: the draw was kept (the rest were renoised)
    noise: torch.Tensor         # the fresh noise at the positions not accepted (what the canvas shows there now)
    argmax: torch.Tensor        # the argmax canvas (the one committed, on the canvas's last step)
    argmax_prob: torch.Tensor
    done: bool                  # the canvas's last step: stable and confident, or the N-th


class NoiseCanvas:
    """One canvas being denoised: its current tokens, the self-conditioning logits for the next pass and the
    argmax history of the stability test. `step(logits)` takes the decoder's raw (soft-capped) logits [C, V] over
    `tokens` and moves the canvas on."""

    def __init__(self, length: int, vocab_size: int, schedule: Schedule, gen: torch.Generator,
                 sc_dtype: torch.dtype):
        self.schedule, self.gen, self.vocab_size, self.sc_dtype = schedule, gen, vocab_size, sc_dtype
        self.tokens = self._noise(length)
        self.self_conditioning: torch.Tensor | None = None   # the previous step's tempered logits (None at first)
        self.remaining = schedule.max_steps
        self._history = torch.full((schedule.stability, length), -1, dtype=torch.long, device=gen.device)

    def _noise(self, length: int) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (length,), generator=self.gen, device=self.gen.device)

    def step(self, raw_logits: torch.Tensor) -> DenoiseStep:
        s = self.schedule
        logits = raw_logits.float() / s.temperature(self.remaining).to(raw_logits.device)
        probs = torch.softmax(logits, dim=-1)
        drawn = torch.multinomial(probs, 1, generator=self.gen)[:, 0]
        argmax = logits.argmax(dim=-1)
        entropy = Categorical(logits=logits).entropy()
        accepted = entropy_bound_accept(entropy, s.entropy_bound)
        noise = self._noise(len(drawn))
        self.tokens = torch.where(accepted, drawn, noise)
        stable = bool((self._history == argmax).all())   # vacuously true at stability 0
        if s.stability:
            self._history = torch.cat([self._history[1:], argmax[None]])
        confident = bool(entropy.mean() < s.confidence)   # compared in fp32, as transformers does
        # transformers hands the next pass the tempered logits in the embedding's dtype
        self.self_conditioning = logits.to(self.sc_dtype)
        self.remaining -= 1
        picked = probs.gather(-1, torch.stack([drawn, argmax], dim=-1))
        return DenoiseStep(drawn, picked[:, 0], accepted, noise, argmax, picked[:, 1],
                           (stable and confident) or self.remaining == 0)

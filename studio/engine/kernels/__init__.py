"""Triton kernels for the GPU engine; the torch code in `studio.engine.sampling` is their oracle.

`available()` says whether the kernels can run here; `verify_logits` verifies a chain from raw logits: the fused
kernel (`verify.py`) where it runs, the torch rules elsewhere. A run reaches it through `DecodeContext.verify`
when the strategy hands its logits and `engine_verifies_fused` holds (CUDA). Triton is imported only when a
kernel is used, so installs without it are unaffected. With TRITON_INTERPRET=1 in the environment before the
first kernel import, Triton's interpreter runs the kernels on the CPU: slow, and meant for tests.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from studio.engine.sampling import ChainResult, Proposal, SamplingParams, gumbel_noise, process_logits, verify_chain


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (read by Triton when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available() -> bool:
    """Whether the kernels can run: Triton is installed, and there is a CUDA device or the interpreter is on."""
    return _triton_installed() and (torch.cuda.is_available() or interpreting())


def runs_fused(logits: Tensor) -> bool:
    """Whether `verify_logits` takes the kernel for these logits: CUDA tensors, or any under the interpreter."""
    return available() and (logits.is_cuda or interpreting())


def engine_verifies_fused(logits: Tensor) -> bool:
    """Whether a run's `DecodeContext.verify` takes the kernel for these logits: CUDA logits with Triton
    installed. The interpreter stays out of runs (TRITON_INTERPRET set by one test must not turn every later
    CPU run into an interpreted one); the wiring test opts in by replacing this function."""
    return logits.is_cuda and _triton_installed()


def verify_logits(drafts: list[int], target_logits: Tensor, draft_logits: Tensor | None, proposal: Proposal,
                  params: SamplingParams, gen: torch.Generator, tau: float = 0.0, reference: bool = False,
                  gamma: float = 1.0) -> ChainResult:
    """`verify_chain` with p = process_logits(target_logits, params) and q = process_logits(draft_logits, params).

    Logits are raw rows [>= k, V]; draft_logits may be None when the rule does not read q. Where `runs_fused`,
    the kernel verifies with k uniforms and k × V Gumbel noise drawn from `gen` (on gen's device: give a CUDA
    generator for CUDA logits); elsewhere this is exactly `verify_chain` with `gen`. Both commit tokens with the
    same distribution but consume `gen` differently, so one seed gives different tokens on the two paths.
    """
    if runs_fused(target_logits):
        from studio.engine.kernels.verify import verify_chain_fused

        uniforms = gumbel = None
        if not params.greedy:
            k, device = len(drafts), target_logits.device
            uniforms = torch.rand(k, generator=gen, device=gen.device).to(device)
            gumbel = gumbel_noise((k, target_logits.shape[-1]), gen).to(device)
        return verify_chain_fused(drafts, target_logits, draft_logits, proposal, params, uniforms, gumbel,
                                  tau=tau, reference=reference, gamma=gamma)
    q = None if draft_logits is None else process_logits(draft_logits, params)
    return verify_chain(drafts, process_logits(target_logits, params), q, proposal, params, gen,
                        tau=tau, reference=reference, gamma=gamma)

"""The strategy registry: CLI names -> classes."""
from __future__ import annotations

from studio.engine.strategies.ar import AR
from studio.engine.strategies.base import DecodeContext, Output, Strategy
from studio.engine.strategies.blockdiff import BlockDiffusion
from studio.engine.strategies.canvas import Canvas
from studio.engine.strategies.dflash import DFlash
from studio.engine.strategies.gemma_canvas import GemmaCanvas
from studio.engine.strategies.isd import ISD, RISD
from studio.engine.strategies.jacobi import Jacobi, JacobiMR
from studio.engine.strategies.lookup_tree import LookupTree
from studio.engine.strategies.s2d2 import S2D2
from studio.engine.strategies.simsd import SimSD
from studio.errors import BadInput

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (AR, ISD, RISD, Jacobi, JacobiMR, LookupTree, DFlash,
                                                                      BlockDiffusion, S2D2, SimSD, Canvas, GemmaCanvas)}


def make_strategy(name: str, params: dict | None = None) -> Strategy:
    cls = STRATEGIES.get(name)
    if cls is None:
        raise BadInput(f"unknown strategy {name!r} (available: {', '.join(STRATEGIES)})")
    return cls(params)


__all__ = ["STRATEGIES", "make_strategy", "Strategy", "DecodeContext", "Output"]

"""Visualisation of traces: palette, trajectory grid, per-step series, the run view every interface draws
from (`view`), plotly figures, text renderers.

Everything here consumes `dlm-studio.trace/1` events only. `figures` imports plotly; the rest is light.
"""
from studio.viz.grid import Cell, Grid, build_grid
from studio.viz.palette import PALETTE, State

__all__ = ["Cell", "Grid", "State", "PALETTE", "build_grid"]

"""Trace tooling on top of `studio.events`: exports (Parquet, CSV, Perfetto, HTML), terminal replay,
and the `dlm-studio trace` CLI. Heavy imports (pyarrow, plotly, rich) happen inside the functions."""

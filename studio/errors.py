"""Errors the CLI turns into a one-line message and an exit code (docs/cli.md#exit-codes-and-errors)."""


class BadInput(Exception):
    """The user's input is wrong (exit code 2): a missing file, an unknown strategy, a malformed trace."""


class RankLost(RuntimeError):
    """Tensor parallelism: another rank died or stopped answering within the collective timeout (exit code 1)."""

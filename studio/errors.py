"""Errors the CLI turns into a one-line message and an exit code (DESIGN §2.1)."""


class BadInput(Exception):
    """The user's input is wrong (exit code 2): a missing file, an unknown strategy, a malformed trace."""

"""Errors the CLI turns into a one-line message and an exit code (docs/cli.md#exit-codes-and-errors)."""


class BadInput(Exception):
    """The user's input is wrong (exit code 2): a missing file, an unknown strategy, a malformed trace."""


class RankLost(RuntimeError):
    """Tensor parallelism: another rank died or stopped answering within the collective timeout (exit code 1)."""


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what an error line quotes."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def short_repr(v) -> str:
    """repr(v), at most 60 characters (a damaged field can hold megabytes)."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."

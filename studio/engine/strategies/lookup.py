"""Prompt lookup: drafts copied from the context. Where the last few tokens of prompt + output occurred before, the
tokens that followed that occurrence are a guess at what follows now -- a small model repeats its own phrases and
the prompt's, so on ordinary answers such a guess exists at a fifth to a quarter of the steps and its first token
is right about 70 % of the time (the embedded model's own answers to 300 training prompts, a match of 2+ tokens).

The guesses are deterministic functions of the tokens so far, so a strategy verifies them with the
deterministic-draft rule and stays exact. docs/strategies.md#prompt-lookup.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from studio.errors import BadInput

if TYPE_CHECKING:
    from studio.engine.strategies.base import Output

LONGEST = 4   # the longest suffix tried: a longer match is rarer and barely more often right

HELP = (f"prompt lookup: where the context's last m tokens (m from {LONGEST} down to this) occurred before, the "
        "tokens that followed are drafts (src ngram, planned apart from the strategy's own); 0 = off")


def validate(owner: str, value: int) -> None:
    """BadInput unless `value` is a lookup length (0: off)."""
    if not 0 <= value <= LONGEST:
        raise BadInput(f"{owner} lookup must be 0 (off) or 1..{LONGEST} tokens, got {value}")


class ContextLookup:
    """The tokens that followed the latest earlier occurrence of the context's last m tokens, for the longest m from
    LONGEST down to `shortest` that occurred. An index of every m-gram's latest continuation keeps a lookup O(m),
    not a scan of the context."""

    def __init__(self, prompt: list[int], shortest: int):
        self.shortest, self.prompt_len = shortest, len(prompt)
        self.tokens: list[int] = []
        self.room = None   # how many drafts can still become output (None: no limit known yet)
        # m-gram -> index of the token that followed each of its occurrences, the latest last
        self.after: dict[tuple[int, ...], list[int]] = {}
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            j = len(self.tokens)
            for m in range(self.shortest, LONGEST + 1):   # the m-grams ending just before t now have a continuation
                if j >= m:
                    self.after.setdefault(tuple(self.tokens[j - m:j]), []).append(j)
            self.tokens.append(t)

    def follow(self, out: Output) -> None:
        """Take in the output tokens not seen yet (`out`: the run's Output). The verifying forward writes one token of
        its own after the accepted drafts, so at most max_new_tokens - written - 1 drafts can still become output:
        more would be rows verified for nothing on the last step."""
        self.extend(out.token_ids[len(self.tokens) - self.prompt_len:])
        self.room = out.draft_room()

    def drafts(self, k: int) -> list[int]:
        """Up to k tokens that followed the context's last tokens before (and no more than can become output); []
        when no suffix of `shortest`+ occurred."""
        found = self.branches(k, 1)
        return found[0] if found else []

    def branches(self, k: int, n: int) -> list[list[int]]:
        """Up to n distinct continuations of up to k tokens each (and no more than can become output): those that
        followed the latest occurrences of the longest suffix that occurred, then of shorter ones, latest first."""
        if self.room is not None:
            k = min(k, self.room)
        found: list[list[int]] = []
        for m in range(min(LONGEST, len(self.tokens)), self.shortest - 1, -1):
            for at in reversed(self.after.get(tuple(self.tokens[-m:]), [])):
                branch = self.tokens[at:at + k]
                if branch and branch not in found:
                    found.append(branch)
                if len(found) == n:
                    return found
        return found

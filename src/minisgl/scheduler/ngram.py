"""N-gram drafts (prompt lookup): the tokens that followed the last n tokens of a sequence where they occurred before.

A sequence's own index (NgramIndex) maps every n-gram (n = 1..MAX_N) that has a known continuation to where its most
recent such occurrence ends; it grows by MAX_N dictionary writes per token. The shared index (SharedNgrams) holds the
sequences other requests finished, the text the prefix cache keeps for them: agents that share a prefix see each
other's tool results and answers, so another request's continuation of the same context is a draft too.
A draft is a guess only: verification (engine/verify.py) keeps what the model itself would have produced.
"""

from __future__ import annotations

MAX_N = 4  # the longest context matched; longer contexts are tried first


class NgramIndex:
    """The n-grams of one growing token sequence, each with the end of its most recent occurrence that has a
    continuation (the n-gram ending at the last token has none yet, so it is filed only once the next token comes)."""

    __slots__ = ("tokens", "_ends", "_indexed")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens  # the sequence itself (a request's input_ids: prompt, then output), read, never written
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are filed

    def sync(self) -> None:
        """File the n-grams whose continuation arrived since the last call."""
        tokens, ends = self.tokens, self._ends
        last = len(tokens) - 1  # the n-gram ending at the last token has no continuation yet
        for end in range(max(self._indexed, 1), last + 1):
            for n in range(1, min(MAX_N, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, last + 1)

    def continuation(self, context: tuple[int, ...], k: int) -> list[int]:
        """Up to k tokens that followed `context`'s most recent earlier occurrence; [] when it never occurred."""
        end = self._ends.get(context)
        return [] if end is None else self.tokens[end : end + k]


class SharedNgrams:
    """N-gram contexts of finished sequences -> their continuations, for every request to draft from.

    Bounded: past max_entries the index starts over (drafts are guesses; losing old ones costs speed, not output).
    """

    def __init__(self, max_entries: int = 1 << 20) -> None:
        self.max_entries = max_entries
        self._ends: dict[tuple[int, ...], tuple[list[int], int]] = {}

    def add(self, tokens: list[int], start: int) -> None:
        """File the contexts whose continuation starts at or after `start` (a request's output: its prompt's contexts
        are in the requests that share that prompt already)."""
        if len(self._ends) > self.max_entries:
            self._ends.clear()
        seq = list(tokens)  # a copy: the request's list may be reused
        ends = self._ends
        for end in range(max(start, 1), len(seq)):
            for n in range(1, min(MAX_N, end) + 1):
                ends[tuple(seq[end - n : end])] = (seq, end)

    def continuation(self, context: tuple[int, ...], k: int) -> list[int]:
        found = self._ends.get(context)
        if found is None:
            return []
        seq, end = found
        return seq[end : end + k]


def propose(own: NgramIndex, shared: SharedNgrams | None, k: int, min_n: int = 1) -> tuple[list[int], int]:
    """Up to k draft tokens for the sequence of `own` and the length of the context they continue: its last n tokens
    (n from MAX_N down to min_n) matched in its own earlier tokens, then in the shared index; ([], 0) when nothing
    matches."""
    if k <= 0:
        return [], 0
    own.sync()
    tokens = own.tokens
    for n in range(min(MAX_N, len(tokens)), min_n - 1, -1):
        context = tuple(tokens[-n:])
        draft = own.continuation(context, k)
        if not draft and shared is not None:
            draft = shared.continuation(context, k)
        if draft:
            return draft, n
    return [], 0

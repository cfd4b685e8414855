"""N-gram drafts (prompt lookup): the tokens that followed the last n tokens of a sequence where they occurred before.

A sequence's own index (NgramIndex) maps every n-gram (n = 1..MAX_N) that has a known continuation to where its most
recent such occurrence ends; it grows by MAX_N dictionary writes per token. The shared index (SharedNgrams) holds the
sequences other requests finished, the text the prefix cache keeps for them: agents that share a prefix see each
other's tool results and answers, so another request's continuation of the same context is a draft too.
A draft is a guess only: verification (engine/verify.py) keeps what the model itself would have produced.
"""

from __future__ import annotations

from collections import deque

import numpy as np

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

    A finished sequence is filed when drafts are next looked up, not when it ends (a large batch, which never
    drafts, pays nothing for it; of the sequences that finish meanwhile the last max_pending are kept), and filed
    in bulk: each context is keyed by a 64-bit polynomial hash computed for all of a sequence's n-grams at once
    (numpy), so filing costs well under a microsecond per output token. Two contexts of one hash share an entry:
    a wrong draft, which verification rejects. Bounded: past max_entries the index starts over (drafts are
    guesses; losing old ones costs speed, not output).
    """

    def __init__(self, max_entries: int = 1 << 20, max_pending: int = 64) -> None:
        self.max_entries = max_entries
        self._ends: dict[int, int] = {}  # context hash -> sequence number << 32 | end of that occurrence
        self._seqs: list[list[int]] = []
        self._pending: deque[tuple[list[int], int]] = deque(maxlen=max_pending)

    def add(self, tokens: list[int], start: int) -> None:
        """File, at the next lookup, the contexts whose continuation starts at or after `start` (a request's output:
        its prompt's contexts are in the requests that share that prompt already)."""
        self._pending.append((list(tokens), start))  # a copy: the request's list may be reused

    def _file_pending(self) -> None:
        while self._pending:
            if len(self._ends) > self.max_entries:
                self._ends.clear()
                self._seqs.clear()
            seq, start = self._pending.popleft()
            number = len(self._seqs)
            self._seqs.append(seq)
            tokens = np.asarray(seq, dtype=np.int64)
            for n in range(1, MAX_N + 1):
                first = max(start, n)  # the first end: its n-gram is whole and its continuation is output
                if first >= len(seq):
                    continue
                ends = np.arange(first, len(seq), dtype=np.int64)
                keys = _window_keys(tokens, n)[first - n : len(seq) - n]
                self._ends.update(zip(keys.tolist(), ((number << 32) | ends).tolist()))

    def continuation(self, context: tuple[int, ...], k: int) -> list[int]:
        if self._pending:
            self._file_pending()
        found = self._ends.get(_context_key(context))
        if found is None:
            return []
        seq, end = self._seqs[found >> 32], found & 0xFFFFFFFF
        return seq[end : end + k]


_P = 1_000_003
_MASK = (1 << 64) - 1


def _signed(h: int) -> int:
    h &= _MASK
    return h - (1 << 64) if h >> 63 else h


def _context_key(context: tuple[int, ...]) -> int:
    """The hash of a context as _window_keys computes it: Horner's rule from n, modulo 2**64 (as int64)."""
    h = len(context)
    for t in context:
        h = h * _P + t
    return _signed(h)


def _window_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """_context_key of every n-token window of tokens (the window starting at s at index s), in int64 arithmetic
    that wraps modulo 2**64 as the Python side's masking does."""
    count = len(tokens) - n + 1
    keys = np.full(count, _signed(n * pow(_P, n, 1 << 64)), dtype=np.int64)
    with np.errstate(over="ignore"):
        for i in range(n):
            keys += tokens[i : i + count] * np.int64(_signed(pow(_P, n - 1 - i, 1 << 64)))
    return keys


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

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
BULK = 64  # a sequence's n-grams are filed with numpy from this many new tokens on (a prompt), else one by one


class NgramIndex:
    """The n-grams of one growing token sequence, each with the end of its most recent occurrence that has a
    continuation (the n-gram ending at the last token has none yet, so it is filed only once the next token comes).

    Contexts are keyed by their 64-bit hash (_context_key), plain ints: a prompt of thousands of tokens is filed in
    bulk (numpy), and the index holds no objects the garbage collector must walk."""

    __slots__ = ("tokens", "_ends", "_indexed", "_tail", "_tail_at")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens  # the sequence itself (a request's input_ids: prompt, then output), read, never written
        self._ends: dict[int, int] = {}  # context hash -> end of its most recent occurrence
        self._indexed = 1  # n-grams ending before this position are filed
        self._tail: list[int] = []  # tail_keys() at length _tail_at: filed once the next token comes
        self._tail_at = -1

    def sync(self, budget: int | None = None) -> int:
        """File the n-grams whose continuation arrived since the last call, and say how many positions were filed.

        A few new tokens are always filed; a backlog (a prompt, or a request seen for the first time) is filed in bulk,
        at most `budget` positions of it when given, so that its cost spreads over several calls (`synced` says when
        it is done)."""
        tokens, ends = self.tokens, self._ends
        start, stop = self._indexed, len(tokens)  # the n-gram ending at the last token has no continuation yet
        if stop - start > BULK:
            if budget is not None:
                stop = min(stop, start + max(budget, 0))
            if stop > start:
                _file(ends, tokens, start, stop, 0)
        else:
            for end in range(start, stop):
                keys = self._tail if end == self._tail_at else _keys_ending_at(tokens, end)
                for key in keys:
                    ends[key] = end
        self._indexed = max(start, stop)
        return self._indexed - start

    @property
    def synced(self) -> bool:
        """Whether every n-gram with a continuation is filed (a draft looked up now sees the whole sequence)."""
        return self._indexed >= len(self.tokens)

    def tail_keys(self) -> list[int]:
        """The keys of the sequence's last n tokens, n = 1..MAX_N (the contexts a draft continues); each length's
        are computed once, and filed by the sync after the next token."""
        if self._tail_at != len(self.tokens):
            self._tail_at = len(self.tokens)
            self._tail = _keys_ending_at(self.tokens, self._tail_at)
        return self._tail

    def continuation(self, key: int, k: int) -> list[int]:
        """Up to k tokens that followed the context of hash `key` at its most recent earlier occurrence; [] when it
        never occurred."""
        end = self._ends.get(key)
        return [] if end is None else self.tokens[end : end + k]


class SharedNgrams:
    """N-gram contexts of finished sequences -> their continuations, for every request to draft from.

    A finished sequence is filed by a step that looks drafts up, not when it ends: a large batch, which never drafts,
    pays nothing for it, and of the sequences that finish meanwhile the last max_pending are kept (a drafting batch
    has at most 16-32 rows: more answers than that finish only as a large batch thins out). They are filed in
    the order they finished (a later one's continuation of a context replaces an earlier one's), a few per step
    (file_pending's budget), so that a large batch thinning out to a drafting one files its many answers over the
    next steps instead of stalling one. Each sequence is filed in bulk: every context is keyed by its 64-bit
    polynomial hash, computed for all of a sequence's n-grams at once (numpy). Two contexts of one hash share an
    entry: a wrong draft, which verification rejects. Bounded: past max_entries the index starts over (drafts are
    guesses; losing old ones costs speed, not output).
    """

    def __init__(self, max_entries: int = 1 << 20, max_pending: int = 16) -> None:
        self.max_entries = max_entries
        self._ends: dict[int, int] = {}  # context hash -> sequence number << 32 | end of that occurrence
        self._seqs: list[list[int]] = []
        self._pending: deque[tuple[list[int], int]] = deque(maxlen=max_pending)

    def add(self, tokens: list[int], start: int) -> None:
        """File, at the next lookup, the contexts whose continuation starts at or after `start` (a request's output:
        its prompt's contexts are in the requests that share that prompt already)."""
        self._pending.append((list(tokens), start))  # a copy: the request's list may be reused

    def file_pending(self, budget: int) -> int:
        """File waiting sequences, the oldest first, until about `budget` tokens are filed (one at least); returns
        the tokens filed."""
        filed = 0
        while self._pending and filed < budget:
            if len(self._ends) > self.max_entries:
                self._ends.clear()
                self._seqs.clear()
            seq, start = self._pending.popleft()
            self._seqs.append(seq)
            _file(self._ends, seq, max(start, 1), len(seq), (len(self._seqs) - 1) << 32)
            filed += len(seq) - start
        return filed

    def continuation(self, key: int, k: int) -> list[int]:
        found = self._ends.get(key)
        if found is None:
            return []
        seq, end = self._seqs[found >> 32], found & 0xFFFFFFFF
        return seq[end : end + k]


_P = 1_000_003
_MASK = (1 << 64) - 1


def _signed(h: int) -> int:
    h &= _MASK
    return h - (1 << 64) if h >> 63 else h


def _context_key(context: list[int]) -> int:
    """The hash of a context as _window_keys computes it: Horner's rule from n, modulo 2**64 (as int64)."""
    h = len(context)
    for t in context:
        h = h * _P + t
    return _signed(h)


def _keys_ending_at(tokens: list[int], end: int) -> list[int]:
    """The keys of the n tokens before `end`, n = 1..MAX_N (as many as there are)."""
    return [_context_key(tokens[end - n : end]) for n in range(1, min(MAX_N, end) + 1)]


def _window_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """_context_key of every n-token window of tokens (the window starting at s at index s), in int64 arithmetic
    that wraps modulo 2**64 as the Python side's masking does."""
    count = len(tokens) - n + 1
    keys = np.full(count, _signed(n * pow(_P, n, 1 << 64)), dtype=np.int64)
    with np.errstate(over="ignore"):
        for i in range(n):
            keys += tokens[i : i + count] * np.int64(_signed(pow(_P, n - 1 - i, 1 << 64)))
    return keys


def _file(ends: dict[int, int], seq: list[int], first: int, stop: int, tag: int) -> None:
    """ends[hash of each n-gram of seq ending at e] = tag | e, for first <= e < stop and n = 1..MAX_N (a later
    occurrence overwrites an earlier one): every n-gram's keys at once, numpy."""
    base = max(0, first - MAX_N)  # the first token of an n-gram ending at `first` or later
    tokens = np.asarray(seq[base:stop], dtype=np.int64)
    for n in range(1, MAX_N + 1):
        lo = max(first, n)  # the first end whose n-gram is whole
        if lo >= stop:
            continue
        keys = _window_keys(tokens, n)[lo - n - base : stop - n - base]
        ends.update(zip(keys.tolist(), (np.arange(lo, stop, dtype=np.int64) | tag).tolist()))


def propose(own: NgramIndex, shared: SharedNgrams | None, k: int, min_n: int = 1) -> tuple[list[int], int]:
    """Up to k draft tokens for the sequence of `own` and the length of the context they continue: its last n tokens
    (n from MAX_N down to min_n) matched in its own earlier tokens, then in the shared index; ([], 0) when nothing
    matches."""
    if k <= 0:
        return [], 0
    own.sync()
    keys = own.tail_keys()
    for n in range(len(keys), min_n - 1, -1):
        key = keys[n - 1]
        draft = own.continuation(key, k)
        if not draft and shared is not None:
            draft = shared.continuation(key, k)
        if draft:
            return draft, n
    return [], 0

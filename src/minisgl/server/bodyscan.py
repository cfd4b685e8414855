"""A linear scan of a JSON body's bytes before anything parses it: how deeply it nests, how many numbers it holds,
and which of its top-level members are large (their numbers and inner arrays/objects, counted).

One pass over fixed-size chunks with numpy, carrying the state across chunks (inside a string or not, an odd run of
backslashes, the depth, the member): time linear in the body whatever it holds (a regex over strings backtracks
exponentially on an unterminated one), memory bounded by the chunk, and numpy leaves the GIL to the event loop. The
body must be UTF-8 (RFC 8259): no byte of a multi-byte character is then ASCII, so every quote, backslash, bracket
and comma seen is one.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import numpy as np

CHUNK_BYTES = 1 << 20
LARGE_MEMBER = 1024  # a member with this many numbers or inner containers is reported by name
_KEY_BYTES = 256  # longer keys are no field of any API


class Member(NamedTuple):
    numbers: int  # JSON numbers in the member's value
    containers: int  # arrays and objects inside the member's value (the value itself not counted)


class BodyShape(NamedTuple):
    depth: int  # how deeply arrays and objects nest
    numbers: int  # JSON numbers in the whole body
    members: dict[str, Member]  # the top-level object's large members, by key


def is_utf8_json(body: bytes) -> bool:
    """Whether the body is in the one encoding JSON may travel in (json.loads would also take UTF-16 and -32)."""
    return json.detect_encoding(body[:4]) in ("utf-8", "utf-8-sig")


def scan(body: bytes) -> BodyShape:
    state = _Scan()
    for start in range(0, len(body), CHUNK_BYTES):
        state.feed(body, start, min(start + CHUNK_BYTES, len(body)))
    return state.shape(body)


def _between(c: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return (c >= lo) & (c <= hi)


class _Scan:
    """The scan's state between chunks, and what it has counted. Each costly step (a running sum) runs only on a
    chunk that holds the bytes it is about: a chunk of a long string or of a long list of ids costs a few compares."""

    def __init__(self) -> None:
        self.odd_backslashes = False  # the last chunk ended in an odd run of backslashes: the next byte is escaped
        self.in_string = False
        self.after_number = False  # the last chunk ended inside a number
        self.depth = 0
        self.max_depth = 0
        self.numbers = 0
        self.member = 0  # the top-level member the scan is in
        self.member_numbers = np.zeros(1, np.int64)
        self.member_containers = np.zeros(1, np.int64)
        self.member_starts: list[np.ndarray] = []  # where each top-level member begins: "{" or a comma
        self.colons: list[np.ndarray] = []  # the top-level object's colons

    def feed(self, body: bytes, start: int, end: int) -> None:
        c = np.frombuffer(body, np.uint8, count=end - start, offset=start)
        quotes = c == 34
        if body.find(b"\\", start, end) >= 0 or self.odd_backslashes:
            quotes &= ~self._escaped(c)
        if body.find(b'"', start, end) >= 0:
            inside = np.logical_xor.accumulate(quotes) ^ self.in_string  # a closing quote counts as outside
            self.in_string = bool(inside[-1])
            outside: np.ndarray | bool = ~inside
        elif self.in_string:
            self.after_number = False
            return  # the middle of a long string: nothing in it counts
        else:
            outside = True
        opens = ((c == 91) | (c == 123)) & outside
        closes = ((c == 93) | (c == 125)) & outside
        depth: np.ndarray | int = self.depth  # after each byte
        if body.find(b"[", start, end) >= 0 or body.find(b"{", start, end) >= 0 or closes.any():
            depth = np.cumsum(opens.astype(np.int32) - closes, dtype=np.int32) + self.depth
            self.max_depth = max(self.max_depth, int(depth.max()))
            self.depth = int(depth[-1])
        numeric = _between(c, 48, 57) | (c == 45) | (c == 43) | (c == 46) | (c == 101) | (c == 69)
        follows = np.empty(len(c), bool)
        follows[0] = self.after_number
        follows[1:] = numeric[:-1]
        self.after_number = bool(numeric[-1])
        starts = (_between(c, 48, 57) | (c == 45)) & outside & ~follows  # a JSON number begins with - or a digit
        self.numbers += int(np.count_nonzero(starts))
        top = depth == 1
        commas = (c == 44) & outside & top
        self.member_starts.append(np.flatnonzero(commas | (opens & top)) + start)
        self.colons.append(np.flatnonzero((c == 58) & outside & top) + start)
        self._count(commas, starts & (depth >= 1), opens & (depth >= 3))

    def _escaped(self, c: np.ndarray) -> np.ndarray:
        """Which bytes follow an odd run of backslashes (the run may have begun in an earlier chunk)."""
        backslash = c == 92
        index = np.arange(len(c), dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(backslash, -1, index))
        run = index - last_other + np.where(last_other < 0, int(self.odd_backslashes), 0)  # backslashes ending here
        escaped = np.empty(len(c), bool)
        escaped[0] = self.odd_backslashes
        escaped[1:] = (run[:-1] & 1).astype(bool)
        self.odd_backslashes = bool(run[-1] & 1)
        return escaped

    def _count(self, commas: np.ndarray, numbers: np.ndarray, containers: np.ndarray) -> None:
        """Numbers and inner containers per top-level member (a comma at depth 1 begins the next one)."""
        if not commas.any():
            self.member_numbers[self.member] += int(np.count_nonzero(numbers))
            self.member_containers[self.member] += int(np.count_nonzero(containers))
            return
        member = np.cumsum(commas, dtype=np.int64) + self.member
        size = int(member[-1]) + 1
        if len(self.member_numbers) < size:
            grow = max(size, 2 * len(self.member_numbers)) - len(self.member_numbers)
            self.member_numbers = np.concatenate([self.member_numbers, np.zeros(grow, np.int64)])
            self.member_containers = np.concatenate([self.member_containers, np.zeros(grow, np.int64)])
        for total, mask in ((self.member_numbers, numbers), (self.member_containers, containers)):
            total[self.member : size] += np.bincount(member[mask] - self.member, minlength=size - self.member)
        self.member = size - 1

    def shape(self, body: bytes) -> BodyShape:
        starts, colons = np.concatenate(self.member_starts), np.concatenate(self.colons)
        large = np.flatnonzero((self.member_numbers >= LARGE_MEMBER) | (self.member_containers >= LARGE_MEMBER))
        members: dict[str, Member] = {}
        for m in large:
            if m >= len(starts):
                continue
            colon = np.searchsorted(colons, starts[m])
            key = _key(body, int(starts[m]) + 1, int(colons[colon])) if colon < len(colons) else None
            if key is not None:
                members[key] = Member(int(self.member_numbers[m]), int(self.member_containers[m]))
        return BodyShape(self.max_depth, self.numbers, members)


def _key(body: bytes, start: int, end: int) -> str | None:
    if end - start > _KEY_BYTES:
        return None
    try:
        key = json.loads(body[start:end])
    except ValueError:
        return None
    return key if isinstance(key, str) else None

"""The prefix cache interface: radix (kvcache/radix.py) and naive (kvcache/naive.py) implement it.

Keys are token ids, values are token-level KV slots (torch int64). All lengths that cross this
interface are multiples of page_size; a node's slots always start at a page boundary, so the
pages a node owns are ``slots[::page_size] // page_size``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch


class MatchResult(NamedTuple):
    handle: Any  # opaque node to lock/unlock; None when nothing matched
    slots: torch.Tensor  # [matched_len] int64 KV slots of the matched prefix


class PrefixCache(ABC):
    page_size: int

    @abstractmethod
    def match_prefix(self, token_ids: list[int], start: Any = None) -> MatchResult:
        """Longest cached prefix of token_ids, page-aligned. Refreshes LRU time; does not lock.

        start: a handle or hint an earlier call returned for these ids (or a prefix of them); the cache may
        resume there, and ignores it when it no longer applies. The result is the same either way.
        """

    def match_len(self, token_ids: list[int]) -> int:
        """Length of the cached prefix of token_ids, without touching LRU time or locks."""
        return self.locate(token_ids)[0]

    def locate(self, token_ids: list[int], start: Any = None) -> tuple[int, Any]:
        """match_len, and a hint for the next call's `start` with these ids (None: none)."""
        return len(self.match_prefix(token_ids, start).slots), None

    @abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Offer token_ids (len a multiple of page_size) with their KV slots to the cache.

        Returns how many leading tokens were already cached: the caller still owns (and must
        free) those slots of its own. The cache adopts the slots after that point.
        """

    def insert_node(self, token_ids: list[int], slots: torch.Tensor, start: Any = None) -> tuple[int, Any]:
        """insert(), and the handle of the node that now ends at len(token_ids) (None when nothing is kept).
        start: as for match_prefix (the inserting request's handle)."""
        cached = self.insert(token_ids, slots)
        return cached, self.match_prefix(token_ids).handle

    @abstractmethod
    def lock(self, handle: Any) -> None:
        """Protect the node and its ancestors from eviction (reference counted)."""

    @abstractmethod
    def unlock(self, handle: Any) -> None:
        """Drop one reference taken by lock()."""

    @abstractmethod
    def evict(self, num_pages: int) -> torch.Tensor:
        """Free at least num_pages pages (LRU over unlocked leaves), or all that can be; returns their page ids."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages held by the cache that no request locks."""

    @property
    @abstractmethod
    def protected_pages(self) -> int:
        """Pages held by the cache that some request locks."""

    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def reset(self) -> list[torch.Tensor]:
        """Drop everything (only valid with no locks); returns the freed page ids."""
        return [self.evict(self.cached_pages)]

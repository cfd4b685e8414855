"""The KV page allocator and the prefix cache together: every page is free, cached or a request's.

A request's row of the page table maps positions to slots (page * page_size + offset). Its first
``num_matched`` positions (page aligned) borrow the prefix cache's pages under a locked handle;
the pages behind positions [num_matched, ceil(length / page_size) * page_size) are its own.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from minisgl.errors import ConfigError
from minisgl.kvcache.base import MatchResult, PrefixCache
from minisgl.kvcache.naive import NaiveCache
from minisgl.kvcache.radix import RadixCache


def make_prefix_cache(kind: str, page_size: int, device: torch.device | str = "cpu") -> PrefixCache:
    """The prefix cache named by the config: "radix" (share prefixes) or "naive" (no reuse)."""
    if kind == "radix":
        return RadixCache(page_size, device)
    if kind == "naive":
        return NaiveCache(page_size, device)
    raise ConfigError(f"unknown prefix cache {kind!r}: use 'radix' or 'naive'")


class DoubleFreeError(AssertionError):
    """A page was freed while already free: two owners thought they held it (a bug, never a user's doing)."""


class CacheManager:
    def __init__(
        self, num_pages: int, page_size: int, prefix_cache: PrefixCache, device: torch.device | str = "cpu"
    ) -> None:
        if prefix_cache.page_size != page_size:
            raise ConfigError(f"prefix cache page_size {prefix_cache.page_size} != pool page_size {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.device = torch.device(device)
        self._free_pages = torch.arange(num_pages, dtype=torch.int64, device=self.device)
        self._is_free = torch.ones(num_pages, dtype=torch.bool, device=self.device)
        # On a GPU a double free is recorded without a host sync (free() runs while a forward is in flight) and
        # raised by check_integrity; on the CPU free() raises at once.
        self._freed_twice = torch.zeros((), dtype=torch.bool, device=self.device)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self._next_offsets = self._page_offsets + 1  # slot after `last`, and on: one kernel per partial page
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ sizes

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get: free ones plus those eviction can reclaim."""
        return len(self._free_pages) + self.prefix_cache.evictable_pages

    def req_pages(self, length: int, num_matched: int) -> int:
        """Pages a request owns when its row holds slots for `length` positions, `num_matched` borrowed."""
        return -(-length // self.page_size) - num_matched // self.page_size

    # ------------------------------------------------------------------ prefix cache

    @property
    def cached_pages(self) -> int:
        return self.prefix_cache.cached_pages

    def match_len(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of token_ids are cached; locks nothing, allocates nothing."""
        return self.prefix_cache.match_len(token_ids)

    def locate(self, token_ids: Sequence[int], start: Any = None) -> tuple[int, Any]:
        """match_len, and a hint that makes the next locate / match_and_lock of these ids resume where this one
        ended (a waiting request keeps it between steps)."""
        return self.prefix_cache.locate(token_ids, start)

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Cached prefix of token_ids; lock(handle) before anything else can evict (any allocation)."""
        return self.prefix_cache.match_prefix(token_ids)

    def match_and_lock(self, token_ids: Sequence[int], start: Any = None) -> MatchResult:
        """Cached prefix of token_ids, locked at once: unlock(handle) gives it back. start: a hint from locate."""
        handle, slots = self.prefix_cache.match_prefix(token_ids, start)
        self.prefix_cache.lock(handle)
        return MatchResult(handle, slots)

    def lock(self, handle: Any) -> None:
        self.prefix_cache.lock(handle)

    def unlock(self, handle: Any) -> None:
        self.prefix_cache.unlock(handle)

    def evict_all(self) -> None:
        """Forget every cached prefix no request locks; their pages go back to the free list."""
        self.free(self.prefix_cache.evict(self.prefix_cache.evictable_pages))

    # ------------------------------------------------------------------ pages

    def allocate_pages(self, n: int) -> torch.Tensor | None:
        """n page ids, evicting unlocked cache pages if the free list is short; None (and no change) if impossible."""
        short = n - len(self._free_pages)
        if short > 0:
            if short > self.prefix_cache.evictable_pages:
                return None
            self.free(self.prefix_cache.evict(short))
        pages, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        # index_fill_, not `[pages] = False`: that copies the scalar from the host and waits for the device.
        self._is_free.index_fill_(0, pages, False)
        return pages

    def free(self, page_ids: torch.Tensor) -> None:
        """Return pages to the free list; DoubleFreeError if one of them is free already."""
        if not len(page_ids):
            return
        page_ids = page_ids.to(self.device, torch.int64)
        ordered = page_ids.sort().values
        again = self._is_free[page_ids].any() | (ordered[1:] == ordered[:-1]).any()
        if self.device.type == "cpu":
            if bool(again):
                raise DoubleFreeError(f"KV page(s) freed twice: {sorted(set(page_ids.tolist()))[:16]}")
        else:
            self._freed_twice |= again
        self._is_free.index_fill_(0, page_ids, True)
        self._free_pages = torch.cat([self._free_pages, page_ids])

    def slots_for_extend(
        self, page_table_row: torch.Tensor, old_len: int, new_len: int
    ) -> tuple[torch.Tensor, int] | None:
        """Give positions [old_len, new_len) slots, written into page_table_row; returns (slots, new pages).

        Positions left in the last, partly filled page continue its slots; the rest get new pages.
        Returns None, changing nothing, when the pages cannot be had.
        """
        ps = self.page_size
        if new_len <= old_len:
            return self._empty, 0
        have_end = -(-old_len // ps) * ps  # end of the last page the request already has
        num_new = -(-new_len // ps) - have_end // ps
        parts: list[torch.Tensor] = []
        if old_len < have_end:
            last = page_table_row[old_len - 1 : old_len]  # a tensor, not .item(): no device sync
            parts.append(last + self._next_offsets[: min(new_len, have_end) - old_len])
        if num_new > 0:
            pages = self.allocate_pages(num_new)
            if pages is None:
                return None
            slots = torch.add(self._page_offsets, pages.unsqueeze(1), alpha=ps).flatten()  # one kernel
            parts.append(slots[: new_len - have_end])
        slots = parts[0] if len(parts) == 1 else torch.cat(parts)
        page_table_row[old_len:new_len] = slots
        return slots, num_new

    # ------------------------------------------------------------------ requests

    def release(
        self,
        token_ids: Sequence[int],
        page_table_row: torch.Tensor,
        length: int,
        num_matched: int,
        handle: Any,
        alloc_len: int | None = None,
    ) -> None:
        """A request is done: cache its page-aligned KV, free the rest of its pages, unlock handle.

        alloc_len (default length) is how many positions have slots, when more were reserved
        than computed (e.g. a step allocated ahead); those extra pages are freed, not cached.
        """
        ps = self.page_size
        alloc_len = length if alloc_len is None else alloc_len
        assert num_matched % ps == 0 and num_matched <= length <= alloc_len, (num_matched, length, alloc_len)
        aligned = length - length % ps
        cached, _ = self._insert(token_ids, page_table_row, aligned, num_matched, handle)
        # Own slots the cache did not adopt: the duplicate head and everything after `aligned`.
        self.free(torch.cat([page_table_row[num_matched:cached:ps], page_table_row[aligned:alloc_len:ps]]) // ps)
        self.prefix_cache.unlock(handle)

    def cache_prefix(
        self, token_ids: Sequence[int], page_table_row: torch.Tensor, length: int, num_matched: int, handle: Any
    ) -> tuple[Any, int]:
        """Share an unfinished request's page-aligned KV; returns its new (handle, num_matched).

        The row's prefix is rewritten to the cache's slots, the request's duplicates are freed,
        and the new handle is locked in place of the old. The partial tail page stays the request's.
        """
        ps = self.page_size
        assert num_matched % ps == 0 and num_matched <= length, (num_matched, length)
        aligned = length - length % ps
        if aligned <= num_matched:
            return handle, num_matched
        cached, handle_new = self._insert(token_ids, page_table_row, aligned, num_matched, handle)
        owned = aligned if handle_new is not None else 0  # the naive cache keeps nothing
        duplicate_end = min(cached, owned)
        if duplicate_end > num_matched:
            # Another request cached [num_matched, duplicate_end) first: free this one's copy, point the row at
            # the cache's. Before num_matched the row holds the cache's slots already; after, the cache adopted
            # the row's own.
            slots = self.prefix_cache.match_prefix(token_ids[:duplicate_end]).slots
            self.free(page_table_row[num_matched:duplicate_end:ps] // ps)
            page_table_row[num_matched:duplicate_end] = slots[num_matched:duplicate_end]
        self.prefix_cache.lock(handle_new)
        self.prefix_cache.unlock(handle)
        return handle_new, max(owned, num_matched)

    def _insert(
        self, token_ids: Sequence[int], page_table_row: torch.Tensor, aligned: int, num_matched: int, handle: Any
    ) -> tuple[int, Any]:
        """Offer the first `aligned` positions to the cache; returns where the request's own adopted part starts
        and the handle of the cached node that ends at `aligned` (None if the cache keeps nothing). The walk
        resumes at the request's locked handle: only the tokens past it are compared."""
        if aligned == 0:
            return 0, None
        cached, handle = self.prefix_cache.insert_node(token_ids[:aligned], page_table_row[:aligned], handle)
        # The locked matched prefix is always still cached, so cached >= num_matched.
        assert cached >= num_matched, f"prefix cache lost a locked prefix: {cached} < {num_matched}"
        return cached, handle

    # ------------------------------------------------------------------ checks

    def check_integrity(self, req_pages: int) -> None:
        """Assert every page is exactly one of free, cached or owned by a request."""
        if bool(self._freed_twice):
            raise DoubleFreeError("KV page freed twice (recorded on the device)")
        free, cached = len(self._free_pages), self.prefix_cache.cached_pages
        if free + cached + req_pages != self.num_pages:
            raise AssertionError(
                f"KV page leak: free {free} + cached {cached} + in requests {req_pages} != total {self.num_pages}"
            )
        if free and int(torch.unique(self._free_pages).numel()) != free:
            raise AssertionError("KV page freed twice: the free list holds duplicates")

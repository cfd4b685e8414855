"""RadixCache against a brute-force model: a dict of cached page-aligned prefixes with their slots."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minisgl.kvcache.radix import RadixCache


def slots_of_pages(pages: list[int], page_size: int) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * page_size + torch.arange(page_size)).flatten()


def pages_of(slots: torch.Tensor, page_size: int) -> list[int]:
    return (slots[::page_size] // page_size).tolist()


# ---------------------------------------------------------------------------- unit tests


def test_insert_splits_node_where_keys_diverge() -> None:
    cache = RadixCache(page_size=1)
    assert cache.insert([1, 2, 3, 4], torch.arange(4)) == 0
    assert cache.insert([1, 2, 5, 6], torch.arange(10, 14)) == 2
    (upper,) = cache.root.children.values()
    assert upper.key == [1, 2] and sorted(c.key for c in upper.children.values()) == [[3, 4], [5, 6]]
    assert cache.match_prefix([1, 2, 5, 6, 7]).slots.tolist() == [0, 1, 12, 13]
    assert cache.match_prefix([1, 2, 3, 9]).slots.tolist() == [0, 1, 2]
    assert cache.cached_pages == 6


def test_match_ending_inside_a_node_splits_it_and_returns_the_upper_part() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], torch.arange(4))
    handle, slots = cache.match_prefix([1, 2])
    assert slots.tolist() == [0, 1] and handle.key == [1, 2]
    assert [c.key for c in handle.children.values()] == [[3, 4]]
    cache.lock(handle)
    assert (cache.protected_pages, cache.evictable_pages) == (2, 2)
    assert sorted(cache.evict(10).tolist()) == [2, 3]  # the unlocked tail goes, the locked head stays


def test_match_is_page_aligned_and_splits_only_at_page_boundaries() -> None:
    cache = RadixCache(page_size=4)
    tokens = list(range(12))
    cache.insert(tokens, slots_of_pages([7, 3, 5], 4))
    assert cache.match_prefix(tokens[:7]).slots.tolist() == slots_of_pages([7], 4).tolist()
    diverge_mid_second_page = tokens[:6] + [99] + tokens[7:]
    assert cache.match_len(diverge_mid_second_page) == 4
    handle, slots = cache.match_prefix(diverge_mid_second_page)
    assert len(handle.key) == 4 and pages_of(slots, 4) == [7]
    assert cache.match_len(tokens + [1, 2]) == 12


def test_children_are_keyed_by_their_first_page() -> None:
    cache = RadixCache(page_size=4)
    cache.insert([0, 1, 2, 3, 4, 5, 6, 7], slots_of_pages([0, 1], 4))
    # Same first three tokens, different fourth: a different first page, so nothing is shared.
    assert cache.insert([0, 1, 2, 9, 4, 5, 6, 7], slots_of_pages([2, 3], 4)) == 0
    assert len(cache.root.children) == 2
    assert cache.insert([0, 1, 2, 3, 8, 8, 8, 8], slots_of_pages([4, 5], 4)) == 4


def test_insert_rejects_a_partial_page() -> None:
    with pytest.raises(ValueError, match="multiple of page_size"):
        RadixCache(page_size=4).insert([1, 2, 3], torch.arange(3))


def test_insert_copies_slots_so_the_caller_may_reuse_its_buffer() -> None:
    cache = RadixCache(page_size=1)
    row = torch.tensor([5, 6, 7])
    cache.insert([1, 2, 3], row)
    row.fill_(0)
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [5, 6, 7]


def test_evict_is_lru_over_leaves() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 1], torch.tensor([0, 1]))
    cache.insert([2, 2], torch.tensor([2, 3]))
    cache.insert([3, 3], torch.tensor([4, 5]))
    cache.match_prefix([1, 1])  # refresh: [2, 2] is now the oldest
    assert cache.evict(1).tolist() == [2, 3]  # whole nodes go, so 2 pages for a request of 1
    assert cache.evict(2).tolist() == [4, 5]
    assert cache.evict(2).tolist() == [0, 1]
    assert cache.evict(2).numel() == 0 and cache.cached_pages == 0


def test_evicting_a_child_makes_its_parent_an_evictable_leaf() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], torch.tensor([0, 1, 2]))
    cache.insert([1, 2, 4], torch.tensor([0, 1, 3]))
    cache.insert([9], torch.tensor([4]))
    assert cache.evict(1).tolist() == [2]  # [1,2]->[3] is the oldest leaf
    assert cache.evict(1).tolist() == [3]
    assert sorted(cache.evict(2).tolist()) == [0, 1]  # parent [1,2] is now an old leaf, older than [9]
    assert cache.evict(5).tolist() == [4]


def test_locked_prefix_is_never_evicted_until_unlocked() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 1, 2, 2], slots_of_pages([0, 1], 2))
    cache.insert([3, 3], slots_of_pages([2], 2))
    handle, _ = cache.match_prefix([1, 1, 2, 2])
    cache.lock(handle)
    cache.lock(handle)
    assert (cache.evictable_pages, cache.protected_pages) == (1, 2)
    assert cache.evict(10).tolist() == [2]
    cache.unlock(handle)
    assert cache.evict(10).numel() == 0
    cache.unlock(handle)
    assert (cache.evictable_pages, cache.protected_pages) == (2, 0)
    assert sorted(cache.evict(10).tolist()) == [0, 1]


def test_match_len_does_not_refresh_lru_time() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1], torch.tensor([0]))
    cache.insert([2], torch.tensor([1]))
    assert cache.match_len([1, 5]) == 1
    assert cache.evict(1).tolist() == [0]


def test_a_match_resumed_from_a_hint_refreshes_the_whole_path() -> None:
    """LRU as if the walk had started at the root: the hint's ancestors are touched too."""
    cache = RadixCache(1)
    cache.insert([1, 2], torch.tensor([10, 11]))
    cache.insert([1, 2, 3], torch.tensor([10, 11, 12]))  # [1, 2] -> [3]
    _, hint = cache.locate([1, 2, 3])
    cache.insert([7], torch.tensor([17]))
    cache.insert([8], torch.tensor([18]))
    assert cache.match_prefix([1, 2, 3, 4], hint).slots.tolist() == [10, 11, 12]  # after [7] and [8]
    assert cache.evict(1).tolist() == [17]
    assert cache.evict(1).tolist() == [18]
    assert cache.evict(1).tolist() == [12]
    assert sorted(cache.evict(2).tolist()) == [10, 11]


def test_a_stale_hint_is_ignored() -> None:
    cache = RadixCache(1)
    cache.insert([1, 2, 3], torch.tensor([10, 11, 12]))
    _, hint = cache.locate([1, 2, 3])
    cache.evict(3)
    assert cache.locate([1, 2, 3], hint)[0] == 0
    cache.insert([1, 2], torch.tensor([20, 21]))
    assert cache.match_prefix([1, 2, 3], hint).slots.tolist() == [20, 21]
    assert cache.locate([5, 2, 3], cache.locate([1, 2])[1]) == (0, None)  # not a prefix of these ids


def test_reset_returns_every_page_and_empties_the_tree() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 1, 2, 2], slots_of_pages([4, 5], 2))
    cache.insert([1, 1, 3, 3], slots_of_pages([9, 6], 2))
    freed = torch.cat(cache.reset())
    assert sorted(freed.tolist()) == [4, 5, 6] and cache.cached_pages == 0
    assert cache.match_len([1, 1]) == 0


def test_heap_stays_bounded_under_repeated_touches() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], torch.tensor([0, 1]))
    for _ in range(1000):
        cache.match_prefix([1, 2])
    assert len(cache._heap) <= 2 * 1 + 65
    assert cache.evict(1).tolist() == [0, 1]


# ---------------------------------------------------------------------------- stateful model


@dataclass
class Entry:
    slots: list[int]  # the slots of this prefix's last page
    time: int
    locks: int = 0


class ReferenceCache:
    """Brute force: every cached page-aligned prefix is a dict key; locks and LRU times per page."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.entries: dict[tuple[int, ...], Entry] = {}
        self.clock = 0

    def prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[: k * ps]) for k in range(1, len(tokens) // ps + 1)]

    def matched(self, tokens: list[int]) -> list[tuple[int, ...]]:
        out = []
        for p in self.prefixes(tokens):
            if p not in self.entries:
                break
            out.append(p)
        return out

    def touch(self, keys: list[tuple[int, ...]]) -> None:
        self.clock += 1
        for k in keys:
            self.entries[k].time = self.clock

    def is_leaf(self, key: tuple[int, ...]) -> bool:
        n = len(key) + self.page_size
        return not any(len(k) == n and k[: len(key)] == key for k in self.entries)

    def evict_one(self) -> int:
        leaves = [(e.time, k) for k, e in self.entries.items() if e.locks == 0 and self.is_leaf(k)]
        assert leaves, "the cache evicted more than the model can"
        leaves.sort()
        assert len(leaves) == 1 or leaves[0][0] != leaves[1][0], "two unlocked leaves share an access time"
        key = leaves[0][1]
        return self.entries.pop(key).slots[0] // self.page_size


BASE_LEN_PAGES = 6


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    total_pages = 400

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.cache = RadixCache(ps)
        self.ref = ReferenceCache(ps)
        self.free_pages = list(range(self.total_pages))
        self.held: list[tuple[object, list[tuple[int, ...]]]] = []
        # (tokens, hint) from earlier locate calls: later walks of those tokens (grown or not) resume there, however
        # the tree changed since (splits, evictions, resets).
        self.hints: list[tuple[list[int], object]] = []
        rng = random.Random(ps)
        root = [rng.randrange(4) for _ in range(2 * ps)]
        # Shared heads make prefixes overlap, so splits and partial matches happen often.
        self.bases = [root + [rng.randrange(4) for _ in range((BASE_LEN_PAGES - 2) * ps)] for _ in range(3)]
        self.bases.append([rng.randrange(4) for _ in range(BASE_LEN_PAGES * ps)])

    def sequence(self, choice: tuple[int, int, list[int]]) -> list[int]:
        base, cut, tail = choice
        return self.bases[base][:cut] + tail

    @staticmethod
    def sequences(page_size: int) -> st.SearchStrategy:
        return st.tuples(
            st.integers(0, 3),
            st.integers(0, BASE_LEN_PAGES * page_size),
            st.lists(st.integers(0, 1), max_size=2 * page_size),
        )

    @initialize()
    def start(self) -> None:
        assert self.cache.cached_pages == 0

    @rule(choice=st.data())
    def insert(self, choice: st.DataObject) -> None:
        self._insert(self.sequence(choice.draw(self.sequences(self.page_size))))

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 1000), extra=st.lists(st.integers(0, 1), max_size=12))
    def insert_from_locked_handle(self, index: int, extra: list[int]) -> None:
        """A request caches its grown prompt: the walk resumes at the handle it holds."""
        handle, keys = self.held[index % len(self.held)]
        self._insert(list(keys[-1]) + extra, start=handle)

    def _insert(self, tokens: list[int], start: object = None) -> None:
        ps = self.page_size
        tokens = tokens[: len(tokens) - len(tokens) % ps]
        npages = len(tokens) // ps
        if npages > len(self.free_pages):
            return
        pages, self.free_pages = self.free_pages[:npages], self.free_pages[npages:]
        slots = slots_of_pages(pages, ps) if pages else torch.empty(0, dtype=torch.int64)
        got = self.cache.insert_node(tokens, slots, start)[0] if start is not None else self.cache.insert(tokens, slots)
        done = len(self.ref.matched(tokens))
        assert got == done * ps
        self.free_pages += pages[:done]  # the caller keeps (and frees) its duplicates
        for i, key in enumerate(self.ref.prefixes(tokens)[done:], start=done):
            self.ref.entries[key] = Entry(slots_of_pages([pages[i]], ps).tolist(), 0)
        self.ref.touch(self.ref.prefixes(tokens))

    @rule(choice=st.data(), lock=st.booleans())
    def match(self, choice: st.DataObject, lock: bool) -> None:
        ps = self.page_size
        self._match(self.sequence(choice.draw(self.sequences(ps))), lock)

    @precondition(lambda self: self.hints)
    @rule(index=st.integers(0, 1000), extra=st.lists(st.integers(0, 1), max_size=12), lock=st.booleans())
    def match_from_hint(self, index: int, extra: list[int], lock: bool) -> None:
        tokens, hint = self.hints[index % len(self.hints)]
        self._match(tokens + extra, lock, start=hint)

    def _match(self, tokens: list[int], lock: bool, start: object = None) -> None:
        ps = self.page_size
        keys = self.ref.matched(tokens)
        assert self.cache.match_len(tokens) == len(keys) * ps
        length, hint = self.cache.locate(tokens, start)
        assert length == len(keys) * ps
        if hint is not None:
            self.hints.append((tokens, hint))
        handle, slots = self.cache.match_prefix(tokens, start)
        assert slots.tolist() == [s for k in keys for s in self.ref.entries[k].slots]
        assert (handle is None) == (not keys)
        self.ref.touch(keys)
        if lock and handle is not None:
            self.cache.lock(handle)
            for k in keys:
                self.ref.entries[k].locks += 1
            self.held.append((handle, keys))

    @precondition(lambda self: self.held)
    @rule(
        index=st.integers(0, 1000),
        cut=st.integers(0, 1000),
        extra=st.lists(st.integers(0, 1), max_size=8),
        lock=st.booleans(),
    )
    def match_inside_locked(self, index: int, cut: int, extra: list[int], lock: bool) -> None:
        """Match a shorter or diverging version of a locked prefix: splits a locked node."""
        tokens = list(self.held[index % len(self.held)][1][-1])
        self._match(tokens[: cut % (len(tokens) + 1)] + extra, lock)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 1000))
    def unlock(self, index: int) -> None:
        handle, keys = self.held.pop(index % len(self.held))
        self.cache.unlock(handle)
        for k in keys:
            self.ref.entries[k].locks -= 1

    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages: int) -> None:
        evictable = sum(e.locks == 0 for e in self.ref.entries.values())
        evicted = self.cache.evict(num_pages).tolist()
        assert len(evicted) >= min(num_pages, evictable)
        assert len(set(evicted)) == len(evicted)
        # Replaying LRU over unlocked leaves page by page must pick exactly the same pages.
        expected = [self.ref.evict_one() for _ in evicted]
        assert sorted(evicted) == sorted(expected)
        self.free_pages += evicted

    @precondition(lambda self: not self.held)
    @rule()
    def reset(self) -> None:
        freed = torch.cat(self.cache.reset()).tolist() if self.ref.entries else []
        assert sorted(freed) == sorted(e.slots[0] // self.page_size for e in self.ref.entries.values())
        self.ref.entries.clear()
        self.free_pages += freed

    @invariant()
    def page_counts_match_the_model(self) -> None:
        locked = sum(e.locks > 0 for e in self.ref.entries.values())
        assert self.cache.protected_pages == locked
        assert self.cache.evictable_pages == len(self.ref.entries) - locked
        assert len(self.free_pages) + self.cache.cached_pages == self.total_pages


class RadixMachinePage4(RadixMachine):
    page_size = 4


_settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestRadixCachePage1 = RadixMachine.TestCase
TestRadixCachePage1.settings = _settings
TestRadixCachePage4 = RadixMachinePage4.TestCase
TestRadixCachePage4.settings = _settings

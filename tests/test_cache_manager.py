"""CacheManager: every KV page is exactly one of free, cached or owned by a running request."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from minisgl.errors import ConfigError
from minisgl.kvcache.manager import CacheManager, DoubleFreeError, make_prefix_cache
from minisgl.kvcache.naive import NaiveCache
from minisgl.kvcache.radix import RadixCache
from minisgl.kvcache.table import TableManager


def make(num_pages: int, page_size: int, kind: str = "radix") -> CacheManager:
    return CacheManager(num_pages, page_size, make_prefix_cache(kind, page_size), "cpu")


def own_pages(mgr: CacheManager, row: torch.Tensor, length: int, num_matched: int) -> list[int]:
    end = -(-length // mgr.page_size) * mgr.page_size
    return (row[num_matched : end : mgr.page_size] // mgr.page_size).tolist()


# ---------------------------------------------------------------------------- allocation


def test_allocate_takes_free_pages_then_evicts_unlocked_cache_pages() -> None:
    mgr = make(4, 1)
    pages = mgr.allocate_pages(4)
    assert sorted(pages.tolist()) == [0, 1, 2, 3] and mgr.free_pages == 0
    mgr.prefix_cache.insert([7, 8], pages[:2])  # cache adopts two pages
    mgr.free(pages[2:])
    assert (mgr.free_pages, mgr.available_pages) == (2, 4)
    got = mgr.allocate_pages(3)
    assert got is not None and len(got) == 3 and mgr.prefix_cache.cached_pages == 0
    mgr.check_integrity(req_pages=3)


def test_allocate_returns_none_and_changes_nothing_when_pages_cannot_be_had() -> None:
    mgr = make(4, 1)
    pages = mgr.allocate_pages(2)
    mgr.prefix_cache.insert([1, 2], pages)
    handle, _ = mgr.match_prefix([1, 2])
    mgr.lock(handle)
    assert mgr.allocate_pages(3) is None
    assert (mgr.free_pages, mgr.prefix_cache.cached_pages) == (2, 2)
    mgr.check_integrity(req_pages=0)


def test_freeing_a_page_twice_raises_and_changes_nothing() -> None:
    mgr = make(4, 1)
    pages = mgr.allocate_pages(2)
    mgr.free(pages[:1])
    with pytest.raises(DoubleFreeError, match=r"freed twice: \[%d\]" % int(pages[0])):
        mgr.free(pages[:1])
    with pytest.raises(DoubleFreeError):
        mgr.free(torch.cat([pages[1:], pages[1:]]))  # twice in one call
    with pytest.raises(DoubleFreeError):
        mgr.free(torch.tensor([3]))  # never allocated
    assert mgr.free_pages == 3
    mgr.check_integrity(req_pages=1)
    mgr.free(pages[1:])
    mgr.check_integrity(req_pages=0)


def test_unknown_prefix_cache_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="radix"):
        make_prefix_cache("lru", 1)


@pytest.mark.parametrize("page_size", [1, 16])
def test_slots_for_extend_fills_the_partial_page_before_taking_new_ones(page_size: int) -> None:
    mgr = make(8, page_size)
    row = torch.full((8 * page_size,), -1, dtype=torch.int64)
    slots, new = mgr.slots_for_extend(row, 0, 5)
    assert new == -(-5 // page_size) and row[:5].tolist() == slots.tolist()
    slots2, new2 = mgr.slots_for_extend(row, 5, 2 * page_size + 3)
    assert new2 == -(-(2 * page_size + 3) // page_size) - -(-5 // page_size)
    assert row[5 : 2 * page_size + 3].tolist() == slots2.tolist()
    # Within a page, slots are contiguous from the page's first slot.
    for pos in range(2 * page_size + 3):
        assert row[pos] % page_size == pos % page_size
        assert row[pos] // page_size == row[pos - pos % page_size] // page_size
    mgr.check_integrity(req_pages=mgr.req_pages(2 * page_size + 3, 0))


def test_slots_for_extend_that_cannot_be_served_changes_nothing() -> None:
    mgr = make(2, 4)
    row = torch.zeros(16, dtype=torch.int64)
    assert mgr.slots_for_extend(row, 0, 6) is not None
    before = row.clone()
    assert mgr.slots_for_extend(row, 6, 13) is None
    assert torch.equal(row, before) and mgr.free_pages == 0


# ---------------------------------------------------------------------------- release / cache_prefix


def test_release_caches_the_aligned_prefix_and_frees_the_partial_tail() -> None:
    mgr = make(8, 4)
    row = torch.zeros(32, dtype=torch.int64)
    tokens = list(range(10))
    mgr.slots_for_extend(row, 0, 10)
    mgr.release(tokens, row, 10, 0, None)
    assert mgr.prefix_cache.cached_pages == 2 and mgr.free_pages == 6
    assert mgr.match_prefix(tokens).slots.tolist() == row[:8].tolist()
    mgr.check_integrity(req_pages=0)


def test_release_frees_pages_that_another_request_cached_meanwhile() -> None:
    mgr = make(8, 2)
    tokens = [1, 2, 3, 4, 5]
    rows = torch.zeros((2, 8), dtype=torch.int64)
    for r in rows:  # both computed the same prompt before either finished
        mgr.slots_for_extend(r, 0, 5)
    assert mgr.free_pages == 2
    mgr.release(tokens, rows[0], 5, 0, None)
    mgr.release(tokens, rows[1], 5, 0, None)
    assert mgr.prefix_cache.cached_pages == 2 and mgr.free_pages == 6
    mgr.check_integrity(req_pages=0)


def test_release_with_a_matched_prefix_keeps_the_borrowed_pages_cached() -> None:
    mgr = make(8, 2)
    row = torch.zeros(16, dtype=torch.int64)
    mgr.slots_for_extend(row, 0, 4)
    mgr.release([1, 2, 3, 4], row, 4, 0, None)
    handle, slots = mgr.match_prefix([1, 2, 3, 4, 5])
    mgr.lock(handle)
    row2 = torch.zeros(16, dtype=torch.int64)
    row2[:4] = slots
    mgr.slots_for_extend(row2, 4, 7)
    assert mgr.req_pages(7, 4) == 2
    mgr.check_integrity(req_pages=2)
    mgr.release([1, 2, 3, 4, 5, 6, 7], row2, 7, 4, handle)
    assert mgr.prefix_cache.cached_pages == 3 and mgr.prefix_cache.protected_pages == 0
    mgr.check_integrity(req_pages=0)


def test_alloc_len_frees_pages_reserved_beyond_the_computed_length() -> None:
    mgr = make(8, 2)
    row = torch.zeros(16, dtype=torch.int64)
    mgr.slots_for_extend(row, 0, 7)
    mgr.release(list(range(5)), row, 5, 0, None, alloc_len=7)
    assert mgr.prefix_cache.cached_pages == 2 and mgr.free_pages == 6


def test_cache_prefix_shares_an_unfinished_request_and_moves_its_lock() -> None:
    mgr = make(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    first, second = torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    mgr.slots_for_extend(first, 0, 5)
    mgr.slots_for_extend(second, 0, 5)
    handle, matched = mgr.cache_prefix(tokens, first, 5, 0, None)
    assert matched == 4 and mgr.prefix_cache.protected_pages == 2
    # The second copy's aligned part is a duplicate: freed, and its row now points at the cache.
    handle2, matched2 = mgr.cache_prefix(tokens, second, 5, 0, None)
    assert matched2 == 4 and second[:4].tolist() == first[:4].tolist()
    mgr.check_integrity(req_pages=mgr.req_pages(5, 4) * 2)
    assert mgr.allocate_pages(mgr.available_pages + 1) is None  # the shared prefix is locked
    handle, matched = mgr.cache_prefix(tokens, first, 5, matched, handle)  # nothing new: unchanged
    assert matched == 4
    mgr.release(tokens, first, 5, matched, handle)
    mgr.release(tokens, second, 5, matched2, handle2)
    assert mgr.prefix_cache.protected_pages == 0
    mgr.check_integrity(req_pages=0)


def test_naive_cache_reuses_nothing_and_frees_everything() -> None:
    mgr = make(4, 2, "naive")
    row = torch.zeros(8, dtype=torch.int64)
    mgr.slots_for_extend(row, 0, 5)
    before = row.clone()
    handle, matched = mgr.cache_prefix([1, 2, 3, 4, 5], row, 5, 0, None)
    assert (handle, matched) == (None, 0) and torch.equal(row, before) and mgr.free_pages == 1
    mgr.release([1, 2, 3, 4, 5], row, 5, 0, None)
    assert mgr.free_pages == 4 and mgr.match_prefix([1, 2]).slots.numel() == 0
    assert isinstance(mgr.prefix_cache, NaiveCache)


def test_table_manager_hands_out_each_row_once() -> None:
    table = TableManager(2, 8, "cpu")
    assert table.page_table.shape == (2, 8) and table.page_table.dtype == torch.int64
    rows = [table.allocate(), table.allocate()]
    assert sorted(rows) == [0, 1] and table.allocate() is None and table.num_free == 0
    table.free(rows[0])
    with pytest.raises(ValueError):
        table.free(rows[0])
    assert table.allocate() == rows[0]


# ---------------------------------------------------------------------------- random traffic


@dataclass
class SimReq:
    tokens: list[int]
    prompt_len: int
    row: int
    handle: Any
    length: int  # positions with KV (and slots)
    num_matched: int
    hashes: list[int] = field(default_factory=list)

    def hash_upto(self, n: int) -> list[int]:
        while len(self.hashes) < n:
            prev = self.hashes[-1] if self.hashes else 0
            self.hashes.append(hash((prev, self.tokens[len(self.hashes)])))
        return self.hashes[:n]


class Simulation:
    """Requests that start, extend in chunks, decode, get cached, finish, abort or get retracted.

    A fake KV pool stores a hash of the whole prefix at each slot, so a request reading KV that
    another request overwrote, or a match returning the wrong slots, shows up as a mismatch.
    """

    def __init__(self, page_size: int, kind: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ps = page_size
        self.mgr = make(192 // page_size, page_size, kind)  # small: forces eviction and retraction
        self.table = TableManager(6, 160, "cpu")
        self.kv = [None] * (self.mgr.num_pages * page_size)
        self.reqs: list[SimReq] = []
        self.docs = [[self.rng.randrange(50) for _ in range(64)] for _ in range(3)]

    def prompt(self) -> list[int]:
        doc = self.rng.choice(self.docs)
        return doc[: self.rng.randrange(1, 65)] + [self.rng.randrange(50) for _ in range(self.rng.randrange(0, 20))]

    def step(self) -> None:
        action = self.rng.choices(["start", "extend", "finish", "abort"], [3, 8, 1, 1])[0]
        if action == "start" or not self.reqs:
            self.start()
        elif action == "extend":
            self.extend(self.rng.choice(self.reqs))
        else:
            self.release(self.rng.choice(self.reqs))
        self.check()

    def start(self) -> None:
        row = self.table.allocate()
        if row is None:
            return
        tokens = self.prompt()
        handle, slots = self.mgr.match_prefix(tokens[:-1])
        self.mgr.lock(handle)
        req = SimReq(tokens, len(tokens), row, handle, len(slots), len(slots))
        assert len(slots) % self.ps == 0
        assert [self.kv[s] for s in slots.tolist()] == req.hash_upto(len(slots)), "matched KV of another prefix"
        self.table.page_table[row, : len(slots)] = slots
        self.reqs.append(req)

    def extend(self, req: SimReq) -> None:
        chunk = self.rng.randrange(1, 24) if req.length < req.prompt_len else 1
        new_len = min(req.length + chunk, len(req.tokens))
        row = self.table.page_table[req.row]
        before_free, before_row = self.mgr.free_pages, row.clone()
        got = self.mgr.slots_for_extend(row, req.length, new_len)
        if got is None:
            assert self.mgr.free_pages == before_free and torch.equal(row, before_row)
            self.release(req)  # retract under KV pressure
            return
        slots, _ = got
        assert slots.tolist() == row[req.length : new_len].tolist()
        for s, h in zip(slots.tolist(), req.hash_upto(new_len)[req.length :]):
            self.kv[s] = h
        req.length = new_len
        if req.length == len(req.tokens):  # sampled: one more token, its KV comes next step
            req.tokens.append(self.rng.randrange(50))
        if self.rng.random() < 0.5:
            req.handle, req.num_matched = self.mgr.cache_prefix(
                req.tokens, row, req.length, req.num_matched, req.handle
            )

    def release(self, req: SimReq) -> None:
        row = self.table.page_table[req.row]
        assert [self.kv[s] for s in row[: req.length].tolist()] == req.hash_upto(req.length), "KV overwritten"
        self.mgr.release(req.tokens, row, req.length, req.num_matched, req.handle)
        self.table.free(req.row)
        self.reqs.remove(req)

    def check(self) -> None:
        mgr = self.mgr
        mgr.check_integrity(sum(mgr.req_pages(r.length, r.num_matched) for r in self.reqs))
        owned = [p for r in self.reqs for p in own_pages(mgr, self.table.page_table[r.row], r.length, r.num_matched)]
        cached = []
        if isinstance(mgr.prefix_cache, RadixCache):
            cached = [p for n in mgr.prefix_cache._nodes() for p in (n.value[:: self.ps] // self.ps).tolist()]
        everything = mgr._free_pages.tolist() + cached + owned
        assert sorted(everything) == list(range(mgr.num_pages)), "a page is in two places or none"


@pytest.mark.parametrize("kind", ["radix", "naive"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_never_leaks_or_shares_a_page(page_size: int, kind: str, seed: int) -> None:
    sim = Simulation(page_size, kind, seed)
    for _ in range(300):
        sim.step()
    while sim.reqs:
        sim.release(sim.reqs[0])
    mgr = sim.mgr
    assert mgr.prefix_cache.protected_pages == 0
    assert mgr.free_pages + mgr.prefix_cache.cached_pages == mgr.num_pages
    freed = mgr.prefix_cache.evict(mgr.prefix_cache.cached_pages)
    mgr.free(freed)
    assert mgr.free_pages == mgr.num_pages
    mgr.check_integrity(req_pages=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pages_are_allocated_and_freed_on_the_gpu_without_waiting_for_it() -> None:
    """The scheduler allocates and frees pages while a forward is in flight: neither may synchronize the stream (a
    tensor-indexed write of a Python scalar copies it from the host and waits for the GPU: every decode step that
    opened a page idled the GPU for the host's whole scheduling)."""
    mgr = CacheManager(64, 16, make_prefix_cache("radix", 16), "cuda")
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        pages = mgr.allocate_pages(8)
        mgr.free(pages[:4])
        more = mgr.allocate_pages(6)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert more is not None and len(more) == 6
    mgr.check_integrity(req_pages=10)

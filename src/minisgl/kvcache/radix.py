"""The radix prefix cache: a tree of token-id edges whose nodes own the KV slots of their edge.

Every edge is a whole number of pages, so a node's pages are ``value[::page_size] // page_size``.
Children are keyed by the first page of their edge (the first token when page_size == 1), so a
walk costs O(len(token_ids)) with list compares done a page (or a run of pages) at a time.
Eviction is LRU over unlocked leaves: a lazy heap of (last_access, seq, node) entries, checked
against the node when popped, so touching a node never has to search the heap.

A walk can resume from a node an earlier walk of the same ids reached (`start`: a request's locked
handle, or the hint `locate` returned): nodes never move (a split keeps a node's end, eviction
detaches a leaf), so the node's end is found by following parents, and only the tokens past it are
compared. A waiting request ranked at every step, and a request caching its prompt, no longer
compare their whole prompt again and again (agent turns: tens of nodes deep).
"""

from __future__ import annotations

import heapq
from typing import Any, Sequence

import torch

from minisgl.kvcache.base import MatchResult, PrefixCache

# Pages compared per slice before falling back to page-by-page: few Python steps either way.
_COARSE_PAGES = 32


class RadixNode:
    __slots__ = ("key", "value", "parent", "children", "ref_count", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: RadixNode | None, last_access: int) -> None:
        self.key = key  # token ids of the edge from parent to this node
        self.value = value  # [len(key)] int64 KV slots of those tokens
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[Any, RadixNode] = {}
        self.ref_count = 0
        self.last_access = last_access

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, ref={self.ref_count}, t={self.last_access})"


def _common_len(key: list[int], ids: list[int], start: int, page_size: int) -> int:
    """Length of the longest page-aligned common prefix of key and ids[start:]."""
    n = min(len(key), len(ids) - start)
    n -= n % page_size
    if (key if n == len(key) else key[:n]) == ids[start : start + n]:  # the usual case: the whole edge, one slice
        return n
    lo, step = 0, page_size * _COARSE_PAGES
    while lo + step <= n and key[lo : lo + step] == ids[start + lo : start + lo + step]:
        lo += step
    while lo + page_size <= n and key[lo : lo + page_size] == ids[start + lo : start + lo + page_size]:
        lo += page_size
    return lo


class RadixCache(PrefixCache):
    def __init__(self, page_size: int, device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = RadixNode([], self._empty, None, 0)
        self._clock = 0  # a counter, not wall time, so LRU order is deterministic
        self._push_seq = 0
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._num_nodes = 0
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ queries

    def match_prefix(self, token_ids: Sequence[int], start: Any = None) -> MatchResult:
        ids = _as_list(token_ids)
        node, _, _, values = self._walk(ids, split=True, tick=self._tick(), start=start)
        self._touched(node)
        if node is self.root:
            return MatchResult(None, self._empty)
        return MatchResult(node, values[0] if len(values) == 1 else torch.cat(values))

    def match_len(self, token_ids: Sequence[int]) -> int:
        """Page-aligned cached length of token_ids; leaves the tree and LRU times untouched."""
        return self.locate(token_ids)[0]

    def locate(self, token_ids: Sequence[int], start: Any = None) -> tuple[int, Any]:
        """match_len, and the deepest whole node matched: the `start` of the next walk of these ids."""
        node, _, length, _ = self._walk(_as_list(token_ids), split=False, tick=None, start=start)
        return length, (node if node is not self.root else None)

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    # ------------------------------------------------------------------ updates

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        return self.insert_node(token_ids, slots)[0]

    def insert_node(self, token_ids: Sequence[int], slots: torch.Tensor, start: Any = None) -> tuple[int, Any]:
        ids = _as_list(token_ids)
        n = len(ids)
        if n % self.page_size:
            raise ValueError(f"insert needs a multiple of page_size={self.page_size} tokens, got {n}")
        if len(slots) < n:
            raise ValueError(f"insert got {len(slots)} slots for {n} tokens")
        tick = self._tick()
        node, _, cached, _ = self._walk(ids, split=True, tick=tick, start=start)
        if cached < n:
            # Clone: the caller's slots are usually a view of a page-table row that gets reused.
            value = slots[cached:n].to(device=self.device, dtype=torch.int64, copy=True)
            leaf = RadixNode(ids[cached:], value, node, tick)
            node.children[self._edge(leaf.key, 0)] = leaf
            self._num_nodes += 1
            self._evictable += len(leaf.key) // self.page_size
            node = leaf
        self._touched(node)
        return cached, (node if node is not self.root else None)

    def lock(self, handle: Any) -> None:
        if handle is None:
            return
        node: RadixNode = handle
        assert node.parent is not None, "lock of an evicted node: lock right after match_prefix"
        while node is not self.root:
            if node.ref_count == 0:
                pages = len(node.key) // self.page_size
                self._evictable -= pages
                self._protected += pages
            node.ref_count += 1
            node = node.parent

    def unlock(self, handle: Any) -> None:
        if handle is None:
            return
        leaf: RadixNode = handle
        node = leaf
        while node is not self.root:
            assert node.ref_count > 0, "unlock without a matching lock"
            node.ref_count -= 1
            if node.ref_count == 0:
                pages = len(node.key) // self.page_size
                self._evictable += pages
                self._protected -= pages
            node = node.parent
        if leaf.ref_count == 0 and leaf.is_leaf:
            self._push(leaf)

    def evict(self, num_pages: int) -> torch.Tensor:
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_pages and self._heap:
            t, _, node = heapq.heappop(self._heap)
            if node.last_access != t or not self._is_evictable_leaf(node):
                continue  # stale entry: the node was touched, locked, grew children or is gone
            parent = node.parent
            assert parent is not None
            del parent.children[self._edge(node.key, 0)]
            node.parent = None
            self._num_nodes -= 1
            pages = len(node.key) // self.page_size
            self._evictable -= pages
            count += pages
            freed.append(node.value[:: self.page_size] // self.page_size)
            if parent is not self.root and self._is_evictable_leaf(parent):
                self._push(parent)
        return torch.cat(freed) if freed else self._empty

    def reset(self) -> list[torch.Tensor]:
        assert self._protected == 0, f"reset with {self._protected} locked pages"
        pages = [n.value[:: self.page_size] // self.page_size for n in self._nodes()]
        self._init_tree()
        return pages

    # ------------------------------------------------------------------ internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _edge(self, ids: list[int], pos: int) -> Any:
        return ids[pos] if self.page_size == 1 else tuple(ids[pos : pos + self.page_size])

    def _walk(
        self, ids: list[int], split: bool, tick: int | None, start: Any = None
    ) -> tuple[RadixNode, int, int, list[torch.Tensor]]:
        """Follow ids down the tree (from `start` when it is still on their path); returns the deepest whole node
        matched, its end, the matched length and, with split, the slots of every node down to it.

        With split, a match that ends inside an edge splits it there, so the result is a node boundary.
        """
        n = len(ids) - len(ids) % self.page_size
        node, pos, values = self._resume(start, ids, n, tick, split) if start is not None else (self.root, 0, [])
        end = pos
        while pos < n:
            child = node.children.get(self._edge(ids, pos))
            if child is None:
                break
            common = _common_len(child.key, ids, pos, self.page_size)
            if common < len(child.key):
                if not split:
                    pos += common
                    break
                child = self._split(child, common)
            node = child
            pos += common
            end = pos
            if split:
                values.append(node.value)
            if tick is not None:
                node.last_access = tick
        return node, end, pos, values

    def _resume(
        self, start: RadixNode, ids: list[int], n: int, tick: int | None, values: bool
    ) -> tuple[RadixNode, int, list[torch.Tensor]]:
        """(start, its end, the slots down to it) when start is in this tree and ends with ids' tokens there; else
        the root. Following parents costs no token compares; the nodes on the way are touched as a walk would."""
        path: list[RadixNode] = []
        node: RadixNode | None = start
        end = 0
        while node is not None and node is not self.root:
            path.append(node)
            end += len(node.key)
            node = node.parent
        # Detached (evicted, or a tree before reset) or not these ids' prefix: walk from the root.
        if node is not self.root or end > n or ids[end - len(start.key) : end] != start.key:
            return self.root, 0, []
        if tick is not None:
            for p in path:
                p.last_access = tick
        return start, end, [p.value for p in reversed(path)] if values else []

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge at `at` (page aligned); returns the new upper node, node keeps the rest."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % self.page_size == 0
        upper = RadixNode(node.key[:at], node.value[:at], parent, node.last_access)
        upper.ref_count = node.ref_count  # every lock through node also passes through upper
        parent.children[self._edge(node.key, 0)] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[self._edge(node.key, 0)] = node
        self._num_nodes += 1
        return upper

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and node.ref_count == 0 and not node.children

    def _touched(self, node: RadixNode) -> None:
        # Only the last node of a walk can be a leaf; its old heap entry is stale now.
        if node is not self.root and self._is_evictable_leaf(node):
            self._push(node)

    def _push(self, node: RadixNode) -> None:
        self._push_seq += 1
        heapq.heappush(self._heap, (node.last_access, self._push_seq, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()  # drop stale entries; amortised O(1) per push

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self._nodes():
            if self._is_evictable_leaf(node):
                self._push_seq += 1
                self._heap.append((node.last_access, self._push_seq, node))
        heapq.heapify(self._heap)

    def _nodes(self) -> list[RadixNode]:
        """Every node but the root."""
        out: list[RadixNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _as_list(token_ids: Sequence[int]) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return token_ids if isinstance(token_ids, list) else list(token_ids)

"""Prefill admission: which waiting requests enter the next batch, and how much of each.

The waiting queue is ranked by cached prefix (longest first, "lpm") without starving anyone; the
cached prefixes the next waiting requests will reuse are locked while a batch is admitted; a prompt
longer than the step's allowance (budget.py: max_prefill_tokens, and beside decoding requests what is left of their
gap between tokens) is prefilled in chunks across steps, one prompt at a time; a request that shares a long
uncached prefix with one admitted in the same batch waits one step to read it from the cache.
That check is a dict look-up per request (BatchPrefixes), not a comparison with every admitted prompt:
a burst of agent turns puts tens of long prompts in each batch.

With nothing running, partly prefilled prompts that block each other are rolled back but one
(_resume_stalled): no decode step would.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from minisgl.config import EngineConfig
from minisgl.core import Batch, Phase, Req
from minisgl.scheduler.budget import Allowance
from minisgl.scheduler.kv import ReqKV

# A waiting request skipped this many times by prefix-aware ordering goes first (no starvation).
STARVATION_LIMIT = 8
# Beyond this many waiting requests, ranking by prefix match costs more than it saves.
LPM_MAX_WAITING = 512
# A request sharing at least this many uncached tokens with one admitted in the same batch
# waits one step and reads that prefix from the cache instead of computing it again.
IN_BATCH_SHARE_MIN = 16
# Admitting requests must not evict the cached prefixes the next few waiting ones will reuse.
PROTECT_WAITING = 8


class BatchPrefixes:
    """The prompts admitted to one batch, indexed to answer: does any of them extend `ids` past its cached prefix?

    Each prompt is filed under (its cached length, the `width` tokens after it). Two prompts that share more than
    the longer of their cached prefixes have equal cached prefixes (the shared tokens up to a cached point are
    cached for both), so a request needs to look only under (its own cached length, its next tokens).
    """

    def __init__(self, width: int, page_size: int) -> None:
        self.width = width
        self.page_size = page_size
        self._by_key: dict[tuple[int, tuple[int, ...]], list[list[int]]] = {}

    def add(self, ids: list[int], cached: int) -> None:
        cached -= cached % self.page_size
        window = ids[cached : cached + self.width]
        if len(window) == self.width:
            self._by_key.setdefault((cached, tuple(window)), []).append(ids)

    def extends(self, ids: list[int], cached: int) -> bool:
        """True when an added prompt shares at least `width` tokens of ids past `cached` (page aligned), the
        last token of ids excluded (it is always computed)."""
        need = cached + self.width
        if need > len(ids) - 1:
            return False
        return any(
            _same_prefix(other, ids, cached) for other in self._by_key.get((cached, tuple(ids[cached:need])), ())
        )


def _same_prefix(a: list[int], b: list[int], n: int) -> bool:
    """a[:n] == b[:n], compared from the end in growing slices: prompts of one burst that share a window (agents whose
    replies end alike) differ a few hundred tokens back, not at the shared system prompt, so a miss costs little."""
    hi, step = n, 64
    while hi > 0:
        lo = max(0, hi - step)
        if a[lo:hi] != b[lo:hi]:
            return False
        hi, step = lo, step * 4
    return True


class PrefillManager:
    def __init__(self, config: EngineConfig, kv: ReqKV) -> None:
        self.config = config
        self.kv = kv
        self.cache = kv.cache
        self.page_size = kv.page_size
        # Shared tokens worth a step's wait, in whole pages (only whole pages are cached).
        self.min_share = -(-IN_BATCH_SHARE_MIN // self.page_size) * self.page_size
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # prefill in progress across steps

    def schedule(self, running: list[Req], allowance: Allowance) -> Batch | None:
        """The next prefill batch next to `running` (the decoding requests) within `allowance`, or None."""
        # Only while something runs: its pages come back, so protection cannot stall the queue. Only when this
        # admission may evict: each admitted request allocates at most its extend's pages plus one partial page.
        may_evict = self.cache.free_pages < self.config.max_prefill_tokens // self.page_size + len(self.waiting) + 2
        protected = self._lock_waiting_prefixes() if running and may_evict and self.config.cache == "radix" else []
        try:
            batch = self._admit_batch(len(running), allowance)
        finally:
            for handle in protected:
                self.cache.unlock(handle)
        if batch is None and not running:
            batch = self._resume_stalled(allowance)
        return batch

    def defer_chunk(self) -> None:
        """A decode step runs before the next chunk: the prompt waits at the queue's front, keeping its row and pages,
        where a decode step short of pages can roll it back (decode.py)."""
        if self.chunked is not None:
            self.waiting.appendleft(self.chunked)
            self.chunked = None

    def _resume_stalled(self, allowance: Allowance) -> Batch | None:
        """Nothing runs and nothing could be admitted: partly prefilled prompts hold the pages the others need (two
        of them, or a request ranked first that cannot fit beside one), and no decode will roll them back. Keep the
        one furthest along, roll the others back and continue it first: alone it fits the pool (check_request)."""
        holders = [r for r in self.waiting if r.table_idx >= 0]
        if not holders:
            return None
        keep = max(holders, key=lambda r: r.cached_len)
        for req in holders:
            if req is not keep:
                self.kv.roll_back(req)
        self.waiting.remove(keep)
        self.chunked = keep
        return self._admit_batch(0, allowance)

    def _ordered_waiting(self) -> list[tuple[Req, int | None]]:
        """The waiting requests in admission order, each with its cached prefix length when ranking computed it."""
        if self.config.schedule_policy != "lpm" or self.config.cache != "radix" or len(self.waiting) > LPM_MAX_WAITING:
            return [(r, None) for r in self.waiting]
        starved = [(r, None) for r in self.waiting if r.skipped >= STARVATION_LIMIT]
        rest = [(r, self._cached_len(r)) for r in self.waiting if r.skipped < STARVATION_LIMIT]
        rest.sort(key=lambda pair: -pair[1])  # stable: ties keep arrival order
        return starved + rest

    def _cached_len(self, req: Req) -> int:
        """req's cached prefix now; the walk resumes where its last one ended (req.prefix_hint)."""
        length, req.prefix_hint = self.cache.locate(req.input_ids[: req.seq_len - 1], req.prefix_hint)
        return length

    def _lock_waiting_prefixes(self) -> list[Any]:
        handles = []
        for req in list(self.waiting)[:PROTECT_WAITING]:
            if req.table_idx < 0:
                handle, _ = self.cache.match_and_lock(req.input_ids[: req.seq_len - 1], req.prefix_hint)
                if handle is not None:
                    handles.append(handle)
        return handles

    def _admit_batch(self, num_running: int, allowance: Allowance) -> Batch | None:
        chosen: list[tuple[Req, int]] = []  # (req, extend_len)
        if self.chunked is not None:
            req = self.chunked
            extend = allowance.fit(req.cached_len, req.seq_len - req.cached_len)
            if extend <= 0:  # the decodes' gap is spent: their step first, the chunk after it
                self.defer_chunk()
                return None
            self.chunked = None
            if self.kv.reserve(req, extend):
                chosen.append((req, extend))
                allowance.take(req.cached_len, extend, req.seq_len - req.cached_len)
            else:
                self.waiting.appendleft(req)  # keeps its row and pages; resumes when memory frees up
        admitted: list[Req] = []
        share = self.config.cache == "radix"
        batch_prompts = BatchPrefixes(self.min_share, self.page_size)
        for r, _ in chosen if share else ():
            batch_prompts.add(r.input_ids, r.cached_len)
        for req, cached in self._ordered_waiting():
            if allowance.exhausted or num_running + len(chosen) >= self.config.max_running_requests:
                break
            if req.wait_for is not None and not self._prefilled(req.wait_for):
                continue
            fresh = req.table_idx < 0
            if fresh and share and not req.wants_prompt_logprobs:
                if cached is None:
                    cached = self._cached_len(req)
                if batch_prompts.extends(req.input_ids, cached):
                    continue
            if fresh and not self.kv.admit(req):
                break  # no free table row
            extend = allowance.fit(req.cached_len, req.seq_len - req.cached_len)
            # Leave room for the running requests' next decode pages.
            if extend <= 0 or not self.kv.reserve(req, extend, keep=num_running):
                if fresh:
                    self.kv.unadmit(req)
                break
            admitted.append(req)
            chosen.append((req, extend))
            allowance.take(req.cached_len, extend, req.seq_len - req.cached_len)
            if share:
                batch_prompts.add(req.input_ids, req.cached_len)
        for req in self.waiting:
            if req not in admitted:
                req.skipped += 1
        for req in admitted:
            self.waiting.remove(req)
        if not chosen:
            return None
        return self.kv.make_batch(Phase.PREFILL, chosen)

    @staticmethod
    def _prefilled(req: Req) -> bool:
        return req.finished or req.cached_len >= req.prompt_len - 1

"""Prefill admission: which waiting requests enter the next batch, and how much of each.

The waiting queue is ranked by cached prefix (longest first, "lpm") without starving anyone; the
cached prefixes the next waiting requests will reuse are locked while a batch is admitted; a prompt
longer than the token budget is prefilled in chunks across steps; a request that shares a long
uncached prefix with one admitted in the same batch waits one step to read it from the cache.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from minisgl.config import EngineConfig
from minisgl.core import Batch, Phase, Req
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


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefillManager:
    def __init__(self, config: EngineConfig, kv: ReqKV) -> None:
        self.config = config
        self.kv = kv
        self.cache = kv.cache
        self.page_size = kv.page_size
        self.min_share = max(IN_BATCH_SHARE_MIN, self.page_size)  # shared tokens worth a step's wait
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # prefill in progress across steps

    def schedule(self, running: list[Req]) -> Batch | None:
        """The next prefill batch next to `running` (the decoding requests), or None."""
        # Only while something runs: its pages come back, so protection cannot stall the queue.
        protected = self._lock_waiting_prefixes() if running and self.config.cache == "radix" else []
        try:
            return self._admit_batch(len(running))
        finally:
            for handle in protected:
                self.cache.unlock(handle)

    def _ordered_waiting(self) -> list[Req]:
        if self.config.schedule_policy != "lpm" or self.config.cache != "radix" or len(self.waiting) > LPM_MAX_WAITING:
            return list(self.waiting)
        match_len = self.cache.match_len
        starved = [r for r in self.waiting if r.skipped >= STARVATION_LIMIT]
        rest = [r for r in self.waiting if r.skipped < STARVATION_LIMIT]
        rest.sort(key=lambda r: -match_len(r.input_ids))  # stable: ties keep arrival order
        return starved + rest

    def _lock_waiting_prefixes(self) -> list[Any]:
        handles = []
        for req in list(self.waiting)[:PROTECT_WAITING]:
            if req.table_idx < 0:
                handle, _ = self.cache.match_and_lock(req.input_ids[: req.seq_len - 1])
                if handle is not None:
                    handles.append(handle)
        return handles

    def _admit_batch(self, num_running: int) -> Batch | None:
        budget = self.config.max_prefill_tokens
        chosen: list[tuple[Req, int]] = []  # (req, extend_len)
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            extend = min(req.seq_len - req.cached_len, budget)
            if self.kv.reserve(req, extend):
                chosen.append((req, extend))
                budget -= extend
            else:
                self.waiting.appendleft(req)  # keeps its row and pages; resumes when memory frees up
        admitted: list[Req] = []
        share = self.config.cache == "radix"
        # The batch's prompts by their first tokens (_share_key): only those can share enough with a request.
        batch_prompts: dict[tuple[int, ...], list[np.ndarray]] = {}
        for r, _ in chosen if share else ():
            batch_prompts.setdefault(self._share_key(r), []).append(np.asarray(r.input_ids))
        for req in self._ordered_waiting():
            if budget <= 0 or num_running + len(chosen) >= self.config.max_running_requests:
                break
            if req.wait_for is not None and not self._prefilled(req.wait_for):
                continue
            fresh = req.table_idx < 0
            if fresh and share and not req.wants_prompt_logprobs and self._shares_with_batch(
                req, batch_prompts.get(self._share_key(req))
            ):
                continue
            if fresh and not self.kv.admit(req):
                break  # no free table row
            extend = min(req.seq_len - req.cached_len, budget)
            # Leave room for the running requests' next decode pages.
            if not self.kv.reserve(req, extend, keep=num_running):
                if fresh:
                    self.kv.unadmit(req)
                break
            admitted.append(req)
            chosen.append((req, extend))
            budget -= extend
            if share:
                batch_prompts.setdefault(self._share_key(req), []).append(np.asarray(req.input_ids))
        for req in self.waiting:
            if req not in admitted:
                req.skipped += 1
        for req in admitted:
            self.waiting.remove(req)
        if not chosen:
            return None
        return self.kv.make_batch(Phase.PREFILL, chosen)

    def _share_key(self, req: Req) -> tuple[int, ...]:
        """The first tokens two prompts must have in common to share a prefix worth waiting for."""
        return tuple(req.input_ids[: self.min_share])

    def _shares_with_batch(self, req: Req, candidates: list[np.ndarray] | None) -> bool:
        """True when req should wait a step to reuse a prefix another request of this batch computes.

        candidates: the batch's prompts with req's _share_key (no other one can share min_share tokens).
        """
        if not candidates:
            return False
        ids = np.asarray(req.input_ids)
        shared = max(common_prefix_len(ids, other) for other in candidates)
        shared = min(shared, len(ids) - 1) // self.page_size * self.page_size
        return shared >= self.min_share and shared - self.cache.match_len(req.input_ids[:-1]) >= self.min_share

    @staticmethod
    def _prefilled(req: Req) -> bool:
        return req.finished or req.cached_len >= req.prompt_len - 1

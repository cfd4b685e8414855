"""The decode set: the running requests, one KV slot each for the next token, retraction under pressure.

When the KV pool cannot hold the next decode step, the partly prefilled prompts give their pages back, then
the newest running requests are retracted (their KV goes to the prefix cache, they go back to the front of
the queue) instead of failing.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

import torch

from minisgl.core import Batch, Phase, Req
from minisgl.scheduler.kv import ReqKV

logger = logging.getLogger("minisgl")


class DecodeManager:
    def __init__(self, kv: ReqKV, waiting: deque[Req], max_seq_len: int) -> None:
        self.kv = kv
        self.cache = kv.cache
        self.page_size = kv.page_size
        self.waiting = waiting  # where retracted requests go back to (the prefill queue)
        self.max_seq_len = max_seq_len
        self.running: list[Req] = []  # fully prefilled, decoding

    def schedule(
        self,
        in_flight: frozenset[int],
        finish_full: Callable[[Req], None],
        speculate: Callable[[list[Req]], Batch | None] | None = None,
    ) -> Batch | None:
        """The next decode batch, or None.

        in_flight: id() of the requests whose token from the step in flight is not on the host yet.
        finish_full(req): ends a request that alone is larger than the pool.
        speculate(reqs): the verify batch of these rows (their next slot reserved), or None to decode them plainly
        (speculative decoding; the plain batch is then not built).
        """
        if not self.running:
            return None
        # Until every running request has room for one more token: first roll back the partly prefilled prompts
        # that wait for pages (they hold pages the running ones need, and would hold them until those finish),
        # then retract the running requests, newest first.
        while True:
            need = sum(1 for r in self.running if r.cached_len % self.page_size == 0)
            if need <= self.cache.available_pages:
                break
            holder = next((r for r in reversed(self.waiting) if r.table_idx >= 0), None)
            if holder is not None:
                logger.debug(
                    "rolling back the prefill of %s (%d tokens) under KV pressure", holder.rid, holder.cached_len
                )
                self.kv.roll_back(holder)
            elif len(self.running) > 1:
                self._retract(self.running.pop())
            else:
                break
        reqs = [r for r in self.running if not self._last_token_in_flight_is_final(r, in_flight)]
        if not reqs:
            return None
        if self._reserve_decode(reqs):
            return self._batch(reqs, speculate)
        chosen = []
        for req in reqs:
            if not self.kv.reserve(req, 1):
                # Only possible with a single request larger than the pool. A token still in flight is its last:
                # it ends once that token is read (as without overlap), not now, which would drop the token.
                if id(req) not in in_flight:
                    self.running.remove(req)
                    finish_full(req)
                continue
            chosen.append(req)
        if not chosen:
            return None
        return self._batch(chosen, speculate)

    def _batch(self, reqs: list[Req], speculate: Callable[[list[Req]], Batch | None] | None) -> Batch:
        verify = speculate(reqs) if speculate is not None else None
        return verify if verify is not None else self.kv.make_batch(Phase.DECODE, [(r, 1) for r in reqs])

    def _last_token_in_flight_is_final(self, req: Req, in_flight: frozenset[int]) -> bool:
        """True when req's token from the in-flight step certainly ends it by length: decode no more."""
        if id(req) not in in_flight:
            return False
        return req.num_output + 1 >= req.sampling_params.max_tokens or req.seq_len + 1 >= self.max_seq_len

    def _reserve_decode(self, reqs: list[Req]) -> bool:
        """One KV slot for the next token of every request, with a few batched tensor ops (the hot path).

        None of them waits for the device: this runs while the previous step's forward is in flight (overlap), and a
        wait here leaves the GPU idle for the rest of the host's scheduling.

        Equivalent to kv.reserve(req, 1) for each; False, changing nothing, when the pages cannot be had.
        """
        ps = self.page_size
        fresh = [r.cached_len % ps == 0 for r in reqs]  # the next position opens a new page
        num_fresh = sum(fresh)
        pages = self.cache.allocate_pages(num_fresh) if num_fresh else None
        if num_fresh and pages is None:
            return False
        dev = self.kv.device
        page_table = self.kv.page_table
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
        if num_fresh == len(reqs):
            slots = pages * ps
        else:
            # Continue the last page: the slot after the previous position's.
            slots = page_table[rows, (pos - 1).clamp_(min=0)] + 1
            if num_fresh:
                where = torch.tensor([i for i, f in enumerate(fresh) if f], dtype=torch.int64).to(
                    dev, non_blocking=True
                )
                slots.index_copy_(0, where, pages * ps)
        page_table[rows, pos] = slots
        return True

    def _retract(self, req: Req) -> None:
        logger.debug("retracting %s (%d tokens) under KV pressure", req.rid, req.cached_len)
        self.kv.release(req)
        req.wait_for = None
        self.waiting.appendleft(req)

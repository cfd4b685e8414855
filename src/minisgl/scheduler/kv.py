"""A request's KV: its row of the page table, the cached prefix it borrows, the pages it owns.

Every page move goes through CacheManager (kvcache/manager.py), the only door to the prefix
cache; rows come from the TableManager (kvcache/table.py). Batches are built here too: they
read the rows' slots and, for decode, each row's last sampled token kept on the device.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from minisgl.core import Batch, Phase, Req
from minisgl.kvcache.manager import CacheManager
from minisgl.kvcache.table import TableManager


class ReqKV:
    def __init__(self, table: TableManager, cache: CacheManager, device: torch.device) -> None:
        self.table = table
        self.cache = cache
        self.page_table = table.page_table
        self.page_size = cache.page_size
        self.device = device
        # Each row's last sampled token, on the device: the next decode step's input without a host round trip.
        self.last_tokens = torch.zeros(table.max_rows, dtype=torch.int64, device=device)
        # Prompts whose prefill was rolled back: their later admissions match their own computed KV, no prefix hit.
        self._rolled_back: weakref.WeakSet[Req] = weakref.WeakSet()

    def admit(self, req: Req) -> bool:
        """Give a waiting request a table row and its cached prefix (locked)."""
        row = self.table.allocate()
        if row is None:
            return False
        # The last token is always computed: its logits give the next token. A request that wants its prompt's
        # logprobs computes the whole prompt (cached tokens have no logits).
        handle, slots = self.cache.match_and_lock(
            [] if req.wants_prompt_logprobs else req.input_ids[: req.seq_len - 1], req.prefix_hint
        )
        matched = len(slots)
        req.prefix_hint = handle if handle is not None else req.prefix_hint
        self.page_table[row, :matched] = slots
        req.table_idx, req.cache_handle, req.cached_len, req.matched_len = row, handle, matched, matched
        if req.num_output == 0 and req not in self._rolled_back:
            req.prefix_hit_len = matched
        return True

    def unadmit(self, req: Req) -> None:
        self.cache.unlock(req.cache_handle)
        self.table.free(req.table_idx)
        req.table_idx, req.cache_handle, req.cached_len, req.matched_len = -1, None, 0, 0

    def reserve(self, req: Req, extend: int, keep: int = 0) -> bool:
        """Allocate KV slots for the next `extend` tokens of req, keeping `keep` pages spare."""
        if extend <= 0:
            return False
        new_pages = -(-(req.cached_len + extend) // self.page_size) - -(-req.cached_len // self.page_size)
        if self.cache.available_pages - new_pages < keep:
            return False
        row = self.page_table[req.table_idx]
        return self.cache.slots_for_extend(row, req.cached_len, req.cached_len + extend) is not None

    def reserve_after(self, req: Req, start: int, extra: int) -> bool:
        """Slots for positions [start, start + extra) of req (a draft after its reserved next token)."""
        row = self.page_table[req.table_idx]
        return self.cache.slots_for_extend(row, start, start + extra) is not None

    def shrink(self, req: Req, length: int, alloc_len: int) -> None:
        """Keep the KV of req's first `length` positions; the pages past them (up to alloc_len, a verify step's
        rejected draft) go back to the free list. The slots left in the last kept page are reused by the next step."""
        ps = self.page_size
        keep_end = -(-length // ps) * ps
        if alloc_len > keep_end:
            self.cache.free(self.page_table[req.table_idx, keep_end:alloc_len:ps] // ps)
        req.cached_len = length

    def cache_prefix(self, req: Req) -> None:
        """Share the just-computed prompt KV (n > 1 siblings, other requests with this prefix)."""
        row = self.page_table[req.table_idx]
        req.cache_handle, req.matched_len = self.cache.cache_prefix(
            req.input_ids, row, req.cached_len, req.matched_len, req.cache_handle
        )

    def release(self, req: Req, alloc_len: int | None = None) -> None:
        """Give the request's KV back: page-aligned part to the prefix cache, the rest to the free list.

        alloc_len: positions with slots when more were reserved than computed (a failed step).
        """
        if req.table_idx < 0:
            return
        row = self.page_table[req.table_idx]
        self.cache.release(req.input_ids, row, req.cached_len, req.matched_len, req.cache_handle, alloc_len)
        self.table.free(req.table_idx)
        req.table_idx, req.cache_handle, req.cached_len, req.matched_len = -1, None, 0, 0

    def roll_back(self, req: Req) -> None:
        """Give back the KV of a waiting, partly prefilled request; its prefill starts again later, from what of
        its prompt the prefix cache still holds. Its prefix hit stays as its first admission counted it."""
        self.release(req)
        self._rolled_back.add(req)

    def req_pages(self, reqs: list[Req]) -> int:
        """Pages owned by these requests (not by the cache)."""
        return sum(self.cache.req_pages(r.cached_len, r.matched_len) for r in reqs)

    def make_batch(self, phase: Phase, chosen: list[tuple[Req, int]], tokens: list[int] | None = None) -> Batch:
        """The batch computing `extend` tokens of each (req, extend), whose slots are reserved. tokens: the prefill
        rows' input ids, flat (default: each request's next `extend` tokens; a verify batch gives its drafts)."""
        reqs = [r for r, _ in chosen]
        rows = [r.table_idx for r in reqs]
        prefix_lens = [r.cached_len for r in reqs]
        extend_lens = [extend for _, extend in chosen]
        decode = phase is Phase.DECODE
        n = len(reqs)
        # Everything the batch needs from the host in one array and one non-blocking copy (a blocking one waits for
        # the GPU to drain; each copy costs host time a step without overlap, a speculative verify, waits for).
        if decode:  # [positions | rows]
            host = np.array(prefix_lens + rows, dtype=np.int64)
            num_tokens = n
        else:  # [positions | token rows | rows | input ids]
            # Each request's positions and its row once per token, vectorised (a prefill chunk is thousands of
            # tokens). numpy, not torch: torch's CPU repeat_interleave is a parallel op whose thread wake-ups cost
            # milliseconds when other processes (TP ranks) share the CPUs.
            lens = np.asarray(extend_lens)
            num_tokens = int(lens.sum())
            input_ids: list[int] = [] if tokens is None else tokens
            for (req, extend), start in zip(chosen, prefix_lens) if tokens is None else ():
                input_ids.extend(req.input_ids[start : start + extend])
            host = np.concatenate(
                [
                    np.arange(num_tokens) - np.repeat(np.cumsum(lens) - lens - prefix_lens, lens),
                    np.repeat(np.asarray(rows, dtype=np.int64), lens),
                    np.asarray(rows, dtype=np.int64),
                    np.asarray(input_ids, dtype=np.int64),
                ]
            )
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        pos_d = dev[:num_tokens]
        if decode:
            rows_d = token_rows_d = dev[n:]
            ids_d = self.last_tokens.index_select(0, rows_d)  # the last sampled tokens: maybe not on the host yet
        else:
            token_rows_d = dev[num_tokens : 2 * num_tokens]
            rows_d = dev[2 * num_tokens : 2 * num_tokens + n]
            ids_d = dev[2 * num_tokens + n :]
        out_loc = self.page_table[token_rows_d, pos_d]
        return Batch(
            reqs=reqs,
            phase=phase,
            input_ids=ids_d,
            positions=pos_d,
            out_loc=out_loc,
            table_rows=rows_d,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens)],
            sample_mask=[True] * len(reqs)
            if decode
            else [p + e == r.seq_len for r, p, e in zip(reqs, prefix_lens, extend_lens)],
        )

"""The scheduling loop: admit (prefix match, chunked prefill), decode, retract, finish.

One step = one forward. Prefill has priority: if anything is waiting and fits the token budget
it runs; otherwise the running requests decode one token each. When the KV pool cannot
hold the next decode step, the newest running requests are retracted (their KV goes to the
prefix cache, they go back to the front of the queue) instead of failing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, NamedTuple

import numpy as np
import torch

from minisgl import plugins
from minisgl.config import EngineConfig
from minisgl.core import Batch, Phase, Req, SamplingParams, TokenOutput
from minisgl.distributed import get_tp_info
from minisgl.errors import EngineError, InvalidRequestError, OutOfMemoryError, PromptTooLongError

logger = logging.getLogger("minisgl")

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


class LaunchedStep(NamedTuple):
    """A forward + sampling already queued on the device; its tokens are read by _process."""

    batch: Batch
    sampled: list[Req]  # requests that get a token from this step, in row order
    tokens: torch.Tensor | None  # [len(sampled)] int64 on the host (pinned on CUDA), valid once `ready` fires
    logprobs: list[Any] | None
    ready: Any  # torch.cuda.Event recorded after the device-to-host copy, or None
    sampled_ids: frozenset[int]  # id() of the sampled requests: their last token is not on the host yet


class Scheduler:
    def __init__(self, config: EngineConfig, model_source: Any = None) -> None:
        from minisgl.engine.engine import Engine
        from minisgl.kvcache.manager import CacheManager, make_prefix_cache

        self.config = config
        self.engine = Engine(config, model_source)
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.device = self.engine.device
        self.page_size = config.page_size
        self.min_share = max(IN_BATCH_SHARE_MIN, self.page_size)  # shared tokens worth a step's wait
        self.table = self.engine.table
        self.page_table = self.table.page_table
        prefix_cache = make_prefix_cache(config.cache, self.page_size, self.device)
        self.prefix_cache = prefix_cache
        self.cache = CacheManager(self.engine.num_pages, self.page_size, prefix_cache, self.device)
        self.max_seq_len = self.engine.max_seq_len
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)

        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # fully prefilled, decoding
        self.chunked: Req | None = None  # prefill in progress across steps
        self.reqs: dict[tuple[str, int], Req] = {}
        self.pending_outputs: list[TokenOutput] = []
        self.grammar_backend: Any = None
        self.num_steps = 0
        self._hook_received = plugins.has_impl("minisgl_request_received")
        self._hook_finished = plugins.has_impl("minisgl_request_finished")
        self._hook_step = plugins.has_impl("minisgl_batch_step")
        # Overlap scheduling: the host schedules step k+1 and post-processes step k while the GPU
        # runs; "overlap_on_cpu" in config.extra runs the same (then pointless) pipeline on CPU for tests.
        self.overlap = not config.disable_overlap and (self.device.type == "cuda" or bool(config.extra.get("overlap_on_cpu")))
        self._inflight: LaunchedStep | None = None
        # Each row's last sampled token, on the device: the next decode step's input without a host round trip.
        self._last_tokens = torch.zeros(self.table.max_rows, dtype=torch.int64, device=self.device)
        self._warmup()
        logger.info("scheduler ready: cache=%s page_size=%d pages=%d", config.cache, self.page_size, self.cache.num_pages)

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One prefill and one decode of a 1-token prompt, outside the books, before anything is served.

        A dtype or kernel this machine cannot run then fails the start-up with a clear error
        instead of the first request. Nothing is cached; every page and row is given back.
        """
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        req = Req(rid="warmup", input_ids=[0], sampling_params=params, prompt_len=1, eos_token_ids=self.eos_token_ids)
        if not self._admit(req):
            return
        assert req.matched_len == 0, "the prefix cache is empty at start-up"
        reserved = 0
        try:
            for phase in (Phase.PREFILL, Phase.DECODE):
                if not self._reserve(req, 1):
                    break  # a pool too small for two tokens still serves one-token requests
                reserved = 1
                next_ids, _ = self._forward_and_sample(self._make_batch(phase, [(req, 1)]), [req])
                assert next_ids is not None
                self._last_tokens[req.table_idx] = next_ids[0]
                req.cached_len, reserved = req.cached_len + 1, 0
                req.input_ids.append(int(next_ids[0]))
        except Exception as e:
            what = f"{self.config.model} in {str(self.engine.dtype).removeprefix('torch.')} on {self.device}"
            raise EngineError(
                f"{what} cannot run on this machine: a test forward pass failed with {type(e).__name__}: {e}. "
                "Pick another --dtype (float32 runs on every CPU) or --device"
            ) from e
        finally:
            row = self.page_table[req.table_idx]
            self.cache.release(req.input_ids, row, 0, 0, req.cache_handle, alloc_len=req.cached_len + reserved)
            self.table.free(req.table_idx)

    # ------------------------------------------------------------------ requests in

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.pending_outputs or self._inflight)

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise a typed error for a request that can never be served; changes nothing."""
        if not input_ids:
            raise InvalidRequestError("empty prompt: give at least one token")
        vocab = self.model_config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise InvalidRequestError(f"token ids must be in [0, {vocab}) for this model")
        if len(input_ids) >= self.max_seq_len:
            raise PromptTooLongError(
                f"prompt has {len(input_ids)} tokens but the context window is {self.max_seq_len}: "
                "shorten the prompt (or raise max_seq_len up to the model's limit)"
            )
        pages_needed = -(-(len(input_ids) + 1) // self.page_size)
        if pages_needed > self.cache.num_pages:
            raise OutOfMemoryError(
                f"the prompt needs {pages_needed} KV pages but the pool has {self.cache.num_pages}: "
                "give the KV cache more memory (kv_cache_gb / mem_fraction / num_pages)"
            )
        if params.has_grammar:
            self._grammar().validate(params)

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        """Queue a request (n > 1 becomes n sequences that share the prompt's KV)."""
        self.validate(input_ids, params)
        if any((rid, i) in self.reqs for i in range(params.n)):
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        now = time.perf_counter()
        new: list[Req] = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else None
            req = Req(
                rid=rid, input_ids=list(input_ids), sampling_params=params, prompt_len=len(input_ids),
                eos_token_ids=self.eos_token_ids, index=i, seed=seed, arrival=now,
            )
            req.wait_for = new[0] if new and self.config.cache == "radix" else None
            if self._hook_received:  # may reject: raises before anything is queued
                plugins.get_plugin_manager().hook.minisgl_request_received(req=req)
            new.append(req)
        for req in new:
            self._init_req_state(req)
            self.reqs[(rid, req.index)] = req
            self.waiting.append(req)

    def _init_req_state(self, req: Req) -> None:
        p = req.sampling_params
        if req.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.seed)
        if p.stop:
            from minisgl.tokenizer import IncrementalDetokenizer

            req.stop_checker = IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens)
        if p.has_grammar:
            req.grammar = self._grammar().new_state(p, stop_token_ids=sorted(req.eos_token_ids))

    def _grammar(self) -> Any:
        if self.grammar_backend is None:
            from minisgl.structured.grammar import GrammarBackend

            # Bounded whitespace: weak models otherwise loop on blanks inside JSON.
            self.grammar_backend = GrammarBackend(self.tokenizer, self.model_config.vocab_size, max_whitespace_cnt=12)
        return self.grammar_backend

    def abort(self, rid: str) -> None:
        """Abort every sequence of a request; its pages are freed now, the output says "abort"."""
        for key in [k for k in self.reqs if k[0] == rid]:
            self._finish(self.reqs[key], "abort", None)

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Run one forward (prefill if anything can be admitted, else decode); report what changed.

        With overlap the forward is only launched here and its tokens are read in the next step,
        after that step's forward is queued: the GPU never waits for the host. Finish checks
        then land one step late; a request's extra token from that step is dropped. A forward that
        raises fails the requests of its batch (EngineError) and the loop goes on.
        """
        if self._inflight is not None and self._needs_host_state(self._inflight):
            # Grammar masks and penalties need the previous token on the host first (min_tokens
            # only needs the count, which num_sampled projects).
            previous, self._inflight = self._inflight, None
            self._process(previous)
        batch = self._schedule_prefill() or self._schedule_decode()
        launched = None
        if batch is not None:
            try:
                launched = self._launch(batch)
            except Exception as e:  # noqa: BLE001 - the batch fails, the engine keeps serving
                self._fail(batch.reqs, e, batch.extend_lens)
        if self.overlap:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                self._process(previous)
        elif launched is not None:
            self._process(launched)
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _needs_host_state(self, step: LaunchedStep) -> bool:
        return any(
            not r.finished
            and (r.grammar is not None or r.sampling_params.has_penalties)
            for r in step.sampled
        )

    def _last_token_in_flight_is_final(self, req: Req) -> bool:
        """True when req's token from the in-flight step certainly ends it by length: decode no more."""
        step = self._inflight
        if step is None or id(req) not in step.sampled_ids:
            return False
        return req.num_output + 1 >= req.sampling_params.max_tokens or req.seq_len + 1 >= self.max_seq_len

    def _ordered_waiting(self) -> list[Req]:
        if self.config.schedule_policy != "lpm" or self.config.cache != "radix" or len(self.waiting) > LPM_MAX_WAITING:
            return list(self.waiting)
        match_len = self.prefix_cache.match_len
        starved = [r for r in self.waiting if r.skipped >= STARVATION_LIMIT]
        rest = [r for r in self.waiting if r.skipped < STARVATION_LIMIT]
        rest.sort(key=lambda r: -match_len(r.input_ids))  # stable: ties keep arrival order
        return starved + rest

    def _schedule_prefill(self) -> Batch | None:
        # Only while something runs: its pages come back, so protection cannot stall the queue.
        protected = self._lock_waiting_prefixes() if self.running and self.config.cache == "radix" else []
        try:
            return self._admit_batch()
        finally:
            for handle in protected:
                self.prefix_cache.unlock(handle)

    def _lock_waiting_prefixes(self) -> list[Any]:
        handles = []
        for req in list(self.waiting)[:PROTECT_WAITING]:
            if req.table_idx < 0:
                handle, _ = self.prefix_cache.match_prefix(req.input_ids[: req.seq_len - 1])
                if handle is not None:
                    self.prefix_cache.lock(handle)
                    handles.append(handle)
        return handles

    def _admit_batch(self) -> Batch | None:
        budget = self.config.max_prefill_tokens
        chosen: list[tuple[Req, int]] = []  # (req, extend_len)
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            extend = min(req.seq_len - req.cached_len, budget)
            if self._reserve(req, extend):
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
            if budget <= 0 or len(self.running) + len(chosen) >= self.config.max_running_requests:
                break
            if req.wait_for is not None and not self._prefilled(req.wait_for):
                continue
            fresh = req.table_idx < 0
            if fresh and share and self._shares_with_batch(req, batch_prompts.get(self._share_key(req))):
                continue
            if fresh and not self._admit(req):
                break  # no free table row
            extend = min(req.seq_len - req.cached_len, budget)
            # Leave room for the running requests' next decode pages.
            if not self._reserve(req, extend, keep=len(self.running)):
                if fresh:
                    self._unadmit(req)
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
        return self._make_batch(Phase.PREFILL, chosen)

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
        return shared >= self.min_share and shared - self.prefix_cache.match_len(req.input_ids[:-1]) >= self.min_share

    def _prefilled(self, req: Req) -> bool:
        return req.finished or req.cached_len >= req.prompt_len - 1

    def _admit(self, req: Req) -> bool:
        """Give a waiting request a table row and its cached prefix (locked)."""
        row = self.table.allocate()
        if row is None:
            return False
        # The last token is always computed: its logits give the next token.
        handle, slots = self.prefix_cache.match_prefix(req.input_ids[: req.seq_len - 1])
        matched = len(slots)
        self.prefix_cache.lock(handle)
        self.page_table[row, :matched] = slots
        req.table_idx, req.cache_handle, req.cached_len, req.matched_len = row, handle, matched, matched
        if req.num_output == 0:
            req.prefix_hit_len = matched
        return True

    def _unadmit(self, req: Req) -> None:
        self.prefix_cache.unlock(req.cache_handle)
        self.table.free(req.table_idx)
        req.table_idx, req.cache_handle, req.cached_len, req.matched_len = -1, None, 0, 0

    def _reserve(self, req: Req, extend: int, keep: int = 0) -> bool:
        """Allocate KV slots for the next `extend` tokens of req, keeping `keep` pages spare."""
        if extend <= 0:
            return False
        new_pages = -(-(req.cached_len + extend) // self.page_size) - -(-req.cached_len // self.page_size)
        if self.cache.available_pages - new_pages < keep:
            return False
        row = self.page_table[req.table_idx]
        return self.cache.slots_for_extend(row, req.cached_len, req.cached_len + extend) is not None

    def _schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        # Newest first out: retract until every remaining request has room for one more token.
        while True:
            need = sum(1 for r in self.running if r.cached_len % self.page_size == 0)
            if need <= self.cache.available_pages or len(self.running) == 1:
                break
            self._retract(self.running.pop())
        reqs = [r for r in self.running if not self._last_token_in_flight_is_final(r)]
        if not reqs:
            return None
        if self._reserve_decode(reqs):
            return self._make_batch(Phase.DECODE, [(r, 1) for r in reqs])
        chosen = []
        for req in reqs:
            if not self._reserve(req, 1):
                # Only possible with a single request larger than the pool.
                self.running.remove(req)
                self._finish(req, "length", None, error="the KV pool is full")
                continue
            chosen.append((req, 1))
        if not chosen:
            return None
        return self._make_batch(Phase.DECODE, chosen)

    def _reserve_decode(self, reqs: list[Req]) -> bool:
        """One KV slot for the next token of every request, with a few batched tensor ops (the hot path).

        Equivalent to _reserve(req, 1) for each; False, changing nothing, when the pages cannot be had.
        """
        ps = self.page_size
        fresh = [r.cached_len % ps == 0 for r in reqs]  # the next position opens a new page
        num_fresh = sum(fresh)
        pages = self.cache.allocate_pages(num_fresh) if num_fresh else None
        if num_fresh and pages is None:
            return False
        dev = self.device
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
        if num_fresh == len(reqs):
            slots = pages * ps
        else:
            # Continue the last page: the slot after the previous position's.
            slots = self.page_table[rows, (pos - 1).clamp_(min=0)] + 1
            if num_fresh:
                where = torch.tensor([i for i, f in enumerate(fresh) if f], dtype=torch.int64).to(dev, non_blocking=True)
                slots.index_copy_(0, where, pages * ps)
        self.page_table[rows, pos] = slots
        return True

    def _retract(self, req: Req) -> None:
        logger.debug("retracting %s (%d tokens) under KV pressure", req.rid, req.cached_len)
        self._release(req)
        req.wait_for = None
        self.waiting.appendleft(req)

    def _make_batch(self, phase: Phase, chosen: list[tuple[Req, int]]) -> Batch:
        reqs = [r for r, _ in chosen]
        input_ids: list[int] = []
        positions: list[int] = []
        rows, prefix_lens, extend_lens = [], [], []
        decode = phase is Phase.DECODE
        for req, extend in chosen:
            start = req.cached_len
            if not decode:
                input_ids.extend(req.input_ids[start : start + extend])
            positions.extend(range(start, start + extend))
            rows.append(req.table_idx)
            prefix_lens.append(start)
            extend_lens.append(extend)
        dev = self.device
        rows_t = torch.tensor(rows, dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        token_rows = torch.repeat_interleave(rows_t, torch.tensor(extend_lens))
        # non_blocking everywhere: a blocking host-to-device copy waits for the GPU to drain.
        pos_d = pos_t.to(dev, non_blocking=True)
        rows_d = rows_t.to(dev, non_blocking=True)
        out_loc = self.page_table[token_rows.to(dev, non_blocking=True), pos_d]
        if decode:  # the last sampled tokens, read on the device: they may not be on the host yet
            ids_d = self._last_tokens.index_select(0, rows_d)
        else:
            ids_d = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
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
            sample_mask=[True] * len(reqs) if decode else [p + e == r.seq_len for r, p, e in zip(reqs, prefix_lens, extend_lens)],
        )

    def _forward_and_sample(self, batch: Batch, sampled: list[Req]) -> tuple[torch.Tensor | None, list[Any] | None]:
        """Queue the forward and the sampling of `sampled` (next ids on the device, logprobs); changes no request.

        (None, None) when nothing is sampled (a middle chunk of a prompt: its KV only).
        """
        from minisgl.engine.sampler import SamplingInfo

        logits = self.engine.forward(batch)
        if not sampled:
            return None, None
        info = SamplingInfo.from_reqs(sampled, self.model_config.vocab_size, self.device)
        return self.engine.sampler.sample(logits, sampled, info, self._bitmask_fn(sampled))

    def _launch(self, batch: Batch) -> LaunchedStep:
        """Queue the forward and the sampling; update everything that does not need the new tokens.

        Requests change only after the forward and the sampling were queued: when those raise,
        the batch is as it was scheduled (see _fail).
        """
        sampled = [r for r, m in zip(batch.reqs, batch.sample_mask) if m]
        next_ids, logprobs = self._forward_and_sample(batch, sampled)
        self.num_steps += 1
        for req, extend in zip(batch.reqs, batch.extend_lens):
            req.cached_len += extend
        if batch.is_prefill:
            for req in batch.reqs:
                if self.config.cache == "radix":
                    self._cache_prefix(req)
                if req.cached_len < req.seq_len:
                    self.chunked = req
            self.running.extend(sampled)  # decodes from the next step on, its first token read from the device
        tokens = ready = None
        if next_ids is not None:
            for req in sampled:
                req.tokens_in_flight += 1
            rows = torch.tensor([r.table_idx for r in sampled], dtype=torch.int64).to(self.device, non_blocking=True)
            self._last_tokens.index_copy_(0, rows, next_ids)
            if next_ids.is_cuda:
                tokens = torch.empty(next_ids.shape, dtype=torch.int64, pin_memory=True)
                tokens.copy_(next_ids, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            else:
                tokens = next_ids
        return LaunchedStep(batch, sampled, tokens, logprobs, ready, frozenset(map(id, sampled)))

    def _process(self, step: LaunchedStep) -> None:
        """Read a launched step's tokens on the host: append them, check stops, report.

        An error here (the device reporting a failed kernel, a plugin's batch hook) fails the step's requests.
        """
        try:
            self._read_tokens(step)
        except Exception as e:  # noqa: BLE001 - the batch fails, the engine keeps serving
            self._fail(step.batch.reqs, e)

    def _read_tokens(self, step: LaunchedStep) -> None:
        if step.tokens is not None:
            if step.ready is not None:
                step.ready.synchronize()
            next_list = step.tokens.tolist()
            for i, req in enumerate(step.sampled):
                req.tokens_in_flight -= 1
                if req.finished:  # finished (stop, abort) while this step was in flight: drop its token
                    continue
                self._append_token(req, next_list[i], step.logprobs[i] if step.logprobs else None)
        if self._hook_step:
            plugins.get_plugin_manager().hook.minisgl_batch_step(batch=step.batch)

    def _fail(self, reqs: list[Req], exc: Exception, extend_lens: list[int] | None = None) -> None:
        """A step raised: finish every sequence of its requests with EngineError and free their pages.

        extend_lens: the slots the step had reserved past each request's cached_len (freed, never cached).
        With tensor parallelism the ranks may have stopped at different collectives, so no rank can go
        on alone: the engine stops instead.
        """
        if get_tp_info().size > 1:
            raise EngineError(f"a forward pass failed on this tensor-parallel rank: {type(exc).__name__}: {exc}") from exc
        logger.error("a step failed; failing its %d sequence(s)", len(reqs), exc_info=exc)
        for req, extend in zip(reqs, extend_lens or [0] * len(reqs)):
            self._release(req, alloc_len=req.cached_len + extend)
        message = f"the forward pass of this request's batch failed ({type(exc).__name__}: {exc}); the engine goes on"
        rids = {r.rid for r in reqs}
        for key in [k for k in self.reqs if k[0] in rids]:  # with n > 1, the request's other sequences too
            self._finish(self.reqs[key], "abort", None, error=message, error_type=EngineError.__name__)

    def _bitmask_fn(self, reqs: list[Req]) -> Any:
        if not any(r.grammar is not None for r in reqs):
            return None
        backend = self._grammar()
        states = [r.grammar for r in reqs]
        return lambda logits: backend.apply(logits, states)

    def _cache_prefix(self, req: Req) -> None:
        """Share the just-computed prompt KV (n > 1 siblings, other requests with this prefix)."""
        row = self.page_table[req.table_idx]
        req.cache_handle, req.matched_len = self.cache.cache_prefix(
            req.input_ids, row, req.cached_len, req.matched_len, req.cache_handle
        )

    def _append_token(self, req: Req, token: int, logprob: Any) -> None:
        if not req.output_ids:
            req.first_token_time = time.perf_counter()
        req.output_ids.append(token)
        req.input_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        p = req.sampling_params
        reason, matched = None, None
        if req.grammar is not None and not req.grammar.accept_token(token):
            self._finish(req, "abort", None, new_tokens=[token], error="the sampled token broke the grammar")
            return
        if req.stop_checker is not None:
            req.stop_checker.add([token])
        min_ok = req.num_output >= p.min_tokens
        if min_ok and not p.ignore_eos and token in req.eos_token_ids:
            reason, matched = "stop", token
        elif min_ok and token in p.stop_token_ids:
            reason, matched = "stop", token
        elif req.stop_checker is not None and req.stop_checker.stopped is not None:
            reason, matched = "stop", req.stop_checker.stopped
        elif req.grammar is not None and req.grammar.is_terminated():
            reason = "stop"
        elif req.num_output >= p.max_tokens or req.seq_len >= self.max_seq_len:
            reason = "length"
        new_logprobs = [logprob] if logprob is not None else None
        if reason is None:
            self.pending_outputs.append(self._output(req, [token], new_logprobs, False))
        else:
            self._finish(req, reason, matched, new_tokens=[token], new_logprobs=new_logprobs)

    # ------------------------------------------------------------------ requests out

    def _output(
        self, req: Req, new: list[int], logprobs: Any, finished: bool, error: str | None = None,
        error_type: str | None = None,
    ) -> TokenOutput:
        return TokenOutput(
            rid=req.rid, index=req.index, new_token_ids=new, new_logprobs=logprobs, finished=finished,
            finish_reason=req.finish_reason, matched_stop=req.matched_stop, prompt_tokens=req.prompt_len,
            cached_tokens=req.prefix_hit_len, completion_tokens=req.num_output, error=error, error_type=error_type,
        )

    def _release(self, req: Req, alloc_len: int | None = None) -> None:
        """Give the request's KV back: page-aligned part to the prefix cache, the rest to the free list.

        alloc_len: positions with slots when more were reserved than computed (a failed step).
        """
        if req.table_idx < 0:
            return
        row = self.page_table[req.table_idx]
        self.cache.release(req.input_ids, row, req.cached_len, req.matched_len, req.cache_handle, alloc_len)
        self.table.free(req.table_idx)
        req.table_idx, req.cache_handle, req.cached_len, req.matched_len = -1, None, 0, 0

    def _finish(
        self, req: Req, reason: str, matched: Any, new_tokens: list[int] | None = None,
        new_logprobs: Any = None, error: str | None = None, error_type: str | None = None,
    ) -> None:
        if req.finished:
            return
        req.finished, req.finish_reason, req.matched_stop = True, reason, matched
        req.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        self.reqs.pop((req.rid, req.index), None)
        self.pending_outputs.append(self._output(req, new_tokens or [], new_logprobs, True, error, error_type))
        if self._hook_finished:
            plugins.get_plugin_manager().hook.minisgl_request_finished(req=req)

    # ------------------------------------------------------------------ introspection

    def req_pages(self) -> int:
        """Pages owned by requests in flight (not by the cache)."""
        reqs = list(self.running) + [r for r in self.waiting if r.table_idx >= 0]
        if self.chunked is not None:
            reqs.append(self.chunked)
        return sum(self.cache.req_pages(r.cached_len, r.matched_len) for r in reqs)

    def stats(self) -> dict[str, int]:
        return {
            "total_pages": self.cache.num_pages,
            "free_pages": self.cache.free_pages,
            "cached_pages": self.prefix_cache.cached_pages,
            "req_pages": self.req_pages(),
            "waiting": len(self.waiting),
            "running": len(self.running) + (self.chunked is not None),
        }

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.req_pages())

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix not locked by a request (e.g. after the weights changed)."""
        self.cache.free(self.prefix_cache.evict(self.prefix_cache.evictable_pages))

    def shutdown(self) -> None:
        for key in list(self.reqs):
            self._finish(self.reqs[key], "abort", None, error="the engine shut down")

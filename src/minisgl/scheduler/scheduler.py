"""The scheduling loop: schedule a prefill or a decode batch, launch it, process its tokens.

One step = one forward. Prefill has priority: if anything is waiting and fits the step's allowance
it runs (prefill.py); otherwise the running requests decode one token each (decode.py), the
newest retracted when the KV pool cannot hold the step. The allowance (budget.py) is
max_prefill_tokens, and while requests decode, the prefill that fits in what is left of their gap
between tokens (max_decode_gap): a long prompt then alternates chunks with decode steps. A request's
row and pages: kv.py; the prefix cache is reached only through CacheManager (kvcache/manager.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from minisgl import plugins
from minisgl.config import EngineConfig
from minisgl.core import Batch, Req, SamplingParams, TokenOutput
from minisgl.distributed import get_tp_info
from minisgl.errors import EngineError, InvalidRequestError
from minisgl.limits import RequestLimits
from minisgl.scheduler.budget import Allowance, PrefillBudget, default_gap, flop_ratio
from minisgl.scheduler.collector import collect_due
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.kv import ReqKV
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.requests import (
    Finish,
    Grammars,
    GrammarWait,
    check_request,
    grammar_accepts,
    init_req_state,
    make_output,
    new_reqs,
    stop_reason,
)
from minisgl.scheduler.speculative import Speculator
from minisgl.scheduler.step import LaunchedStep, copy_to_host, launch_observed, read_tokens, warmup

logger = logging.getLogger("minisgl")


class Scheduler:
    def __init__(self, config: EngineConfig, model_source: Any = None) -> None:
        from minisgl.engine.engine import Engine
        from minisgl.kvcache.manager import CacheManager, make_prefix_cache

        self.config = config
        self.engine = Engine(config, model_source)
        self.model_config = self.engine.model_config
        self.device = self.engine.device
        self.page_size = self.engine.page_size
        self.table = self.engine.table
        self.page_table = self.table.page_table
        prefix_cache = make_prefix_cache(config.cache, self.page_size, self.device)
        self.cache = CacheManager(self.engine.num_pages, self.page_size, prefix_cache, self.device)
        self.max_seq_len = self.engine.max_seq_len
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.kv = ReqKV(self.table, self.cache, self.device)
        self.prefill = PrefillManager(config, self.kv)
        self.decode = DecodeManager(self.kv, self.prefill.waiting, self.max_seq_len)
        # Under tensor parallelism rank 0 alone measures; the other ranks follow its state (runtime/tp.py).
        gap = default_gap(config.max_decode_gap, self.device.type)
        self.prefill_budget = PrefillBudget(
            config.max_prefill_tokens, gap, self.page_size, flop_ratio(self.model_config)
        )
        self.reqs: dict[tuple[str, int], Req] = {}
        self._live: dict[str, int] = {}  # rid -> its sequences in self.reqs (with n > 1 some may have ended already)
        self.pending_outputs: list[TokenOutput] = []
        self.grammars = Grammars(self.engine.tokenizer_load.get, self.model_config.vocab_size, config)
        self.limits = RequestLimits.from_config(config)
        # Daemon: a request whose grammar is compiling waits here, off the loop, while the others decode
        # (offline the caller waits for the compile: its own requests have nothing else to run).
        self.defer_grammars = False
        self.admit_in_step = True  # False: the caller admits compiled grammars (rank 0 of tensor parallelism)
        self.grammar_waiting: dict[str, GrammarWait] = {}
        self.num_steps = 0
        self._hook_received = plugins.has_impl("minisgl_request_received")
        self._hook_finished = plugins.has_impl("minisgl_request_finished")
        self._hook_step = plugins.has_impl("minisgl_batch_step")
        self._hook_launch = plugins.has_impl("minisgl_step_scheduled") or plugins.has_impl("minisgl_step_launched")
        # Overlap scheduling: the host schedules step k+1 and post-processes step k while the GPU
        # runs; "overlap_on_cpu" in config.extra runs the same (then pointless) pipeline on CPU for tests.
        self.overlap = not config.disable_overlap and (
            self.device.type == "cuda" or bool(config.extra.get("overlap_on_cpu"))
        )
        self._inflight: LaunchedStep | None = None
        # Speculative decoding drafts from the tokens on the host: a step that may speculate waits for the previous
        # step's tokens, any other overlaps (Speculator.may_draft).
        self.spec = Speculator(self.kv, self.max_seq_len, self.device.type) if config.speculative == "ngram" else None
        warmup(config, self.engine, self.kv, self.eos_token_ids)
        logger.info(
            "scheduler ready: cache=%s page_size=%d pages=%d", config.cache, self.page_size, self.cache.num_pages
        )

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded when a request first needs it (stop strings, grammars)."""
        return self.engine.tokenizer

    @property
    def waiting(self) -> deque[Req]:
        return self.prefill.waiting

    @property
    def chunked(self) -> Req | None:
        return self.prefill.chunked

    @property
    def running(self) -> list[Req]:
        return self.decode.running

    # ------------------------------------------------------------------ requests in

    @property
    def has_work(self) -> bool:
        """Something to run now (a grammar still compiling is not: the loop polls for it, see grammar_due)."""
        return bool(
            self.waiting or self.running or self.chunked or self.pending_outputs or self._inflight or self.grammar_due
        )

    @property
    def grammar_due(self) -> bool:
        """A waiting grammar finished compiling, failed or ran out of time: the next step admits or fails it."""
        now = time.monotonic()
        return any(w.future.done() or now >= w.deadline for w in self.grammar_waiting.values())

    def validate(
        self, input_ids: list[int], params: SamplingParams, known_valid: int = 0, wait_grammar: bool = True
    ) -> None:
        """Raise a typed error for a request that can never be served; changes nothing. wait_grammar=False: a grammar
        still compiling is not waited for (its errors come later, from admit_compiled)."""
        self.limits.check_params(params)
        check_request(
            input_ids,
            params,
            vocab_size=self.model_config.vocab_size,
            max_seq_len=self.max_seq_len,
            page_size=self.page_size,
            num_pages=self.cache.num_pages,
            known_valid=known_valid,
        )
        if params.has_grammar:
            backend = self.grammars.backend()
            if wait_grammar or backend.compile_async(params).done():
                backend.validate(params)

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams, embed: bool = False) -> None:
        """Queue a request (n > 1 becomes n sequences that share the prompt's KV).

        max_tokens=None: up to the end of the context window. embed: an embedding request, answered with its
        prompt's last hidden state (after the final norm, L2-normalised) on its one output (its params are
        SamplingParams.for_embedding(), whatever is given).
        """
        if embed:
            params = SamplingParams.for_embedding()
        params = params.for_prompt(len(input_ids), self.max_seq_len)
        # The cached prefix's tokens were checked when first seen; the walk's end is where admission's resumes.
        cached, hint = self.cache.locate(input_ids)
        self.validate(input_ids, params, known_valid=cached, wait_grammar=not self.defer_grammars)
        if rid in self._live:
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        received = plugins.get_plugin_manager().hook.minisgl_request_received if self._hook_received else None
        new = new_reqs(
            rid,
            input_ids,
            params,
            self.eos_token_ids,
            self.config.cache == "radix",
            (lambda req: received(req=req)) if received is not None else None,
            embed,
        )
        for req in new:
            req.prefix_hint = hint
            self.reqs[(rid, req.index)] = req
            self._live[rid] = self._live.get(rid, 0) + 1
        compiling = self.grammars.backend().compile_async(params) if params.has_grammar else None
        if compiling is not None and not compiling.done():
            deadline = time.monotonic() + self.grammars.backend().compile_timeout
            self.grammar_waiting[rid] = GrammarWait(new, compiling, deadline)
        else:
            self._enqueue(new)

    def _enqueue(self, reqs: list[Req]) -> None:
        for req in reqs:
            init_req_state(req, self.device, self.engine.tokenizer_load.get, self.grammars.backend)
            self.waiting.append(req)

    def admit_compiled(self) -> list[str]:
        """Queue the requests whose grammar is now compiled, fail those whose grammar failed or timed out (with
        GrammarError: a 400 at HTTP); returns the ids queued."""
        admitted = []
        now = time.monotonic()
        for rid, wait in list(self.grammar_waiting.items()):
            if not wait.future.done() and now < wait.deadline:
                continue
            del self.grammar_waiting[rid]
            error = wait.error(self.grammars.backend().compile_timeout)
            if error is None:
                self._enqueue(wait.reqs)
                admitted.append(rid)
                continue
            for req in wait.reqs:
                self._finish(req, Finish("abort", error=str(error), error_type=type(error).__name__))
        return admitted

    def abort(self, rid: str) -> None:
        """Abort every sequence of a request; its pages are freed now, the output says "abort"."""
        for key in [k for k in self.reqs if k[0] == rid]:
            self._finish(self.reqs[key], Finish("abort"))

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Run one forward (prefill if anything can be admitted, else decode); report what changed.

        With overlap the forward is only launched here and its tokens are read in the next step,
        after that step's forward is queued: the GPU never waits for the host. Finish checks
        then land one step late; a request's extra token from that step is dropped. A forward that
        raises fails the requests of its batch (EngineError) and the loop goes on.
        """
        if self.grammar_waiting and self.admit_in_step:
            self.admit_compiled()
        self.prefill_budget.step_started()
        if self._inflight is not None and (self._needs_host_state(self._inflight) or self._may_draft()):
            # Grammar masks and penalties need the previous token on the host first (min_tokens
            # only needs the count, which num_sampled projects), and so do drafts.
            previous, self._inflight = self._inflight, None
            self._process(previous)
        started = time.perf_counter() if self._hook_launch else 0.0  # for minisgl_step_scheduled
        batch = self._schedule()
        launched = None
        if batch is not None and batch.is_verify:
            self._verify(batch)
        elif batch is not None:
            try:
                launched = launch_observed(self._launch, batch, started) if self._hook_launch else self._launch(batch)
            except Exception as e:  # noqa: BLE001 - the batch fails, the engine keeps serving
                self._fail(batch.reqs, e, batch.extend_lens)
        # The GPU has a forward to compute: the host's time is free until its tokens are needed, unless more prefill
        # is to be admitted next (the host then feeds chunks back to back).
        collect_due(defer=bool(self.waiting) or self.prefill.chunked is not None)
        if self.overlap:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                self._process(previous)
        elif launched is not None:
            self._process(launched)
        busy = self._inflight is not None or bool(self.running or self.waiting) or self.prefill.chunked is not None
        # A verify step (computed within this step) is timed as a decode step of its rows (budget.py).
        timed = (
            (launched.batch, launched.ready)
            if launched is not None
            else (batch if batch is not None and batch.is_verify else None, None)
        )
        self.prefill_budget.step_done(*timed, busy)
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _schedule(self) -> Batch | None:
        """The next batch: prefill within the step's allowance, else decode (budget.py says which runs first)."""
        in_flight = self._inflight.sampled_ids if self._inflight is not None else frozenset()
        decoding = bool(self.running)
        allowance: Allowance | None = self.prefill_budget.allowance(decoding)
        if allowance is None:
            self.prefill.defer_chunk()
        batch = self.prefill.schedule(self.running, allowance) if allowance is not None else None
        if batch is None:
            # Drafts come from the tokens on the host: only when no step is in flight (_may_draft waited for it).
            speculate = self._speculate if self.spec is not None and self._inflight is None else None
            batch = self.decode.schedule(in_flight, self._finish_pool_full, speculate)
            if batch is None and allowance is None:  # every decode's last token is in flight: nothing to wait for
                allowance = self.prefill_budget.allowance(decoding, after_decode=True)
                batch = self.prefill.schedule(self.running, allowance)
        self.prefill_budget.scheduled(batch, allowance)
        return batch

    def _speculate(self, reqs: list[Req]) -> Batch | None:
        """The verify batch of these decoding rows when a draft pays (speculative.py), else None."""
        assert self.spec is not None
        drafts = self.spec.drafts(reqs)
        return self.spec.verify_batch(reqs, drafts) if drafts is not None else None

    def _may_draft(self) -> bool:
        """Whether the next decode step could speculate (speculative.py), judged before its tokens are read."""
        return self.spec is not None and self.spec.may_draft(self.running)

    def _needs_host_state(self, step: LaunchedStep) -> bool:
        return any(not r.finished and (r.grammar is not None or r.sampling_params.has_penalties) for r in step.sampled)

    def _launch(self, batch: Batch) -> LaunchedStep:
        """Queue the forward and the sampling; update everything that does not need the new tokens.

        Requests change only after the forward and the sampling were queued: when those raise,
        the batch is as it was scheduled (see _fail).
        """
        sampled = [r for r, m in zip(batch.reqs, batch.sample_mask) if m]
        out = self.engine.forward_and_sample(batch, sampled, self.grammars.bitmask_fn(sampled))
        self.num_steps += 1
        # Before cached_len moves: the prompt logprob entries start at its old value.
        for row, entries in (out.prompt_logprobs or {}).items():
            req = batch.reqs[row]
            # Cut at cached_len: a prompt rolled back under KV pressure computes its prompt again from the start.
            req.prompt_logprobs = (req.prompt_logprobs or [None])[: req.cached_len + 1] + entries
        for row, vector in (out.embeddings or {}).items():
            batch.reqs[row].embedding = vector
        for req, extend in zip(batch.reqs, batch.extend_lens):
            req.cached_len += extend
        if batch.is_prefill:
            for req in batch.reqs:
                if self.config.cache == "radix":
                    self.kv.cache_prefix(req)
                if req.cached_len < req.seq_len:
                    self.prefill.chunked = req
            self.running.extend(sampled)  # decodes from the next step on, its first token read from the device
        return copy_to_host(self.kv, batch, sampled, out.next_ids, out.logprobs)

    def _process(self, step: LaunchedStep) -> None:
        """Read a launched step's tokens on the host: append them, check stops, report.

        An error here (the device reporting a failed kernel, a plugin's batch hook) fails the step's requests.
        """
        try:
            next_list = read_tokens(step)
            if next_list is not None:
                for i, req in enumerate(step.sampled):
                    req.tokens_in_flight -= 1
                    if req.finished:  # finished (stop, abort) while this step was in flight: drop its token
                        continue
                    self._append_tokens(req, [next_list[i]], [step.logprobs[i]] if step.logprobs else None)
            if self._hook_step:
                plugins.get_plugin_manager().hook.minisgl_batch_step(batch=step.batch)
        except Exception as e:  # noqa: BLE001 - the batch fails, the engine keeps serving
            self._fail(step.batch.reqs, e)

    def _verify(self, verify: Batch) -> None:
        """Run a verify batch (each row's last token and its draft) as one forward, keep each row's accepted run
        (speculative.py)."""
        assert self.spec is not None and verify.drafts is not None
        drafts = verify.drafts
        # Positions with slots per row, until its KV is settled: what a failure frees.
        ends = {id(r): r.cached_len + e for r, e in zip(verify.reqs, verify.extend_lens)}
        try:
            apply = self.grammars.backend().apply if any(r.grammar is not None for r in verify.reqs) else None
            results = self.engine.forward_and_verify(verify, apply)
            self.num_steps += 1
            # Each row's last token on the device too: the next plain decode step reads it there (ReqKV.last_tokens).
            last = torch.tensor([r.tokens[-1] for r in results], dtype=torch.int64).to(self.device, non_blocking=True)
            self.kv.last_tokens.index_copy_(0, verify.table_rows, last)
            for req, draft, result in zip(verify.reqs, drafts, results):
                # The last sampled token and the accepted draft tokens have their KV now; the rest is given back.
                self.kv.shrink(req, req.cached_len + 1 + result.accepted, ends.pop(id(req)))
                self.spec.settle(req, len(draft), result.accepted)
                self._append_tokens(req, result.tokens, result.logprobs)
            if self._hook_step:
                plugins.get_plugin_manager().hook.minisgl_batch_step(batch=verify)
        except Exception as e:  # noqa: BLE001 - the batch fails, the engine keeps serving
            self._fail(verify.reqs, e, [max(0, ends.get(id(r), r.cached_len) - r.cached_len) for r in verify.reqs])

    def _append_tokens(self, req: Req, tokens: list[int], logprobs: list[Any] | None) -> None:
        """Append a step's tokens to req (one, or a verified run) and report them together; a stop or the grammar
        ends the run at its token, and the tokens after it are dropped."""
        if not req.output_ids:
            req.first_token_time = time.perf_counter()
        for i, token in enumerate(tokens):
            req.output_ids.append(token)
            req.input_ids.append(token)
            if logprobs is not None and logprobs[i] is not None:
                req.output_logprobs.append(logprobs[i])
            new_logprobs = logprobs[: i + 1] if logprobs is not None and logprobs[i] is not None else None
            finish = None
            if not grammar_accepts(req, token):
                finish = Finish("abort", None, tokens[: i + 1], new_logprobs, "the sampled token broke the grammar")
            else:
                reason, matched = stop_reason(req, token, self.max_seq_len)
                if reason is not None:
                    finish = Finish(reason, matched, tokens[: i + 1], new_logprobs)
            if finish is not None:
                if req.cached_len > req.seq_len:  # a run cut short: the KV of its dropped tokens goes back
                    self.kv.shrink(req, req.seq_len, req.cached_len)
                self._finish(req, finish)
                return
        self.pending_outputs.append(make_output(req, tokens, logprobs if logprobs and logprobs[0] else None, False))

    # ------------------------------------------------------------------ requests out

    def _fail(self, reqs: list[Req], exc: Exception, extend_lens: list[int] | None = None) -> None:
        """A step raised: finish every sequence of its requests with EngineError and free their pages.

        extend_lens: the slots the step had reserved past each request's cached_len (freed, never cached).
        With tensor parallelism the ranks may have stopped at different collectives, so no rank can go
        on alone: the engine stops instead.
        """
        if get_tp_info().size > 1:
            raise EngineError(
                f"a forward pass failed on this tensor-parallel rank: {type(exc).__name__}: {exc}"
            ) from exc
        logger.error("a step failed; failing its %d sequence(s)", len(reqs), exc_info=exc)
        for req, extend in zip(reqs, extend_lens or [0] * len(reqs)):
            self.kv.release(req, alloc_len=req.cached_len + extend)
        message = f"the forward pass of this request's batch failed ({type(exc).__name__}: {exc}); the engine goes on"
        rids = {r.rid for r in reqs}
        for key in [k for k in self.reqs if k[0] in rids]:  # with n > 1, the request's other sequences too
            self._finish(self.reqs[key], Finish("abort", error=message, error_type=EngineError.__name__))

    def _finish_pool_full(self, req: Req) -> None:
        self._finish(req, Finish("length", error="the KV pool is full"))

    def _finish(self, req: Req, finish: Finish) -> None:
        """End a sequence: out of every queue, its KV released (cached up to what was computed), reported."""
        if req.finished:
            return
        error, error_type = finish.error, finish.error_type
        req.finished, req.finish_reason, req.matched_stop = True, finish.reason, finish.matched
        req.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        if self.prefill.chunked is req:
            self.prefill.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req)
        if self.spec is not None:
            self.spec.finished(req)
        self.grammar_waiting.pop(req.rid, None)  # an abort while its grammar compiles
        if self.reqs.pop((req.rid, req.index), None) is not None:
            self._live[req.rid] -= 1
            if not self._live[req.rid]:
                del self._live[req.rid]
        if self._hook_finished:
            try:
                plugins.get_plugin_manager().hook.minisgl_request_finished(req=req)
            except Exception as e:  # noqa: BLE001 - a plugin's observer fails only this sequence, never the loop
                logger.error("plugin hook minisgl_request_finished raised for request %s", req.rid, exc_info=e)
                if error is None:
                    error = f"a plugin's minisgl_request_finished hook failed: {type(e).__name__}: {e}"
                    error_type = EngineError.__name__
        out = make_output(req, finish.new_tokens, finish.new_logprobs, True, error, error_type)
        self.pending_outputs.append(out)

    # ------------------------------------------------------------------ introspection

    def req_pages(self) -> int:
        """Pages owned by requests in flight (not by the cache)."""
        reqs = list(self.running) + [r for r in self.waiting if r.table_idx >= 0]
        if self.chunked is not None:
            reqs.append(self.chunked)
        return self.kv.req_pages(reqs)

    def stats(self) -> dict[str, int]:
        return {
            **(self.spec.stats() if self.spec is not None else {}),
            "total_pages": self.cache.num_pages,
            "free_pages": self.cache.free_pages,
            "cached_pages": self.cache.cached_pages,
            "req_pages": self.req_pages(),
            "waiting": len(self.waiting),
            "running": len(self.running) + (self.chunked is not None),
        }

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.req_pages())

    def check_alive(self) -> None:
        """One process has no peer to lose (TPScheduler raises here when a rank failed)."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix not locked by a request (e.g. after the weights changed)."""
        self.cache.evict_all()

    def shutdown(self) -> None:
        for key in list(self.reqs):
            self._finish(self.reqs[key], Finish("abort", error="the engine shut down"))

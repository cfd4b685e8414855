"""The tensor-parallel scheduler: one Scheduler per rank; rank 0 takes requests and sends each step's ops.

Every rank runs the same Scheduler on the same inputs in the same order, so every rank builds the same
batches; the model's layers all-reduce / all-gather through torch.distributed (NCCL on CUDA, gloo on
CPU). The ops (requests added or aborted, profiler start/stop) reach ranks > 0 over the private control channel
(distributed/channel.py); a rank > 0 waits for the next step's ops, and the collectives of the forward keep
the devices in step. Spawning, the rendezvous, NCCL setup and failure watching: runtime/ranks.py.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import torch

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams, TokenOutput
from minisgl.distributed.auth import load_secret
from minisgl.distributed.channel import ChannelPlace, Spoke
from minisgl.distributed.profile import active_profiler, apply_profile_op
from minisgl.lifetime import die_with_parent
from minisgl.runtime.ranks import (
    EXIT_WAIT_S,
    RankGroup,
    RankZeroWatch,
    close_groups,
    init_distributed,
    leave,
    rendezvous_store,
)
from minisgl.scheduler import collector
from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger("minisgl")


def make_scheduler(config: EngineConfig) -> Any:
    """The Scheduler for tp == 1, else the TP driver with the same API."""
    if config.tp > 1:
        return TPScheduler(config)
    return Scheduler(config)


# ---------------------------------------------------------------------------- rank 0


class TPScheduler(RankGroup):
    """Rank 0's view of a tensor-parallel engine: the Scheduler API, mirrored to every rank."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)  # the channel, the rendezvous, the other ranks, the failure monitor
        self._ops: list[Any] = []
        self._budget_sent: list[float] | None = None  # the prefill budget's state the other ranks have
        self._deferred: dict[str, tuple] = {}  # the "add" op of a request whose grammar rank 0 is still compiling
        self._closed = False
        try:
            self.check_ranks()  # no collective runs with a process that does not hold the secret
            init_distributed(config, 0, self.store)
            self.sched = Scheduler(config)
        except Exception as e:
            raise self._start_failed(e) from e
        self.model_config = self.sched.model_config
        self.device = self.sched.device
        self.engine = self.sched.engine
        self.max_seq_len = self.sched.max_seq_len
        self.page_size = self.sched.page_size
        self.eos_token_ids = self.sched.eos_token_ids
        # Every rank must queue a request at the same step: rank 0 decides when its grammar is ready (step()).
        self.sched.admit_in_step = False
        if self.sched.spec is not None:  # rank 0 drafts; each decision reaches every rank within the step
            self.sched.spec.lead = lambda kind, decision: self._send([(kind, decision)])

    @property
    def tokenizer(self) -> Any:
        return self.sched.tokenizer

    @property
    def has_work(self) -> bool:
        return self.sched.has_work or bool(self._ops)

    @property
    def defer_grammars(self) -> bool:
        return self.sched.defer_grammars

    @defer_grammars.setter
    def defer_grammars(self, value: bool) -> None:
        self.sched.defer_grammars = value

    @property
    def grammar_waiting(self) -> dict[str, Any]:
        return self.sched.grammar_waiting

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        self.sched.validate(input_ids, params)

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams, embed: bool = False) -> None:
        # Rank 0 first: a request it rejects raises here and never reaches the other ranks.
        self.sched.add_request(rid, input_ids, params, embed)
        op = ("add", rid, list(input_ids), params.to_dict(), embed)
        if rid in self.sched.grammar_waiting:
            self._deferred[rid] = op  # sent with the step at which rank 0 queues it
            self._ops.append(("compile", params.to_dict()))  # the other ranks start compiling now too
        else:
            self._ops.append(op)

    def abort(self, rid: str) -> None:
        self.sched.abort(rid)
        self._deferred.pop(rid, None)
        self._ops.append(("abort", rid))

    def _admit_compiled(self) -> None:
        for rid in self.sched.admit_compiled():
            self._ops.append(self._deferred.pop(rid))
        for rid in [r for r in self._deferred if r not in self.sched.grammar_waiting]:
            del self._deferred[rid]  # its grammar failed: only rank 0 ever saw the request

    def profile(self, action: str, out_dir: str | None = None) -> None:
        """torch.profiler on every rank from the next step ("start", out_dir) until "stop" (see profile.py)."""
        self._ops.append(("profile", action, out_dir))

    def step(self) -> list[TokenOutput]:
        self._raise_if_failed()
        if self._deferred:
            self._admit_compiled()
        ops, self._ops = self._ops, []
        self._share_budget(ops)
        t0 = time.perf_counter()
        self.step_started = time.monotonic()  # the failure watch ends a process whose step never comes back
        try:
            self._send(ops)
            sent = time.perf_counter()
            for op in ops:
                if op[0] == "profile":
                    apply_profile_op(op, 0)
            t1 = time.perf_counter()  # a profiler's start is neither the ops' sending nor the step
            outputs = self.sched.step()
        except Exception as e:
            raise self._as_rank_failure(e) from e
        finally:
            self.step_started = None
        # On the GPU a dead peer's collectives were aborted, not failed: these outputs are garbage.
        self._raise_if_failed()
        prof = active_profiler()
        if prof is not None:
            prof.record_step(sent - t0, time.perf_counter() - t1)
        return outputs

    def _share_budget(self, ops: list[Any]) -> None:
        """Rank 0 alone measures step times (they differ between ranks); the state its prefill budget decides this
        step with goes to the other ranks with the step's ops, whenever it changed, so every rank builds the same
        batches."""
        budget = self.sched.prefill_budget
        budget.step_started()  # its measurements up to now: the step's own call then changes nothing
        state = list(budget.state())
        if state != self._budget_sent:
            ops.append(("prefill_budget", state))
            self._budget_sent = state

    def stats(self) -> dict[str, int]:
        return self.sched.stats()

    def check_integrity(self) -> None:
        self.sched.check_integrity()

    def check_alive(self) -> None:
        """Raise RankFailedError if a rank has failed (an idle engine learns it here, not at its next request)."""
        self._raise_if_failed()

    def reset_prefix_cache(self) -> None:
        # Every rank, before the same step: ranks whose caches differ would build different batches.
        self.sched.reset_prefix_cache()
        self._ops.append(("reset_prefix_cache",))

    def shutdown(self) -> None:
        """Stop every rank: "exit" to each, wait until they confirm (bounded), then abort the groups."""
        if self._closed:
            return
        self._closed = True
        self.sched.shutdown()
        if self._failure is None:  # with a dead peer a kernel may never finish: nothing to wait for then
            self.engine.release_graphs()  # before the group goes: graphs with collectives block its teardown
        self._stop_ranks(on_cuda=self.device.type == "cuda")


# ---------------------------------------------------------------------------- ranks > 0


class RankZeroDecisions:
    """A rank > 0's speculation decisions: rank 0's, received within the step (Speculator.follow). The drafts are
    checked before use: a row count or a token that does not fit would make this rank's forward differ from rank 0's."""

    def __init__(self, spoke: Spoke, vocab_size: int) -> None:
        self.spoke, self.vocab_size = spoke, vocab_size

    def __call__(self, kind: str, rows: int) -> Any:
        ops = self.spoke.next_ops()
        if len(ops) != 1 or ops[0][0] != kind:
            raise RuntimeError(f"expected rank 0's {kind!r} decision within the step, got {[op[0] for op in ops]}")
        decision = ops[0][1]
        if kind == "may_draft" and isinstance(decision, bool):
            return decision
        if kind == "drafts" and (decision is None or self._valid_drafts(decision, rows)):
            return decision
        raise RuntimeError(f"rank 0's {kind!r} decision {decision!r} does not fit a step of {rows} rows")

    def _valid_drafts(self, drafts: Any, rows: int) -> bool:
        return (
            isinstance(drafts, list)
            and len(drafts) == rows
            and all(
                isinstance(d, list) and all(isinstance(t, int) and 0 <= t < self.vocab_size for t in d) for d in drafts
            )
        )


def _apply(sched: Any, ops: list[Any], rank: int) -> None:
    for op in ops:
        if op[0] == "add":
            sched.add_request(op[1], op[2], SamplingParams.from_validated(op[3]), op[4])  # rank 0 validated them
        elif op[0] == "abort":
            sched.abort(op[1])
        elif op[0] == "compile":  # rank 0 waits for this grammar before it sends the request
            sched.grammars.backend().compile_async(SamplingParams.from_validated(op[1]))
        elif op[0] == "reset_prefix_cache":
            sched.reset_prefix_cache()
        elif op[0] == "profile":
            apply_profile_op(op, rank)
        elif op[0] == "prefill_budget":  # rank 0's measurements decide every rank's chunks
            sched.prefill_budget.load(op[1])
        else:  # a decision rank 0 sends only within a step (RankZeroDecisions)
            raise RuntimeError(f"rank 0 sent {op[0]!r} between steps")


def worker_main(config: EngineConfig, rank: int, place: ChannelPlace) -> int:
    """Ranks > 0: mirror rank 0's scheduler step by step until told to exit; returns an exit code."""
    logging.basicConfig(level=logging.WARNING, format=f"[minisgl tp{rank}] %(levelname)s %(message)s")
    secret = load_secret(config)
    spoke = Spoke(place, secret, rank)
    watch = RankZeroWatch(spoke, rank)
    try:
        spoke.join()  # rank 0 lets the process group form only once every rank has said hello with the secret
        init_distributed(config, rank, rendezvous_store(config, place, is_master=False))
        sched = Scheduler(config)
        if sched.spec is not None:
            sched.spec.follow = RankZeroDecisions(spoke, sched.model_config.vocab_size)
        collector.take_over()
        while True:
            t0 = time.perf_counter()
            ops = spoke.next_ops()
            t1 = time.perf_counter()
            if ops and ops[0][0] == "exit":
                watch.leaving.set()
                if sched.device.type == "cuda":
                    torch.cuda.synchronize()  # this rank's last collectives: rank 0 waits on them
                sched.engine.release_graphs()  # before the group goes: graphs with collectives block its teardown
                spoke.report("exited")
                close_groups(clean=True, timeout=EXIT_WAIT_S)  # with rank 0's, at the same time
                spoke.close()
                return 0
            _apply(sched, ops, rank)
            t2 = time.perf_counter()  # as on rank 0: a profiler's start is not the step
            sched.step()
            prof = active_profiler()
            if prof is not None:
                prof.record_step(t1 - t0, time.perf_counter() - t2)
    except Exception as e:  # noqa: BLE001 - any failure ends this rank, and so the engine
        reason = f"tensor-parallel rank {rank} failed: {type(e).__name__}: {e}"
        spoke.report("failed", reason)  # rank 0 stops at once instead of on its next collective
        spoke.close()  # lingers until the report is out (or rank 0 is gone)
        leave(1, reason)
    return 1


def _worker_entry(argv: list[str]) -> None:
    die_with_parent()  # a rank never outlives the process that started it (rank 0, or a node's launcher)
    fields = json.loads(argv[0])
    code = worker_main(EngineConfig(**fields), int(argv[1]), ChannelPlace.parse(argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not through interpreter teardown: NCCL's exit handlers wait for the peers


if __name__ == "__main__":
    _worker_entry(sys.argv[1:])

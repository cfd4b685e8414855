"""The scheduler process: receives tokenized requests, steps the engine, sends token outputs.

With tp > 1 this is rank 0: minisgl.runtime.tp.TPScheduler starts ranks 1..N-1 and
broadcasts each step's requests to them, behind the same Scheduler API.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import zmq

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams
from minisgl.runtime.protocol import (
    Abort,
    AddRequest,
    FlushCache,
    GetStats,
    RequestMeta,
    SchedulerReady,
    Shutdown,
    StatsReply,
    TokenizerDir,
    TokenOutputs,
    WorkerFailed,
    WorkerInit,
    encode,
    error_reply,
)
from minisgl.runtime.transport import Endpoints, ParentWatch, pull, push, recv_ready, worker_setup
from minisgl.scheduler import collector
from minisgl.tokenizer import has_chat_template

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger("minisgl")

IDLE_POLL_MS = 500  # how long an idle scheduler waits for a message before checking on its parent
# The tokenizer (stop strings, grammars) loads once the scheduler has been idle this long: during start-up its
# import would take a core from the text worker, which the first answer waits for.
TOKENIZER_AFTER_IDLE_S = 2.0
GRAMMAR_POLL_MS = 5  # how often a scheduler with nothing else to run checks on a grammar being compiled


def engine_facts(sched: "Scheduler") -> dict[str, Any]:
    """How the engine computes, for `minisgl ps`, /metrics and /v1/models: its weights' quantization ("none" when
    unquantized) and this process's CPU threads."""
    import torch  # lazy: the daemon process itself never loads torch

    return {"quantization": sched.engine.config.quantization or "none", "threads": torch.get_num_threads()}


def model_info(sched: "Scheduler", config: EngineConfig) -> dict[str, Any]:
    mc, engine = sched.model_config, sched.engine
    return {
        "name": config.model,
        "path": str(engine.model_dir) if engine.model_dir is not None else None,
        "architecture": mc.architecture,
        "model_type": getattr(mc.hf_config, "model_type", None),
        "context_length": engine.max_seq_len,
        "max_position_embeddings": mc.max_position_embeddings,
        "eos_token_ids": list(mc.eos_token_ids),
        "vocab_size": mc.vocab_size,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "tp": config.tp,
        "page_size": sched.page_size,
        "total_pages": sched.stats()["total_pages"],
        "has_chat_template": has_chat_template(engine.model_dir)
        if engine.model_dir is not None
        else getattr(sched.tokenizer, "chat_template", None) is not None,
        **engine_facts(sched),
        "config": config.to_dict(),
    }


def run_scheduler(config: EngineConfig, endpoints: Endpoints, log_level: int) -> None:
    """Process entry: load the engine, report readiness, then serve until Shutdown."""
    worker_setup(log_level)
    ctx = zmq.Context()
    frontend = push(ctx, endpoints.frontend)
    detokenizer = push(ctx, endpoints.detokenizer)
    try:
        t0 = time.perf_counter()
        from minisgl.models.loader import resolve_model  # lazy: torch, in the scheduler process only
        from minisgl.runtime.tp import make_scheduler  # lazy: torch, in the scheduler process only

        # The text worker reads the tokenizer while the weights load (the same directory the engine resolves).
        detokenizer.send(encode(TokenizerDir(str(resolve_model(config.model)))))
        sched = make_scheduler(config)
    except BaseException as e:  # noqa: BLE001 - any start-up failure is reported to the daemon, then we exit
        logger.error("scheduler failed to start: %s: %s", type(e).__name__, e)
        frontend.send(encode(WorkerFailed("scheduler", type(e).__name__, str(e))))
        frontend.close()
        detokenizer.close(linger=0)
        ctx.term()
        sys.exit(1)
    inbox = pull(ctx, endpoints.scheduler)
    info = model_info(sched, config)
    detokenizer.send(encode(WorkerInit(info, str(sched.engine.model_dir))))
    frontend.send(encode(SchedulerReady(info, sched.stats())))
    logger.info("scheduler ready in %.1fs", time.perf_counter() - t0)
    collector.take_over()
    exit_code = 0
    try:
        SchedulerLoop(sched, inbox, detokenizer, frontend).run()
    except Exception as e:  # noqa: BLE001 - an engine failure ends the daemon; clients get an error
        logger.exception("scheduler failed")
        frontend.send(encode(WorkerFailed("scheduler", type(e).__name__, str(e))))
        exit_code = 1
    finally:
        sched.shutdown()
        for sock in (inbox, detokenizer, frontend):
            sock.close()
        ctx.term()
    # Everything is released; tearing down a loaded engine's interpreter takes seconds for nothing.
    logging.shutdown()
    os._exit(exit_code)


class SchedulerLoop:
    """Receive -> apply -> step -> send outputs, until Shutdown (or the daemon process is gone)."""

    def __init__(self, sched: "Scheduler", inbox: zmq.Socket, detokenizer: zmq.Socket, frontend: zmq.Socket) -> None:
        self.sched = sched
        self.inbox = inbox
        self.detokenizer = detokenizer
        self.frontend = frontend
        self.parent = ParentWatch()
        self.facts = engine_facts(sched)  # sent with every GetStats reply: `minisgl ps` and /metrics show them
        self.busy_at = time.monotonic()
        self.tokenizer_started = False
        sched.defer_grammars = True  # a grammar compiles off this loop; the other requests keep decoding

    def _poll_ms(self) -> int:
        if self.sched.has_work:
            return 0
        return GRAMMAR_POLL_MS if self.sched.grammar_waiting else IDLE_POLL_MS

    def run(self) -> None:
        while True:
            for msg in recv_ready(self.inbox, self._poll_ms()):
                if isinstance(msg, Shutdown):
                    self._send_detok(msg)
                    return
                self._apply(msg)
            if self.sched.has_work:
                outputs = self.sched.step()
                if outputs:
                    self._send_detok(TokenOutputs(outputs))
                self.busy_at = time.monotonic()
            elif self.parent.gone:
                logger.error("the daemon process is gone; scheduler exiting")
                return
            else:
                self.sched.check_alive()  # a TP rank that died while idle stops the daemon now, not at the next request
                collector.collect_due()
                if not self.tokenizer_started and time.monotonic() - self.busy_at > TOKENIZER_AFTER_IDLE_S:
                    self.tokenizer_started = True
                    self.sched.engine.tokenizer_load.start()  # a request that needs it first loads it itself

    def _apply(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            try:
                params = SamplingParams.from_validated(msg.params)  # the tokenizer worker validated them
                self.sched.add_request(msg.rid, msg.input_ids, params, msg.embed)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone, with its error type
                self._send_frontend(error_reply(msg.rid, e))
                return
            self._send_detok(RequestMeta(msg.rid, msg.detok))
        elif isinstance(msg, Abort):
            self.sched.abort(msg.rid)
        elif isinstance(msg, GetStats):
            self._send_frontend(StatsReply(msg.rid, {**self.sched.stats(), **self.facts}))
        elif isinstance(msg, FlushCache):  # between steps; a running request's prefix stays (it is locked)
            self.sched.reset_prefix_cache()
            self._send_frontend(StatsReply(msg.rid, self.sched.stats()))
        else:
            logger.warning("scheduler ignored an unexpected %s message", type(msg).__name__)

    def _send_detok(self, msg: Any) -> None:
        self.detokenizer.send(encode(msg))

    def _send_frontend(self, msg: Any) -> None:
        self.frontend.send(encode(msg))

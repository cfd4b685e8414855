"""The text worker: the daemon's one process for text in (tokenizer) and text out (detokenizer).

    frontend ──requests──▶ RequestPreparer ──AddRequest──▶ scheduler
    frontend ◀──Chunks──── Detokenizer ◀──TokenOutputs─── scheduler

Requests, aborts, stats and cache-flush requests and Shutdown go on to the scheduler in the order they came, so
an abort never overtakes the request it cancels; tokenize and detokenize requests are answered here. Outputs are
served before new requests: a
stream's next token never waits behind a burst of chat templates. One process instead of two
costs nothing measurable (docs/benchmarks.md, "Text worker: one process vs two").
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

import zmq

from minisgl.runtime.detokenizer_worker import Detokenizer
from minisgl.runtime.protocol import (
    Abort,
    Chunks,
    Detokenize,
    FlushCache,
    Generate,
    GetStats,
    RequestMeta,
    Shutdown,
    Tokenize,
    TokenOutputs,
    WorkerInit,
    WorkerReady,
    decode,
    encode,
    error_reply,
)
from minisgl.runtime.tokenizer_worker import RequestPreparer
from minisgl.runtime.transport import Endpoints, ParentWatch, preload_tokenizer_modules, pull, push, worker_setup
from minisgl.tokenizer import load_tokenizer

logger = logging.getLogger("minisgl")

DRAIN_LIMIT = 256  # messages taken from one socket before looking at the other


class TextWorker:
    """Tokenize requests for the scheduler and detokenize its outputs for the frontend."""

    def __init__(self, requests: zmq.Socket, outputs: zmq.Socket, scheduler: zmq.Socket, frontend: zmq.Socket) -> None:
        self.requests = requests
        self.outputs = outputs
        self.scheduler = scheduler
        self.frontend = frontend
        self.preparer: RequestPreparer | None = None
        self.detokenizer: Detokenizer | None = None
        self.stopping = False  # Shutdown went to the scheduler; wait for it to come back on the outputs
        self.parent = ParentWatch()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.outputs, zmq.POLLIN)
        poller.register(self.requests, zmq.POLLIN)
        while True:
            events = dict(poller.poll(1000))
            if not events:
                if self.parent.gone:
                    logger.error("the daemon process is gone; text worker exiting")
                    return
                continue
            if self.outputs in events and self._drain(self.outputs, self._on_output):
                return
            if self.requests in events and not self.stopping:
                self._drain(self.requests, self._on_request)

    def _drain(self, sock: zmq.Socket, handle: Callable[[bytes], bool]) -> bool:
        """Handle up to DRAIN_LIMIT waiting messages; True once the worker should exit."""
        for _ in range(DRAIN_LIMIT):
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if handle(raw):
                return True
        return False

    def _on_request(self, raw: bytes) -> bool:
        msg = decode(raw)
        if isinstance(msg, Generate):
            assert self.preparer is not None, "the daemon forwards requests only after start-up"
            try:
                add = self.preparer.prepare(msg)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone, with its error type
                self.frontend.send(encode(error_reply(msg.rid, e)))
                return False
            self.scheduler.send(encode(add))
        elif isinstance(msg, (Tokenize, Detokenize)):  # answered here: the scheduler is not involved
            assert self.preparer is not None, "the daemon forwards requests only after start-up"
            try:
                reply = self.preparer.tokenize(msg) if isinstance(msg, Tokenize) else self.preparer.detokenize(msg)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone, with its error type
                reply = error_reply(msg.rid, e)
            self.frontend.send(encode(reply))
        elif isinstance(msg, (Abort, GetStats, FlushCache)):
            self.scheduler.send(raw)
        elif isinstance(msg, Shutdown):
            self.scheduler.send(raw)
            self.stopping = True
        return False

    def _on_output(self, raw: bytes) -> bool:
        msg = decode(raw)
        if isinstance(msg, TokenOutputs):
            assert self.detokenizer is not None, "the scheduler sends WorkerInit first"
            chunks, errors = self.detokenizer.process(msg.items)
            if chunks:
                self.frontend.send(encode(Chunks(chunks)))
            for error in errors:
                self.frontend.send(encode(error))
        elif isinstance(msg, RequestMeta):
            assert self.detokenizer is not None, "the scheduler sends WorkerInit first"
            self.detokenizer.add_request(msg.rid, msg.detok)
        elif isinstance(msg, WorkerInit):
            tokenizer = load_tokenizer(msg.tokenizer_dir)
            self.preparer = RequestPreparer(tokenizer, msg.model_info)
            self.detokenizer = Detokenizer(tokenizer)
            self.frontend.send(encode(WorkerReady("text")))
            logger.info("text worker ready")
        elif isinstance(msg, Shutdown):
            return True  # the scheduler's last message: nothing follows it
        return False


def run_text_worker(endpoints: Endpoints, log_level: int) -> None:
    """Process entry: wait for WorkerInit (from the scheduler), then serve until Shutdown."""
    worker_setup(log_level)
    ctx = zmq.Context()
    requests = pull(ctx, endpoints.tokenizer)
    outputs = pull(ctx, endpoints.detokenizer)
    scheduler = push(ctx, endpoints.scheduler)
    frontend = push(ctx, endpoints.frontend)
    preload_tokenizer_modules()
    try:
        TextWorker(requests, outputs, scheduler, frontend).run()
    except Exception:  # noqa: BLE001 - log it; the daemon notices this process is gone and shuts down
        logger.exception("text worker failed")
        sys.exit(1)
    finally:
        for sock in (requests, outputs, scheduler, frontend):
            sock.close()
        ctx.term()

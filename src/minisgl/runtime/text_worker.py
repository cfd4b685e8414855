"""The text worker: the daemon's one process for text in (tokenizer) and text out (detokenizer).

    frontend ──requests──▶ RequestPreparer ──AddRequest──▶ scheduler
    frontend ◀──Chunks──── Detokenizer ◀──TokenOutputs─── scheduler

Requests, aborts, stats and cache-flush requests and Shutdown go on to the scheduler in the order they came, so
an abort never overtakes the request it cancels; tokenize and detokenize requests are answered here. Outputs are
served before new requests: a
stream's next token never waits behind a burst of chat templates. One process instead of two
costs nothing measurable (docs/benchmarks.md, "Text worker: one process vs two").

A request message larger than INLINE_BYTES is prepared (rendered, measured, tokenized) by a PreparePool thread, off
this loop: the tokenizer's Rust code runs without the GIL, so other requests and every stream's outputs go on
meanwhile; the loop prepares at most TURN_BYTES of smaller ones between two looks at the outputs. An abort of a
request still in the pool waits for it. After a large request the process hands its memory back (release_memory).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import io
import logging
import os
import queue
import sys
import threading
from typing import Any, Callable

import msgpack
import zmq

from minisgl.runtime.detokenizer_worker import Detokenizer
from minisgl.runtime.protocol import (
    Abort,
    AddRequest,
    Chunks,
    Detokenize,
    FlushCache,
    Generate,
    GetStats,
    RequestMeta,
    Shutdown,
    Tokenize,
    TokenizerDir,
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
INLINE_BYTES = 64 * 2**10  # a larger request message is prepared by the pool (64 KiB tokenize in ~0.1 s)
TURN_BYTES = 256 * 2**10  # request bytes prepared on the loop between two looks at the outputs
PREPARE_THREADS = 2  # large requests prepared at once; smaller ones never wait for them
TRIM_AFTER_BYTES = 2**20  # after a request message this large, release_memory once the pool is idle


class PreparePool:
    """Threads that run jobs off the worker's loop; each finished job wakes the loop through a pipe (wake_fd)."""

    def __init__(self, threads: int) -> None:
        self.jobs: queue.SimpleQueue[tuple[str, Callable[[], Any], int]] = queue.SimpleQueue()
        self.done: collections.deque[tuple[str, Any, BaseException | None, int]] = collections.deque()
        self.pending = 0
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        for i in range(threads):  # daemon threads: an exit never waits for a tokenization under way
            threading.Thread(target=self._serve, name=f"prepare-{i}", daemon=True).start()

    def submit(self, rid: str, job: Callable[[], Any], size: int) -> None:
        self.pending += 1
        self.jobs.put((rid, job, size))

    def _serve(self) -> None:
        while True:
            self.done.append(self._run(*self.jobs.get()))
            os.write(self._wake_w, b"\0")

    @staticmethod
    def _run(rid: str, job: Callable[[], Any], size: int) -> tuple[str, Any, BaseException | None, int]:
        """Run a job; nothing of it outlives the call but its result (the request's text goes with its frames)."""
        try:
            return rid, job(), None, size
        except Exception as e:  # noqa: BLE001 - the request fails alone, with its error type
            e.__traceback__ = e.__context__ = e.__cause__ = None  # their frames hold the request's text
            return rid, None, e, size

    def collect(self) -> list[tuple[str, Any, BaseException | None, int]]:
        """The jobs finished since the last call: (rid, result, error, size)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        finished = []
        while self.done:
            finished.append(self.done.popleft())
        self.pending -= len(finished)
        return finished


PREPARED_TAGS = frozenset({Generate.TAG, Tokenize.TAG, Detokenize.TAG})  # type: ignore[attr-defined]


def peek(raw: bytes) -> tuple[str, str] | None:
    """(tag, rid) of an encoded message, read from its head only (protocol.encode: [version, tag, rid, ...]);
    None for anything else, which decode() then explains."""
    try:
        head = msgpack.Unpacker(io.BytesIO(raw), raw=False, read_size=4096)
        if head.read_array_header() < 3:
            return None
        _, tag, rid = head.unpack(), head.unpack(), head.unpack()
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types for bad input
        return None
    return (tag, rid) if isinstance(tag, str) and isinstance(rid, str) and rid else None


def release_memory() -> None:
    """Give the memory of a large request back to the OS: Python frees big buffers to malloc, and glibc keeps freed
    heap (and each thread's arena) mapped until malloc_trim asks. Cheap: the start-up's objects are frozen."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; musl and others have none
    except (OSError, AttributeError):
        return None


class TextWorker:
    """Tokenize requests for the scheduler and detokenize its outputs for the frontend."""

    def __init__(self, requests: zmq.Socket, outputs: zmq.Socket, scheduler: zmq.Socket, frontend: zmq.Socket) -> None:
        self.requests = requests
        self.outputs = outputs
        self.scheduler = scheduler
        self.frontend = frontend
        self.preparer: RequestPreparer | None = None
        self.detokenizer: Detokenizer | None = None
        self.early_tokenizer: tuple[str, Any] | None = None  # (directory, tokenizer) read before WorkerInit
        self.stopping = False  # Shutdown went to the scheduler; wait for it to come back on the outputs
        self.parent = ParentWatch()
        self.pool = PreparePool(PREPARE_THREADS)
        self.preparing: dict[str, list[bytes]] = {}  # rid in the pool -> its aborts, held until it goes on
        self.trim_due = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.outputs, zmq.POLLIN)
        poller.register(self.pool.wake_fd, zmq.POLLIN)
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
            if self.pool.wake_fd in events:
                self._on_prepared()
            if self.requests in events and not self.stopping:
                self._drain_requests()

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

    def _drain_requests(self) -> None:
        """Up to DRAIN_LIMIT requests, or until TURN_BYTES of them were prepared here: outputs wait one budget."""
        spent = 0
        for _ in range(DRAIN_LIMIT):
            try:
                raw = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            spent += self._on_request(raw)
            if self.stopping or spent >= TURN_BYTES:
                return

    def _on_request(self, raw: bytes) -> int:
        """Handle one request message; the bytes prepared on this loop (0: the pool or the scheduler has it)."""
        head = peek(raw) if len(raw) > INLINE_BYTES else None
        if head is not None and head[0] in PREPARED_TAGS:  # decoded in the pool too: 30 MB take 0.1 s
            assert self.preparer is not None, "the daemon forwards requests only after start-up"
            self.preparing[head[1]] = []
            self.pool.submit(head[1], functools.partial(self._prepare, self.preparer, raw), len(raw))
            return 0
        msg = decode(raw)
        if isinstance(msg, (Generate, Tokenize, Detokenize)):
            assert self.preparer is not None, "the daemon forwards requests only after start-up"
            try:
                result, error = self._prepare(self.preparer, msg), None
            except Exception as e:  # noqa: BLE001 - a bad request fails alone, with its error type
                result, error = None, e
            self._send_prepared(msg.rid, result, error)
            return len(raw)
        if isinstance(msg, Abort) and msg.rid in self.preparing:
            self.preparing[msg.rid].append(raw)  # sent after its request: the scheduler would not know the rid yet
        elif isinstance(msg, (Abort, GetStats, FlushCache)):
            self.scheduler.send(raw)
        elif isinstance(msg, Shutdown):
            self.scheduler.send(raw)
            self.stopping = True
        return 0

    @staticmethod
    def _prepare(preparer: RequestPreparer, msg: bytes | Generate | Tokenize | Detokenize) -> Any:
        """The AddRequest, TokenizeReply or DetokenizeReply of a request (or of its bytes, measured before decoding)."""
        if isinstance(msg, bytes):
            wire = msgpack.unpackb(msg, raw=True, strict_map_key=False)  # text stays bytes: a copy, no UTF-8 decode
            if isinstance(wire, list) and len(wire) > 2 and wire[1] == Generate.TAG.encode():  # type: ignore[attr-defined]
                preparer.measure(dict(zip(Generate._fields, wire[2:])))
            del wire
            msg = decode(msg)
        if isinstance(msg, Generate):
            return preparer.prepare(msg)
        return preparer.tokenize(msg) if isinstance(msg, Tokenize) else preparer.detokenize(msg)

    def _send_prepared(self, rid: str, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.frontend.send(encode(error_reply(rid, error)))
        elif isinstance(result, AddRequest):
            self.scheduler.send(encode(result))
        else:  # answered here: the scheduler is not involved
            self.frontend.send(encode(result))

    def _on_prepared(self) -> None:
        self.trim_due |= self._send_finished(self.pool.collect())
        if self.trim_due and not self.pool.pending:  # the finished requests' text is gone with the call above
            self.trim_due = False
            release_memory()

    def _send_finished(self, finished: list[tuple[str, Any, BaseException | None, int]]) -> bool:
        """Pass on what the pool prepared, then the aborts held for it; True if a large request was among it."""
        for rid, result, error, _ in finished:
            held = self.preparing.pop(rid, [])
            if self.stopping:
                continue  # the daemon failed every request in flight when it began to stop
            self._send_prepared(rid, result, error)
            if isinstance(result, AddRequest):
                for raw in held:
                    self.scheduler.send(raw)
        return any(size >= TRIM_AFTER_BYTES for *_, size in finished)

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
        elif isinstance(msg, TokenizerDir):
            try:
                self.early_tokenizer = (msg.tokenizer_dir, load_tokenizer(msg.tokenizer_dir))
            except Exception:  # noqa: BLE001 - the scheduler's start-up reports a bad model; WorkerInit retries
                self.early_tokenizer = None
        elif isinstance(msg, WorkerInit):
            early, self.early_tokenizer = self.early_tokenizer, None
            tokenizer = (
                early[1] if early is not None and early[0] == msg.tokenizer_dir else load_tokenizer(msg.tokenizer_dir)
            )
            self.preparer = RequestPreparer(tokenizer, msg.model_info)
            self.detokenizer = Detokenizer(tokenizer)
            gc.collect()
            gc.freeze()  # the start-up's ~300k objects: a full collection later (release_memory's) takes 0.5 s without
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

"""Client and AsyncClient: talk to the local minisgl daemon over ZeroMQ (finding or starting it).

    from minisgl import Client, AsyncClient, SamplingParams

    c = Client(model="smollm2")                      # finds the daemon serving smollm2, starts one if none
    out = c.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    out.text, out.token_ids, out.finish_reason, out.usage       # usage: prompt/completion/cached tokens
    for chunk in c.stream([{"role": "user", "content": "Hi"}]):  # chat messages, text, or token ids
        print(chunk.text, end="")                                 # deltas; usage on the last chunk

    async with AsyncClient(model="smollm2") as ac:
        out = await ac.generate("Hello")
        async for chunk in ac.stream("Hello"):
            ...

Every request is independent (the daemon batches concurrent ones). Leaving a stream early
(break, close(), an exception, a cancelled task) or a timeout aborts the request in the daemon,
which frees its KV pages. Errors arrive as the typed minisgl.errors exceptions
(InvalidRequestError, PromptTooLongError, GrammarError, ...); DaemonNotRunningError and
DaemonTimeoutError say what to do about the daemon itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, TypeVar, Union

import zmq

from minisgl.core import CompletionOutput, FirstOutputShortcuts, SamplingParams
from minisgl.errors import DaemonError, DaemonTimeoutError, InvalidRequestError
from minisgl.runtime.auth import ClientCurve
from minisgl.runtime.connection import AsyncConnection, SyncConnection, as_exception
from minisgl.runtime.launcher import PING_TIMEOUT_S
from minisgl.runtime.protocol import (
    Abort,
    Chunk,
    Detokenize,
    DetokenizeReply,
    Error,
    FlushCache,
    Generate,
    GetModelInfo,
    GetStats,
    ModelInfoReply,
    Pong,
    ProtocolError,
    StatsReply,
    Tokenize,
    TokenizeReply,
    Usage,
)

Prompt = Union[str, Sequence[int], Sequence[dict[str, Any]]]
DEFAULT_TIMEOUT_S = 300.0
_UNSET: Any = object()
_R = TypeVar("_R")

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Chunk",
    "Client",
    "CompletionOutput",
    "DEFAULT_TIMEOUT_S",
    "Embedding",
    "GenerateResult",
    "PING_TIMEOUT_S",
    "Stream",
    "Usage",
    "ping",
]


def ping(address: str, timeout: float = PING_TIMEOUT_S) -> Pong | None:
    """The Pong (state: "loading", "ready" or "stopping"; model; ...) of the daemon at address, or None
    when nothing answers. CURVE keys are found as a Client finds them; a refused handshake raises DaemonError."""
    from minisgl.runtime.launcher import ping as _ping

    return _ping(address, timeout, ClientCurve.resolve(None, None))


@dataclass
class GenerateResult(FirstOutputShortcuts):
    """A finished request: outputs[i] is sample i (n > 1); the shortcuts read outputs[0]."""

    rid: str
    outputs: list[CompletionOutput]
    usage: Usage
    prompt_logprobs: list[dict[str, Any]] | None = None  # with SamplingParams.prompt_logprobs (see Chunk)

    @property
    def matched_stop(self) -> str | int | None:
        return self.outputs[0].matched_stop

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return self.outputs[0].tool_calls

    @property
    def logprobs(self) -> list[dict[str, Any]] | None:
        return self.outputs[0].logprobs


@dataclass
class Embedding:
    """An embedding request's answer: the prompt's last hidden state (after the final norm, L2-normalised)."""

    embedding: list[float]
    prompt_tokens: int


def _embed_messages(inputs: Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]]) -> list[Generate]:
    """One Generate(embed=True) per input: a text, a list of token ids, or a list of those."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]  # type: ignore[list-item]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidRequestError("embed takes a text, a list of token ids, or a non-empty list of those")
    msgs = []
    for item in inputs:
        if isinstance(item, str):
            msgs.append(Generate(uuid.uuid4().hex, prompt=item, embed=True))
        elif isinstance(item, (list, tuple)):
            msgs.append(Generate(uuid.uuid4().hex, input_ids=list(item), embed=True))
        else:
            raise InvalidRequestError(f"an input to embed is a text or a list of token ids, got {type(item).__name__}")
    return msgs


def _embedding(chunks: list[Chunk]) -> Embedding:
    vector = next((c.embedding for c in chunks if c.embedding is not None), None)
    usage = next((c.usage for c in chunks if c.usage is not None), None)
    if vector is None or usage is None:
        raise ProtocolError("the daemon answered an embedding request without a vector")
    return Embedding(list(vector), usage.prompt_tokens)


def merge_tool_calls(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Fold OpenAI-style tool-call deltas (by "index": name first, argument fragments after) into calls."""
    for delta in deltas:
        index = delta.get("index")
        if index is None or index >= len(calls):
            call = {k: v for k, v in delta.items() if k != "index"}
            call["function"] = dict(call.get("function") or {})
            call["function"].setdefault("arguments", "")
            calls.append(call)
            continue
        call = calls[index]
        for key in ("id", "type"):
            if delta.get(key):
                call[key] = delta[key]
        fn = delta.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] = fn["name"]
        call["function"]["arguments"] = call["function"].get("arguments", "") + (fn.get("arguments") or "")


class _ResultBuilder:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.outputs: dict[int, CompletionOutput] = {}
        self.usage = Usage(0, 0, 0)
        self.prompt_logprobs: list[dict[str, Any]] | None = None

    def add(self, chunk: Chunk) -> None:
        out = self.outputs.setdefault(chunk.index, CompletionOutput(chunk.index))
        out.text += chunk.text
        if chunk.reasoning:
            out.reasoning_content = (out.reasoning_content or "") + chunk.reasoning
        out.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            out.logprobs = (out.logprobs or []) + chunk.logprobs
        if chunk.tool_calls:
            out.tool_calls = out.tool_calls or []
            merge_tool_calls(out.tool_calls, chunk.tool_calls)
        if chunk.finish_reason is not None:
            out.finish_reason, out.matched_stop = chunk.finish_reason, chunk.matched_stop
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs

    def result(self) -> GenerateResult:
        return GenerateResult(
            self.rid, [self.outputs[i] for i in sorted(self.outputs)], self.usage, self.prompt_logprobs
        )


def _total_timeout(total: Any) -> None:
    """generate()'s total_timeout: None or seconds > 0."""
    if total is not None and (isinstance(total, bool) or not isinstance(total, (int, float)) or not total > 0):
        raise InvalidRequestError(f"total_timeout must be a number of seconds > 0 or None, got {total!r}")


def _generate_message(prompt: Prompt, sampling_params: SamplingParams | None, rid: str | None, **chat: Any) -> Generate:
    """chat: tools, tool_choice, response_format, chat_template_kwargs, parallel_tool_calls (Generate's fields)."""
    rid = rid if rid is not None else uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError("rid must be a non-empty string")
    if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    params = sampling_params.to_dict() if sampling_params is not None else None
    extra = dict(params=params, **chat)
    if isinstance(prompt, str):
        return Generate(rid, prompt=prompt, **extra)
    if isinstance(prompt, (list, tuple)):
        if prompt and all(isinstance(m, dict) for m in prompt):
            return Generate(rid, messages=[dict(m) for m in prompt], **extra)
        return Generate(rid, input_ids=list(prompt), **extra)
    raise InvalidRequestError(
        f"prompt must be a string, a list of token ids or a list of chat messages, got {type(prompt).__name__}"
    )


def _tokenize_message(
    prompt: Any, add_special_tokens: bool, add_generation_prompt: bool, tools: Any, chat_template_kwargs: Any
) -> Tokenize:
    if isinstance(prompt, str):
        return Tokenize(
            uuid.uuid4().hex,
            prompt=prompt,
            add_special_tokens=add_special_tokens,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return Tokenize(
            uuid.uuid4().hex,
            messages=prompt,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
    raise InvalidRequestError("tokenize takes a str prompt or a list of chat messages (dicts)")


def _unexpected(reply: Any) -> ProtocolError:
    return ProtocolError(f"unexpected {type(reply).__name__} reply from the daemon")


def _expect(reply: Any, expected: type[_R]) -> _R:
    """The reply of a one-shot call: an Error reply raises its typed exception, another type ProtocolError."""
    if isinstance(reply, Error):
        raise as_exception(reply)
    if not isinstance(reply, expected):
        raise _unexpected(reply)
    return reply


class _ClientCore:
    """What Client and AsyncClient share: where the daemon is, how to reach it, what a request sends."""

    def __init__(
        self,
        model: str,
        address: str | None,
        auto_start: bool,
        timeout: float | None,
        curve_client_key: Any,
        curve_server_key: Any,
        engine_kwargs: dict[str, Any],
    ) -> None:
        self.model = model
        self.requested_address = address
        self.auto_start = auto_start
        self.timeout = timeout
        self.curve = ClientCurve.resolve(curve_client_key, curve_server_key)
        self.engine_kwargs = engine_kwargs
        self._model_info: dict[str, Any] | None = None

    def _locate(self) -> str:
        from minisgl.runtime.launcher import locate_daemon

        start_timeout = self.timeout if self.timeout is not None else 3600.0
        return locate_daemon(
            self.model,
            self.requested_address,
            auto_start=self.auto_start,
            timeout=start_timeout,
            engine_kwargs=self.engine_kwargs,
            curve=self.curve,
        )

    def _request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None,
        rid: str | None,
        timeout: float | None,
        **chat: Any,
    ) -> tuple[Generate, float | None]:
        """The Generate message of a request and the timeout its replies get."""
        msg = _generate_message(prompt, sampling_params, rid, **chat)
        return msg, self.timeout if timeout is _UNSET else timeout

    def _keep_model_info(self, reply: Any) -> dict[str, Any]:
        self._model_info = dict(_expect(reply, ModelInfoReply).info)
        return dict(self._model_info)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, address={self.address!r})"  # type: ignore[attr-defined]


class _StreamCore(ABC):
    """What Stream and AsyncStream share: how a reply ends, continues or fails the request."""

    rid: str
    _open: bool
    _timeout: float | None  # per reply
    _total: float | None = None  # generate()'s total_timeout: seconds for the whole request
    _deadline: float | None = None  # time.monotonic() by which the request must have ended

    def _limit(self, total: float | None) -> None:
        """The whole request must end within total seconds (checked by _total_timeout) from now; None: no limit."""
        if total is not None:
            self._total, self._deadline = total, time.monotonic() + total

    def _wait(self) -> tuple[float | None, bool]:
        """How long the next reply may take, and whether the request's deadline (not the per-reply timeout) says so."""
        if self._deadline is None:
            return self._timeout, False
        left = max(0.0, self._deadline - time.monotonic())
        if self._timeout is not None and self._timeout < left:
            return self._timeout, False
        return left, True

    @contextmanager
    def _within(self, by_deadline: bool) -> Iterator[None]:
        """A wait that the deadline cut short fails as the request's total_timeout running out."""
        try:
            yield
        except DaemonTimeoutError:
            if by_deadline:
                raise DaemonTimeoutError(
                    f"the request did not finish within its total_timeout of {self._total:g}s"
                ) from None
            raise

    @abstractmethod
    def _end(self) -> None:
        """The request is over (finished or failed in the daemon): stop reading its replies."""

    @abstractmethod
    def _abort(self) -> None:
        """Unless it is over, end the request and ask the daemon to abort it."""

    @contextmanager
    def _aborting(self) -> Iterator[None]:
        """Waiting for a reply: a timeout, a cancellation or any failure aborts the request."""
        try:
            yield
        except DaemonTimeoutError as e:
            self._abort()
            raise DaemonTimeoutError(f"{e}; the request was aborted (raise the timeout for slower requests)") from None
        except BaseException:
            self._abort()
            raise

    def _chunk(self, reply: Any) -> Chunk:
        if isinstance(reply, Error):  # the daemon dropped the request itself
            self._end()
            raise as_exception(reply)
        if not isinstance(reply, Chunk):
            self._abort()
            raise _unexpected(reply)
        if reply.done:
            self._end()
        return reply


class Stream(_StreamCore):
    """Chunks of one request, as they come; close() (or leaving a `with` block / a for loop early) aborts it."""

    def __init__(self, client: "Client", held: _ThreadConnection, rid: str, timeout: float | None) -> None:
        self.rid = rid
        self._client = client
        self._held = held  # keeps the connection open while the stream lives, even past its thread
        self._conn = held.conn
        self._timeout = timeout
        self._open = True

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        if not self._open:
            raise StopIteration
        with self._aborting():
            wait, by_deadline = self._wait()
            with self._within(by_deadline):
                reply = self._conn.next(self.rid, wait)
        return self._chunk(reply)

    def _end(self) -> None:
        self._open = False
        self._conn.forget(self.rid)

    def _abort(self) -> None:
        if self._open:
            self._end()
            self._client.abort(self.rid)

    def close(self) -> None:
        """Abort the request unless it already finished."""
        self._abort()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the client may be closed already at interpreter exit
            pass


def _close_connections(conns: list[SyncConnection], lock: threading.RLock) -> None:
    with lock:
        while conns:
            conns.pop().close()


def _close_connection(conn: SyncConnection, conns: list[SyncConnection], lock: threading.RLock) -> None:
    with lock:
        if conn in conns:  # not closed with the whole Client already
            conns.remove(conn)
            conn.close()


class _ThreadConnection:
    """One thread's connection, closed once the thread has ended (its thread-local slot goes) and no Stream made
    in it is left: a Client shared by short-lived threads holds one socket per live thread, not one per thread
    that ever used it."""

    def __init__(self, conn: SyncConnection, conns: list[SyncConnection], lock: threading.RLock) -> None:
        self.conn = conn
        weakref.finalize(self, _close_connection, conn, conns, lock)


class Client(_ClientCore):
    """A synchronous client of the daemon serving `model`; safe to share between threads.

    model: a model name/path as `minisgl serve --model` takes it. address: ipc:///path or
    tcp://host:port of a daemon (default: the one serving model, found in the registry of the
    user's runtime dir). auto_start: start a daemon (detached `minisgl serve`) when none runs.
    timeout: seconds to wait for start-up and, per request, for each reply (None: no limit).
    curve_client_key / curve_server_key: key files for a CURVE-protected daemon (see
    minisgl.runtime.auth; also $MINISGL_CURVE_CLIENT_KEY / $MINISGL_CURVE_SERVER_KEY).
    engine_kwargs: EngineConfig options a started daemon gets (and a found one must match).
    """

    def __init__(
        self,
        model: str = "smollm2",
        address: str | None = None,
        auto_start: bool = True,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        *,
        curve_client_key: str | None = None,
        curve_server_key: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__(model, address, auto_start, timeout, curve_client_key, curve_server_key, engine_kwargs)
        self.address = self._locate()
        self._ctx = zmq.Context.instance()
        self._local = threading.local()
        self._lock = threading.RLock()  # reentrant: a connection's finalizer may run in a thread that holds it
        self._conns: list[SyncConnection] = []
        self._closed = False
        # A Client dropped without close() (or alive at exit) still closes its sockets.
        self._finalizer = weakref.finalize(self, _close_connections, self._conns, self._lock)

    def _thread_connection(self) -> _ThreadConnection:
        if self._closed:
            raise DaemonError("this Client is closed")
        held = getattr(self._local, "conn", None)
        if held is None:
            with self._lock:
                if self._closed:
                    raise DaemonError("this Client is closed")
                conn = SyncConnection(self._ctx, self.address, self.curve)
                self._conns.append(conn)
            held = self._local.conn = _ThreadConnection(conn, self._conns, self._lock)
        return held

    def _conn(self) -> SyncConnection:
        return self._thread_connection().conn

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        rid: str | None = None,
        timeout: float | None = _UNSET,
    ) -> Stream:
        """Send the request now; iterate the returned Stream (in this thread) for its Chunks."""
        msg, timeout = self._request(
            prompt,
            sampling_params,
            rid,
            timeout,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            chat_template_kwargs=chat_template_kwargs,
            parallel_tool_calls=parallel_tool_calls,
        )
        held = self._thread_connection()
        held.conn.open(msg.rid)
        held.conn.send(msg)
        return Stream(self, held, msg.rid, timeout)

    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        rid: str | None = None,
        timeout: float | None = _UNSET,
        total_timeout: float | None = None,
    ) -> GenerateResult:
        """Run one request to the end. prompt: text, token ids, or chat messages [{"role", "content"}].

        With messages: tools / tool_choice (OpenAI-style; parallel_tool_calls=False: at most one call), response_format,
        and chat_template_kwargs (extra chat-template variables, e.g. {"enable_thinking": False} for Qwen3 models).
        timeout: seconds for each reply (the client's by default); total_timeout: seconds for the whole request, as an
        HTTP client's timeout on a non-streamed completion (None: no limit). Either one running out aborts the
        request and raises DaemonTimeoutError.
        """
        _total_timeout(total_timeout)
        stream = self.stream(
            prompt,
            sampling_params,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            chat_template_kwargs=chat_template_kwargs,
            parallel_tool_calls=parallel_tool_calls,
            rid=rid,
            timeout=timeout,
        )
        stream._limit(total_timeout)
        builder = _ResultBuilder(stream.rid)
        with stream:
            for chunk in stream:
                builder.add(chunk)
        return builder.result()

    def abort(self, rid: str) -> None:
        """Abort a request in flight (from any thread); its stream ends with finish_reason "abort"."""
        if self._closed:
            return  # closing dropped the connection: the daemon aborts its requests itself
        self._conn().send(Abort(rid))

    def _call(self, msg: Any) -> Any:
        conn = self._conn()
        conn.open(msg.rid)
        try:
            conn.send(msg)
            return conn.next(msg.rid, self.timeout)
        finally:
            conn.forget(msg.rid)

    def model_info(self) -> dict[str, Any]:
        """name, path, architecture, context_length, eos_token_ids, vocab_size, dtype, device, tp, page_size, ..."""
        if self._model_info is None:
            return self._keep_model_info(self._call(GetModelInfo(uuid.uuid4().hex)))
        return dict(self._model_info)

    def stats(self) -> dict[str, Any]:
        """The daemon's counters: total/free/cached/req pages, waiting/running/inflight requests, uptime."""
        return dict(_expect(self._call(GetStats(uuid.uuid4().hex)), StatsReply).stats)

    def embed(
        self, inputs: Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]], *, timeout: float | None = _UNSET
    ) -> list[Embedding]:
        """Embeddings of texts or token-id lists (one per input, in order; all sent at once): each prompt's last
        hidden state after the final norm, L2-normalised (last-token pooling, as vLLM pools decoder models).
        The prefix cache serves them too."""
        msgs, held = _embed_messages(inputs), self._thread_connection()
        timeout = self.timeout if timeout is _UNSET else timeout
        streams = []
        try:
            for msg in msgs:
                held.conn.open(msg.rid)
                held.conn.send(msg)
                streams.append(Stream(self, held, msg.rid, timeout))
            out = []
            for stream in streams:
                with stream:
                    out.append(_embedding(list(stream)))
            return out
        finally:
            for stream in streams:
                stream.close()

    def flush_cache(self) -> dict[str, Any]:
        """Forget every cached prefix no running request holds (e.g. before a benchmark); the stats after it."""
        return dict(_expect(self._call(FlushCache(uuid.uuid4().hex)), StatsReply).stats)

    def tokenize(
        self,
        prompt: str | list[dict[str, Any]],
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids generate() would give the model for this prompt (str) or conversation (list of
        messages, rendered with the chat template). add_special_tokens: a str prompt's BOS;
        add_generation_prompt: a conversation's closing assistant header."""
        msg = _tokenize_message(prompt, add_special_tokens, add_generation_prompt, tools, chat_template_kwargs)
        return list(_expect(self._call(msg), TokenizeReply).input_ids)

    def detokenize(self, input_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of token ids (special tokens kept unless skip_special_tokens)."""
        msg = Detokenize(uuid.uuid4().hex, list(input_ids), skip_special_tokens)
        return _expect(self._call(msg), DetokenizeReply).text

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncStream(_StreamCore):
    """Chunks of one request; the request is sent on the first step. aclose(), leaving an
    `async with` block or cancelling the task that iterates it aborts the request."""

    def __init__(self, client: "AsyncClient", msg: Generate, timeout: float | None) -> None:
        self.rid = msg.rid
        self._client = client
        self._msg = msg
        self._timeout = timeout
        self._conn: AsyncConnection | None = None
        self._open = True

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> Chunk:
        if not self._open:
            raise StopAsyncIteration
        if self._conn is None:
            try:
                conn = await self._client._connection()
                await conn.open(self.rid)
            except BaseException:  # nothing was sent; a refused rid (in flight already) is another request's
                self._open = False
                raise
            self._conn = conn
            with self._aborting():
                conn.send(self._msg)
        with self._aborting():
            wait, by_deadline = self._wait()
            with self._within(by_deadline):
                reply = await self._conn.next(self.rid, wait)
        return self._chunk(reply)

    def _end(self) -> None:
        self._open = False
        if self._conn is not None:
            self._conn.forget(self.rid)

    def _abort(self) -> None:
        if self._open:
            self._end()
            if self._conn is not None:
                self._conn.send(Abort(self.rid))

    async def aclose(self) -> None:
        self._abort()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._abort()

    def __del__(self) -> None:
        try:
            self._abort()
        except Exception:  # noqa: BLE001 - the socket may be closed already
            pass


class AsyncClient(_ClientCore):
    """The asyncio client (zmq.asyncio): one socket and one reader task serve any number of
    concurrent requests. Same arguments as Client; connects (finding or starting the daemon) on
    `async with` or on first use, and belongs to the event loop it connected in."""

    def __init__(
        self,
        model: str = "smollm2",
        address: str | None = None,
        auto_start: bool = True,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        *,
        curve_client_key: str | None = None,
        curve_server_key: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__(model, address, auto_start, timeout, curve_client_key, curve_server_key, engine_kwargs)
        self.address: str | None = None
        self._conn: AsyncConnection | None = None
        self._connecting: asyncio.Future | None = None

    async def connect(self) -> "AsyncClient":
        await self._connection()
        return self

    async def _connection(self) -> AsyncConnection:
        if self._conn is None:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(self._open())
            await asyncio.shield(self._connecting)
        assert self._conn is not None
        return self._conn

    async def _open(self) -> None:
        try:
            # Finding or starting the daemon blocks (file locks, a subprocess); the requests do not.
            self.address = await asyncio.to_thread(self._locate)
            self._conn = AsyncConnection(self.address, self.curve)
        finally:
            if self._conn is None:
                self._connecting = None

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        rid: str | None = None,
        timeout: float | None = _UNSET,
    ) -> AsyncStream:
        """`async for chunk in client.stream(...)`; arguments as Client.stream."""
        return AsyncStream(
            self,
            *self._request(
                prompt,
                sampling_params,
                rid,
                timeout,
                tools=tools,
                tool_choice=tool_choice,
                response_format=response_format,
                chat_template_kwargs=chat_template_kwargs,
                parallel_tool_calls=parallel_tool_calls,
            ),
        )

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        rid: str | None = None,
        timeout: float | None = _UNSET,
        total_timeout: float | None = None,
    ) -> GenerateResult:
        """As Client.generate."""
        _total_timeout(total_timeout)
        stream = self.stream(
            prompt,
            sampling_params,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            chat_template_kwargs=chat_template_kwargs,
            parallel_tool_calls=parallel_tool_calls,
            rid=rid,
            timeout=timeout,
        )
        stream._limit(total_timeout)
        builder = _ResultBuilder(stream.rid)
        async with stream:
            async for chunk in stream:
                builder.add(chunk)
        return builder.result()

    async def abort(self, rid: str) -> None:
        (await self._connection()).send(Abort(rid))

    async def _call(self, msg: Any) -> Any:
        conn = await self._connection()
        await conn.open(msg.rid)
        try:
            conn.send(msg)
            return await conn.next(msg.rid, self.timeout)
        finally:
            conn.forget(msg.rid)

    async def model_info(self) -> dict[str, Any]:
        if self._model_info is None:
            return self._keep_model_info(await self._call(GetModelInfo(uuid.uuid4().hex)))
        return dict(self._model_info)

    async def stats(self) -> dict[str, Any]:
        return dict(_expect(await self._call(GetStats(uuid.uuid4().hex)), StatsReply).stats)

    async def embed(
        self, inputs: Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]], *, timeout: float | None = _UNSET
    ) -> list[Embedding]:
        """As Client.embed."""
        timeout = self.timeout if timeout is _UNSET else timeout

        async def one(msg: Generate) -> Embedding:
            async with AsyncStream(self, msg, timeout) as stream:
                return _embedding([chunk async for chunk in stream])

        return list(await asyncio.gather(*(one(m) for m in _embed_messages(inputs))))

    async def flush_cache(self) -> dict[str, Any]:
        """As Client.flush_cache."""
        return dict(_expect(await self._call(FlushCache(uuid.uuid4().hex)), StatsReply).stats)

    async def tokenize(
        self,
        prompt: str | list[dict[str, Any]],
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """As Client.tokenize."""
        msg = _tokenize_message(prompt, add_special_tokens, add_generation_prompt, tools, chat_template_kwargs)
        return list(_expect(await self._call(msg), TokenizeReply).input_ids)

    async def detokenize(self, input_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """As Client.detokenize."""
        msg = Detokenize(uuid.uuid4().hex, list(input_ids), skip_special_tokens)
        return (_expect(await self._call(msg), DetokenizeReply)).text

    async def close(self) -> None:
        conn, self._conn, self._connecting = self._conn, None, None
        if conn is not None:
            await conn.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

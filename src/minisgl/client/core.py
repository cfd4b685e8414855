"""What Client and AsyncClient share, free of I/O: the messages a request sends, how its replies fold into a
result, and each request method written once as a generator that yields what to do (send a message and wait
for its reply, send one and go on, read whole streams) and gets the outcome back. client/sync.py and
client/aio.py drive those generators with blocking and with asyncio sockets.
"""

from __future__ import annotations

import functools
import time
import uuid
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import (
    Any,
    Callable,
    Concatenate,
    Generator,
    Generic,
    Iterator,
    NamedTuple,
    ParamSpec,
    Sequence,
    TypeVar,
    Union,
)

from minisgl.client.results import Embedding, GenerateResult, ResultBuilder, embedding_of
from minisgl.core import SamplingParams
from minisgl.errors import DaemonTimeoutError, InvalidRequestError
from minisgl.runtime.auth import ClientCurve
from minisgl.runtime.connection import as_exception
from minisgl.runtime.launcher import locate_daemon
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
    Message,
    ModelInfoReply,
    ProtocolError,
    StatsReply,
    Tokenize,
    TokenizeReply,
)

Prompt = Union[str, Sequence[int], Sequence[dict[str, Any]]]
EmbedInputs = Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]]
DEFAULT_TIMEOUT_S = 300.0
UNSET: Any = object()
_R = TypeVar("_R")
_P = ParamSpec("_P")
_S = TypeVar("_S")  # the client's stream type


def _embed_messages(inputs: EmbedInputs) -> list[Generate]:
    """One Generate(embed=True) per input: a text, a list of token ids, or a list of those."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]  # type: ignore[list-item]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidRequestError("embed takes a text, a list of token ids, or a non-empty list of those")
    msgs = []
    for item in inputs:
        if isinstance(item, str):
            msgs.append(Generate(new_rid(), prompt=item, embed=True))
        elif isinstance(item, (list, tuple)):
            msgs.append(Generate(new_rid(), input_ids=list(item), embed=True))
        else:
            raise InvalidRequestError(f"an input to embed is a text or a list of token ids, got {type(item).__name__}")
    return msgs


def _total_timeout(total: Any) -> None:
    """generate()'s total_timeout: None or seconds > 0."""
    if total is not None and (isinstance(total, bool) or not isinstance(total, (int, float)) or not total > 0):
        raise InvalidRequestError(f"total_timeout must be a number of seconds > 0 or None, got {total!r}")


def _generate_message(prompt: Prompt, sampling_params: SamplingParams | None, rid: str | None, **chat: Any) -> Generate:
    """chat: tools, tool_choice, response_format, chat_template_kwargs, parallel_tool_calls (Generate's fields)."""
    rid = rid if rid is not None else new_rid()
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
            new_rid(),
            prompt=prompt,
            add_special_tokens=add_special_tokens,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return Tokenize(
            new_rid(),
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


class Call(NamedTuple):
    """Send msg, wait for its one reply (within the client's timeout) and hand the reply back."""

    msg: Message


class Send(NamedTuple):
    """Send msg and go on (an Abort)."""

    msg: Message


class Read(NamedTuple):
    """Send every request, read each stream to its end and hand back the chunks of each, in order; a failure or a
    timeout aborts them. timeout: per reply; total: for each whole request (None: no limit)."""

    msgs: list[Generate]
    timeout: float | None
    total: float | None = None


Effect = Union[Call, Send, Read]
Op = Generator[Effect, Any, _R]


def run_blocking(op: Callable[Concatenate[Any, _P], Op[_R]]) -> Callable[Concatenate[Any, _P], _R]:
    """The blocking method of a request method: each effect done by the client's `_do`."""

    @functools.wraps(op)
    def method(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        steps, reply = op(self, *args, **kwargs), None
        try:
            while True:
                reply = self._do(steps.send(reply))
        except StopIteration as done:
            return done.value

    return method


def run_async(op: Callable[Concatenate[Any, _P], Op[_R]]) -> Callable[Concatenate[Any, _P], Any]:
    """The coroutine method of a request method: each effect awaited on the client's `_do`."""

    @functools.wraps(op)
    async def method(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        steps, reply = op(self, *args, **kwargs), None
        try:
            while True:
                reply = await self._do(steps.send(reply))
        except StopIteration as done:
            return done.value

    return method


def new_rid() -> str:
    return uuid.uuid4().hex


class ClientCore(ABC, Generic[_S]):
    """What Client and AsyncClient share: where the daemon is, how to reach it, what a request sends."""

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
        self.model = model
        self.requested_address = address
        self.auto_start = auto_start
        self.timeout = timeout
        self.curve = ClientCurve.resolve(curve_client_key, curve_server_key)
        self.engine_kwargs = engine_kwargs
        self._model_info: dict[str, Any] | None = None
        self._init_transport()

    @abstractmethod
    def _init_transport(self) -> None:
        """Set up the sockets' state (a Client also finds or starts its daemon here; an AsyncClient on connect)."""

    def _locate(self) -> str:
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
        return msg, self.timeout if timeout is UNSET else timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, address={self.address!r})"  # type: ignore[attr-defined]

    @abstractmethod
    def _open_stream(self, msg: Generate, timeout: float | None) -> _S:
        """The client's stream of a request (a Stream sends it now, an AsyncStream on its first step)."""

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
        timeout: float | None = UNSET,
    ) -> _S:
        """Send the request; iterate the returned stream (`for` on a Client's Stream, in the thread that made it;
        `async for` on an AsyncClient's AsyncStream, which sends on its first step) for its Chunks."""
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
        return self._open_stream(msg, timeout)


class Requests:
    """The request methods, each written once as an Op over a client (ClientCore); Client and AsyncClient take
    them through run_blocking and run_async."""

    def generate(
        self: ClientCore,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        rid: str | None = None,
        timeout: float | None = UNSET,
        total_timeout: float | None = None,
    ) -> Op[GenerateResult]:
        """Run one request to the end. prompt: text, token ids, or chat messages [{"role", "content"}].

        With messages: tools / tool_choice (OpenAI-style; parallel_tool_calls=False: at most one call), response_format,
        and chat_template_kwargs (extra chat-template variables, e.g. {"enable_thinking": False} for Qwen3 models).
        timeout: seconds for each reply (the client's by default); total_timeout: seconds for the whole request, as an
        HTTP client's timeout on a non-streamed completion (None: no limit). Either one running out aborts the
        request and raises DaemonTimeoutError.
        """
        _total_timeout(total_timeout)
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
        (chunks,) = yield Read([msg], timeout, total_timeout)
        builder = ResultBuilder(msg.rid)
        for chunk in chunks:
            builder.add(chunk)
        return builder.result()

    def embed(self: ClientCore, inputs: EmbedInputs, *, timeout: float | None = UNSET) -> Op[list[Embedding]]:
        """Embeddings of texts or token-id lists (one per input, in order; all sent at once): each prompt's last
        hidden state after the final norm, L2-normalised (last-token pooling, as vLLM pools decoder models).
        The prefix cache serves them too."""
        msgs = _embed_messages(inputs)
        streams = yield Read(msgs, self.timeout if timeout is UNSET else timeout)
        return [embedding_of(chunks) for chunks in streams]

    def abort(self: ClientCore, rid: str) -> Op[None]:
        """Abort a request in flight (from any thread); its stream ends with finish_reason "abort"."""
        yield Send(Abort(rid))

    def model_info(self: ClientCore) -> Op[dict[str, Any]]:
        """name, path, architecture, context_length, eos_token_ids, vocab_size, dtype, device, tp, page_size, ..."""
        if self._model_info is None:
            self._model_info = dict(_expect((yield Call(GetModelInfo(new_rid()))), ModelInfoReply).info)
        return dict(self._model_info)

    def stats(self: ClientCore) -> Op[dict[str, Any]]:
        """The daemon's counters: total/free/cached/req pages, waiting/running/inflight requests, uptime."""
        return dict(_expect((yield Call(GetStats(new_rid()))), StatsReply).stats)

    def flush_cache(self: ClientCore) -> Op[dict[str, Any]]:
        """Forget every cached prefix no running request holds (e.g. before a benchmark); the stats after it."""
        return dict(_expect((yield Call(FlushCache(new_rid()))), StatsReply).stats)

    def tokenize(
        self: ClientCore,
        prompt: str | list[dict[str, Any]],
        *,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Op[list[int]]:
        """The token ids generate() would give the model for this prompt (str) or conversation (list of
        messages, rendered with the chat template). add_special_tokens: a str prompt's BOS;
        add_generation_prompt: a conversation's closing assistant header."""
        msg = _tokenize_message(prompt, add_special_tokens, add_generation_prompt, tools, chat_template_kwargs)
        return list(_expect((yield Call(msg)), TokenizeReply).input_ids)

    def detokenize(self: ClientCore, input_ids: Sequence[int], *, skip_special_tokens: bool = False) -> Op[str]:
        """The text of token ids (special tokens kept unless skip_special_tokens)."""
        msg = Detokenize(new_rid(), list(input_ids), skip_special_tokens)
        return _expect((yield Call(msg)), DetokenizeReply).text


class StreamCore(ABC):
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

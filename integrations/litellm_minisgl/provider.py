"""MiniSGLLLM: the LiteLLM CustomLLM that serves "minisgl/<model>" from a minisgl daemon.

`api_base` is the daemon's address (ipc:///path or tcp://host:port); without it the client finds
the daemon serving <model> or starts one. Every request first pings its daemon (well under a
millisecond when it is up), so a daemon that is gone fails the request (ServiceUnavailableError)
within seconds instead of leaving it queued on a dead socket until the request timeout.

Streams are validated and connected before their first chunk is handed to LiteLLM: a bad
request or an unreachable daemon raises from the call (sync) or from the first step of the
iterator (async, before any byte reaches a proxy client), never in the middle of a stream.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterator

import httpx
import openai
from litellm import CustomLLM
from litellm.types.utils import EmbeddingResponse, GenericStreamingChunk, ModelResponse, Usage

from litellm_minisgl.translate import Request, build_request, litellm_error, stream_chunks, to_model_response
from minisgl import (
    PING_TIMEOUT_S,
    AsyncClient,
    Client,
    DaemonNotRunningError,
    InvalidRequestError,
    SamplingParams,
    ping,
)

START_TIMEOUT_S = 600.0  # finding or starting a daemon (an auto-started one loads its model first)


def _seconds(timeout: float | httpx.Timeout | None) -> float | None:
    """LiteLLM's timeout (seconds or an httpx.Timeout) in seconds: a stream's limit per chunk, and a non-streamed
    completion's for the whole request (as LiteLLM's OpenAI provider, whose HTTP client waits that long for the
    response)."""
    if isinstance(timeout, httpx.Timeout):
        parts = [t for t in (timeout.read, timeout.connect, timeout.write, timeout.pool) if t is not None]
        return max(parts) if parts else None
    return float(timeout) if timeout is not None else None


def _unreachable(address: str) -> DaemonNotRunningError:
    return DaemonNotRunningError(
        f"no minisgl daemon answers at {address}: start one with `minisgl serve --address {address}` "
        "(or leave api_base unset to find or start the daemon for the model)"
    )


class Daemons:
    """The clients of the daemons this process talks to, keyed by (model, address).

    One sync Client per key (it is thread-safe) and one AsyncClient per key and event loop (an
    AsyncClient belongs to the loop it connected in). A client whose daemon stopped answering is
    dropped, so the next request finds (or, without an address, starts) a daemon again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sync: dict[tuple[str, str | None], Client] = {}
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str | None], AsyncClient]]
        self._async = weakref.WeakKeyDictionary()

    def client(self, model: str, address: str | None, timeout: float | None) -> Client:
        key = (model, address)
        with self._lock:
            c = self._sync.get(key)
        if c is not None:
            if self._alive(c.address, timeout):
                return c
            self.forget(key, c)
            if address is not None:
                raise _unreachable(address)
            # Without an address: find or start the model's daemon again.
        try:
            c = Client(model=model, address=address, auto_start=address is None, timeout=START_TIMEOUT_S)
        except DaemonNotRunningError as e:
            raise _unreachable(address) if address is not None else e from None
        with self._lock:
            return self._sync.setdefault(key, c)

    async def aclient(self, model: str, address: str | None, timeout: float | None) -> AsyncClient:
        clients = self._async.setdefault(asyncio.get_running_loop(), {})
        key = (model, address)
        c = clients.get(key)
        if c is not None:
            await c.connect()
            if await asyncio.to_thread(self._alive, c.address, timeout):
                return c
            if clients.get(key) is c:  # left open: requests sharing it may still be reading its failures
                del clients[key]
            if address is not None:
                raise _unreachable(address)
        c = clients[key] = AsyncClient(
            model=model, address=address, auto_start=address is None, timeout=START_TIMEOUT_S
        )
        try:
            await c.connect()  # finds (pinging it) or starts the daemon
        except BaseException as e:
            if clients.get(key) is c:
                del clients[key]
            await c.close()
            if isinstance(e, DaemonNotRunningError) and address is not None:
                raise _unreachable(address) from None
            raise
        return c

    def _alive(self, address: str | None, timeout: float | None) -> bool:
        wait = PING_TIMEOUT_S if timeout is None else max(0.1, min(PING_TIMEOUT_S, timeout))
        pong = ping(address, wait) if address else None
        return pong is not None and pong.state != "stopping"

    def forget(self, key: tuple[str, str | None], c: Client) -> None:
        # Not closed here: other threads may still be reading a failure from it; its sockets go with it.
        with self._lock:
            if self._sync.get(key) is c:
                del self._sync[key]

    def close(self) -> None:
        """Close the sync clients (async ones go with their event loop)."""
        with self._lock:
            clients, self._sync = list(self._sync.values()), {}
        for c in clients:
            c.close()


@contextmanager
def _litellm_errors(model: str) -> Iterator[None]:
    """Every failure leaves as a LiteLLM exception (LiteLLM's own, which derive from OpenAI's, pass)."""
    try:
        yield
    except openai.OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001
        raise litellm_error(e, model) from e


class MiniSGLLLM(CustomLLM):
    """LiteLLM provider "minisgl": chat completions (plain and streamed, sync and async) from minisgl daemons.

    LiteLLM calls the four methods with the same keyword arguments; model is the part after "minisgl/". Each
    method names those it uses (LiteLLM's others, such as its logging object and print_verbose, land in _litellm).
    """

    def __init__(self) -> None:
        super().__init__()
        self.daemons = Daemons()

    def _prepare(
        self, model: str, messages: list, api_base: str | None, optional_params: dict, timeout: Any, stream: bool
    ) -> tuple[Client, Request, SamplingParams]:
        request = build_request(messages, optional_params, stream=stream)
        client = self.daemons.client(model, api_base or None, _seconds(timeout))
        return client, request, request.sampling_params()

    async def _aprepare(
        self, model: str, messages: list, api_base: str | None, optional_params: dict, timeout: Any, stream: bool
    ) -> tuple[AsyncClient, Request, SamplingParams]:
        request = build_request(messages, optional_params, stream=stream)
        client = await self.daemons.aclient(model, api_base or None, _seconds(timeout))
        return client, request, request.sampling_params()

    # ------------------------------------------------------------------ sync

    def completion(
        self,
        model: str,
        messages: list,
        model_response: ModelResponse,
        optional_params: dict,
        api_base: str | None = None,
        timeout: Any = None,
        **_litellm: Any,
    ) -> ModelResponse:
        with _litellm_errors(model):
            c, request, params = self._prepare(model, messages, api_base, optional_params, timeout, stream=False)
            result = c.generate(
                request.messages,
                params,
                timeout=_seconds(timeout),
                total_timeout=_seconds(timeout),
                **request.generate_kwargs(),
            )
        return to_model_response(result, model_response, model)

    def streaming(
        self,
        model: str,
        messages: list,
        model_response: ModelResponse,
        optional_params: dict,
        api_base: str | None = None,
        timeout: Any = None,
        **_litellm: Any,
    ) -> Iterator[GenericStreamingChunk]:
        # Not a generator itself: the request is validated, sent and its first chunk awaited here.
        with _litellm_errors(model):
            c, request, params = self._prepare(model, messages, api_base, optional_params, timeout, stream=True)
            stream = c.stream(request.messages, params, timeout=_seconds(timeout), **request.generate_kwargs())
            first = next(stream)
        return self._chunks(first, stream, model)

    @staticmethod
    def _chunks(first: Any, stream: Any, model: str) -> Iterator[GenericStreamingChunk]:
        with _litellm_errors(model):
            try:
                for chunk in itertools.chain([first], stream):
                    yield from stream_chunks(chunk)
            finally:
                stream.close()  # aborts the request in the daemon if the caller stopped early

    def embedding(
        self,
        model: str,
        input: list,
        model_response: EmbeddingResponse,
        optional_params: dict,
        api_base: str | None = None,
        timeout: Any = None,
        **_litellm: Any,
    ) -> EmbeddingResponse:
        """litellm.embedding(model="minisgl/<model>", input=[...]): Client.embed (last-token pooled, normalised)."""
        with _litellm_errors(model):
            inputs = _embedding_inputs(input, optional_params)
            out = self.daemons.client(model, api_base or None, _seconds(timeout)).embed(
                inputs, timeout=_seconds(timeout)
            )
        return _embedding_response(out, model_response, model)

    # ------------------------------------------------------------------ async

    async def acompletion(
        self,
        model: str,
        messages: list,
        model_response: ModelResponse,
        optional_params: dict,
        api_base: str | None = None,
        timeout: Any = None,
        **_litellm: Any,
    ) -> ModelResponse:
        with _litellm_errors(model):
            c, request, params = await self._aprepare(model, messages, api_base, optional_params, timeout, False)
            result = await c.generate(
                request.messages,
                params,
                timeout=_seconds(timeout),
                total_timeout=_seconds(timeout),
                **request.generate_kwargs(),
            )
        return to_model_response(result, model_response, model)

    async def astreaming(
        self,
        model: str,
        messages: list,
        model_response: ModelResponse,
        optional_params: dict,
        api_base: str | None = None,
        timeout: Any = None,
        **_litellm: Any,
    ) -> AsyncIterator[GenericStreamingChunk]:
        # Everything that can fail on the request's account happens before the first yield.
        with _litellm_errors(model):
            c, request, params = await self._aprepare(model, messages, api_base, optional_params, timeout, True)
            stream = c.stream(request.messages, params, timeout=_seconds(timeout), **request.generate_kwargs())
            try:
                first = await stream.__anext__()
                for generic in stream_chunks(first):
                    yield generic
                async for chunk in stream:
                    for generic in stream_chunks(chunk):
                        yield generic
            finally:
                await stream.aclose()  # aborts the request in the daemon if the caller stopped early

    async def aembedding(
        self,
        model: str,
        input: list,
        model_response: EmbeddingResponse,
        optional_params: dict,
        api_base: str | None = None,
        timeout: Any = None,
        **_litellm: Any,
    ) -> EmbeddingResponse:
        with _litellm_errors(model):
            inputs = _embedding_inputs(input, optional_params)
            client = await self.daemons.aclient(model, api_base or None, _seconds(timeout))
            out = await client.embed(inputs, timeout=_seconds(timeout))
        return _embedding_response(out, model_response, model)


def _embedding_inputs(input: Any, optional_params: dict) -> list[Any]:
    if optional_params.get("dimensions") is not None:
        raise InvalidRequestError("dimensions is not supported: the embedding has the model's hidden size")
    if isinstance(input, str):
        return [input]
    return list(input)


def _embedding_response(out: list[Any], response: EmbeddingResponse, model: str) -> EmbeddingResponse:
    response.model = model
    response.data = [{"object": "embedding", "index": i, "embedding": e.embedding} for i, e in enumerate(out)]
    tokens = sum(e.prompt_tokens for e in out)
    response.usage = Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)
    return response

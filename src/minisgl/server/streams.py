"""Client streams under an HTTP request, for every router of the server (OpenAI's, Ollama's, SGLang's):
the first item read before any byte is sent, a streamed answer's events written by one loop (StreamWriter,
streamed_response), closing that aborts the request even while cancelled, several streams merged, several
requests gathered, a watch that cancels work whose HTTP client went away; and the JSON-object body the
hand-parsed routes read."""

from __future__ import annotations

import abc
import asyncio
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from minisgl.errors import InvalidRequestError
from minisgl.server.metrics import RequestTimer
from minisgl.server.state import ClientDisconnected, api_error, sse_response

_T = TypeVar("_T")


async def json_object(request: Request) -> dict[str, Any]:
    """The request's body, which must be a JSON object (InvalidRequestError otherwise: a 400)."""
    try:
        body = await request.json()
    except ValueError:
        raise InvalidRequestError("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return body


async def first_item(stream: AsyncIterator[_T]) -> tuple[_T | None, bool]:
    """The first item of a stream and whether the stream is already over, read before any byte is
    sent so that a failing request gets an HTTP error status; on error the stream is closed."""
    try:
        return await stream.__anext__(), False
    except StopAsyncIteration:
        return None, True
    except BaseException:
        await close_stream(stream)
        raise


class StreamWriter(abc.ABC):
    """What one API writes of a streamed answer, item by item; stream_events drives it and owns the rest (the
    metrics' status and timing, errors after the first byte, closing the stream)."""

    media_type = "text/event-stream"  # SSE; Ollama streams NDJSON lines
    trailer = ""  # written after the end or an error event (OpenAI's "data: [DONE]"), not when the client left

    def start(self) -> list[str]:
        """Events before the first item (the Responses API's created and in_progress)."""
        return []

    @abc.abstractmethod
    async def item(self, item: Any) -> list[str]:
        """The events of one item of the stream (a Chunk, or (stream index, Chunk) of merged streams)."""

    def end(self) -> list[str]:
        """Events after the last item (a usage chunk, the final response, SGLang's [DONE])."""
        return []

    @abc.abstractmethod
    def error(self, e: BaseException) -> str:
        """The event that carries an error met after the first byte."""

    def tokens(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens of the answer so far, for the request's metrics."""
        return 0, 0, 0


async def streamed_response(
    stream: AsyncIterator[Any], writer: StreamWriter, timer: RequestTimer | None = None
) -> StreamingResponse:
    """A streamed answer: its first item is read before any byte is sent (an error then is raised here, to be an
    HTTP error status), then the writer's events go out as they come (stream_events)."""
    first, _ = await first_item(stream)
    events = stream_events(first, stream, writer, timer)
    if writer.media_type == "text/event-stream":
        return sse_response(events)
    return StreamingResponse(events, media_type=writer.media_type)


async def stream_events(
    first: Any, stream: AsyncIterator[Any], writer: StreamWriter, timer: RequestTimer | None
) -> AsyncIterator[str]:
    """The writer's events for `first` (None: the stream was empty) and the rest of the stream. An error travels
    as the writer's error event and counts in the metrics with its HTTP status; a client that went away counts
    as 499; the stream is closed (its request aborted) whatever happens."""
    status = 200
    try:
        for event in writer.start():
            yield event
        item = first
        while item is not None:
            if timer is not None:
                timer.first_token()
            for event in await writer.item(item):
                yield event
            item = await anext(stream, None)
        for event in writer.end():
            yield event
    except Exception as e:  # noqa: BLE001 - after the first byte an error can only travel in the stream
        status = api_error(e).status
        yield writer.error(e)
    except BaseException:
        status = 499  # the HTTP client went away: closing the stream below aborts the request
        raise
    finally:
        await close_stream(stream)
        if timer is not None:
            timer.done(status, *writer.tokens())
    if writer.trailer:
        yield writer.trailer


async def close_stream(stream: Any) -> None:
    """Close a client stream (which aborts its request), even while being cancelled."""
    with anyio.CancelScope(shield=True):
        await stream.aclose()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Await work; if the HTTP client disconnects first, cancel it (the Client aborts the request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several streams as (stream index, item); an error in any one ends them all."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await close_stream(streams[0])
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None, False))
            await queue.put((i, None, None, True))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, None, e, True))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item, error, finished = await queue.get()
            if error is not None:
                raise error
            if finished:
                live -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await close_stream(s)


async def gather_all(works: list[Awaitable[_T]]) -> list[_T]:
    """All results, in order; the first failure cancels the rest (whose requests the Client aborts)."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)

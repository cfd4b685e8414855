"""Client streams under an HTTP request, for every router of the server (OpenAI's, Ollama's, SGLang's):
the first item read before any byte is sent, closing that aborts the request even while cancelled,
several streams merged, several requests gathered, a watch that cancels work whose HTTP client went
away; and the JSON-object body the hand-parsed routes read."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
from fastapi import Request

from minisgl.errors import InvalidRequestError

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


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


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

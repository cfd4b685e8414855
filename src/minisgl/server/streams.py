"""Client streams under an HTTP request, for every router of the server (OpenAI's and Ollama's):
the first item read before any byte is sent, closing that aborts the request even while cancelled,
and a watch that cancels work whose HTTP client went away."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
from fastapi import Request

_T = TypeVar("_T")


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

"""The asyncio AsyncClient: one socket and one reader task for any number of concurrent requests, each request
method an awaited drive of its Op."""

from __future__ import annotations

import asyncio
from typing import Any

from minisgl.client.core import (
    Call,
    ClientCore,
    Effect,
    Read,
    Requests,
    Send,
    StreamCore,
    run_async,
)
from minisgl.runtime.connection import AsyncConnection
from minisgl.runtime.protocol import Abort, Chunk, Generate


class AsyncStream(StreamCore):
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


class AsyncClient(ClientCore[AsyncStream]):
    """The asyncio client (zmq.asyncio): one socket and one reader task serve any number of
    concurrent requests. Same arguments as Client; connects (finding or starting the daemon) on
    `async with` or on first use, and belongs to the event loop it connected in."""

    def _init_transport(self) -> None:
        self.address: str | None = None
        self._conn: AsyncConnection | None = None
        self._connecting: asyncio.Future | None = None

    generate = run_async(Requests.generate)
    embed = run_async(Requests.embed)
    abort = run_async(Requests.abort)
    model_info = run_async(Requests.model_info)
    stats = run_async(Requests.stats)
    flush_cache = run_async(Requests.flush_cache)
    tokenize = run_async(Requests.tokenize)
    detokenize = run_async(Requests.detokenize)

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

    def _open_stream(self, msg: Generate, timeout: float | None) -> AsyncStream:
        return AsyncStream(self, msg, timeout)

    async def _do(self, effect: Effect) -> Any:
        if isinstance(effect, Call):
            conn = await self._connection()
            await conn.open(effect.msg.rid)
            try:
                conn.send(effect.msg)
                return await conn.next(effect.msg.rid, self.timeout)
            finally:
                conn.forget(effect.msg.rid)
        if isinstance(effect, Send):
            (await self._connection()).send(effect.msg)
            return None
        return await self._read(effect)

    async def _read(self, effect: Read) -> list[list[Chunk]]:
        """Every stream read concurrently to its end; a failure cancels the others (which aborts them)."""

        async def one(msg: Generate) -> list[Chunk]:
            async with AsyncStream(self, msg, effect.timeout) as stream:
                stream._limit(effect.total)
                return [chunk async for chunk in stream]

        if len(effect.msgs) == 1:
            return [await one(effect.msgs[0])]
        return list(await asyncio.gather(*(one(m) for m in effect.msgs)))

    async def close(self) -> None:
        conn, self._conn, self._connecting = self._conn, None, None
        if conn is not None:
            await conn.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

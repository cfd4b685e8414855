"""What every router of the HTTP server shares: the app's state (the daemon client, model facts, metrics), the
API-key check, and the HTTP form of errors (OpenAI's {"error": {...}} body with a status).

Routers reach the state through `request.app.state.server` (`server_of`); nothing is captured in closures, so a
route module needs only its router and the app that includes it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, AsyncIterator, Callable, NamedTuple, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl.client import AsyncClient
from minisgl.errors import (
    DaemonError,
    InvalidRequestError,
    MiniSGLError,
    OutOfMemoryError,
    PromptTooLongError,
    RequestAbortedError,
    UnknownModelError,
)
from minisgl.server.metrics import RequestTimer, ServerMetrics
from minisgl.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("minisgl.server")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


class APIError(Exception):
    """An error with its HTTP status and OpenAI error type/code."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


def api_error(e: BaseException) -> APIError:
    """The HTTP form of an exception: 400 for bad requests, 503 when the daemon is unreachable, else 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):
        return APIError(400, str(e), "invalid_request_error", "context_length_exceeded")
    if isinstance(e, (InvalidRequestError, OutOfMemoryError)):
        return APIError(400, str(e), "invalid_request_error", type(e).__name__)
    if isinstance(e, UnknownModelError):
        return APIError(404, str(e), "invalid_request_error", "model_not_found", "model")
    if isinstance(e, DaemonError):
        return APIError(503, f"the minisgl daemon is unavailable: {e}", "service_unavailable", type(e).__name__)
    if isinstance(e, RequestAbortedError):
        return APIError(503, f"the request was aborted: {e}", "service_unavailable", type(e).__name__)
    logger.exception("internal error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error", type(e).__name__)


def fail(timer: RequestTimer, e: BaseException) -> Response:
    """The answer to a request that failed before its first byte (cancellation is re-raised, not answered)."""
    if isinstance(e, ClientDisconnected):
        timer.done(499)
        return Response(status_code=499)
    if not isinstance(e, Exception):  # cancellation and the like are not ours to answer
        timer.done(499)
        raise e
    err = api_error(e)
    timer.done(err.status)
    return err.response()


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event of a JSON payload (or of a literal such as "[DONE]")."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def error_event(e: BaseException) -> str:
    """An error after the first streamed byte: an SSE event with OpenAI's error body."""
    err = api_error(e)
    info = ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code or err.status)
    return sse(ErrorResponse(error=info).model_dump())


class ModelFacts(NamedTuple):
    context_length: int
    vocab_size: int


class ServerState:
    """What the routes share: the daemon client, the served model's name and facts, metrics, the API key."""

    def __init__(
        self,
        client_address: str,
        model_name: str,
        api_key: str | None,
        client_factory: Callable[[], Any] | None,
        served_model_names: Sequence[str] = (),
        enable_admin: bool = False,
    ) -> None:
        self.client_address = client_address
        self.model = model_name  # what the daemon loaded (its path, alias or hub id)
        # --served-model-name: the names clients use and responses carry (the first); else the model itself
        self.served_names = tuple(served_model_names) or (model_name,)
        self.model_name = self.served_names[0]
        self.api_key = api_key
        self.enable_admin = enable_admin  # admin routes on a keyless server (with a key they need the key)
        self.metrics = ServerMetrics(model_name)
        self._client_factory = client_factory
        self.client: Any = None
        self._info: dict[str, Any] | None = None

    async def start(self) -> None:
        # The client connects on first use, so the server can come up before the daemon is ready
        # (/health says 503 until it is).
        if self._client_factory is not None:
            self.client = self._client_factory()
        else:
            self.client = AsyncClient(model=self.model, address=self.client_address, auto_start=False)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = dict(await self.client.model_info())
        return self._info

    async def context_len(self) -> int:
        return int((await self.info())["context_length"])

    async def model_facts(self) -> ModelFacts | None:
        """The context window and vocabulary the edge checks bodies against (server/edge.py); None while the
        daemon does not answer (the request then fails on its own)."""
        try:
            info = self._info or await asyncio.wait_for(self.info(), timeout=5.0)
            return ModelFacts(int(info["context_length"]), int(info["vocab_size"]))
        except (MiniSGLError, asyncio.TimeoutError, KeyError):
            return None

    async def serves(self, names: set[str]) -> bool:
        """Whether any of names is this server's model: a served name, the model as loaded, its name or path."""
        if names & {*self.served_names, self.model}:
            return True
        info = await self.info()
        return bool(names & {info.get("name"), info.get("path")})

    async def check_model(self, requested: str | None) -> None:
        if requested and not await self.serves({requested}):
            raise APIError(
                404,
                f"the model {requested!r} does not exist: this server serves {self.model_name!r}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )


def server_of(request: Request) -> ServerState:
    """The app's shared state, as create_app set it."""
    return request.app.state.server


async def check_key(request: Request) -> None:
    """A router dependency: with an API key set, the request needs `Authorization: Bearer <key>` (401 otherwise)."""
    api_key = server_of(request).api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>'",
            "invalid_request_error",
            "invalid_api_key",
        )


async def check_admin(request: Request) -> None:
    """A dependency of the admin routes: with an API key they need it; a keyless server serves them only when
    started with --enable-admin (any local user could call them otherwise)."""
    server = server_of(request)
    if server.api_key is not None:
        await check_key(request)
    elif not server.enable_admin:
        raise APIError(
            403,
            f"{request.url.path} is an admin route, off on a server without an API key: start the server with "
            "--enable-admin (or with --api-key, and send the key)",
            "invalid_request_error",
            "admin_disabled",
        )

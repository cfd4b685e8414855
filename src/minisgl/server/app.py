"""The HTTP server: one FastAPI app over one AsyncClient to the daemon, with a router per API.

The server holds no model: each route module validates its API's requests, translates them into Client calls
and the chunks back into its API's JSON. The routers (OpenAI's in server/openai.py, the Responses API in
server/responses.py, Ollama's in server/ollama.py, SGLang's native one in server/native.py, the server's own
probes and tools in server/admin.py) share the state that create_app puts on `app.state.server` (server/state.py).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.errors import MiniSGLError
from minisgl.server import admin, native, ollama, openai, responses
from minisgl.server.binding import check_bind
from minisgl.server.guard import GuardOptions, RequestGuard
from minisgl.server.state import APIError, ServerState, api_error

logger = logging.getLogger("minisgl.server")

# Every API's routes; the probes (health, version, metrics) need no API key, the rest check it per router.
ROUTERS = (admin.probes, admin.router, admin.admin, openai.router, responses.router, ollama.router, native.router)


def create_app(
    client_address: str,
    model_name: str,
    api_key: str | None = None,
    client_factory: Callable[[], Any] | None = None,
    guard: GuardOptions | None = None,
    served_model_names: Sequence[str] = (),
    enable_admin: bool = False,
) -> FastAPI:
    """The FastAPI app serving `model_name` from the daemon at `client_address`.

    With api_key set, every route but /health needs `Authorization: Bearer <api_key>`. guard: the browser-safety
    and size checks (server/guard.py; default: loopback only, no other origin, 32 MiB bodies). client_factory
    (tests, embedding) builds the async client instead of minisgl.AsyncClient. enable_admin: serve the admin routes
    (server/admin.py) without an API key. Middleware is added here, after the error handlers, so that it wraps
    every router.
    """
    server = ServerState(client_address, model_name, api_key, client_factory, served_model_names, enable_admin)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.close()

    app = FastAPI(title="minisgl", version=admin.version_string(), lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    guard = (guard or GuardOptions())._replace(api_key=api_key)
    app.add_middleware(RequestGuard, options=guard)
    if guard.allowed_origins:  # outermost: it answers the CORS preflights of the origins allowed
        app.add_middleware(
            CORSMiddleware, allow_origins=list(guard.allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's {"error": {...}} body: ours, the library's typed ones, pydantic's, Starlette's."""
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(MiniSGLError, _on_minisgl_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]


async def _on_api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


async def _on_minisgl_error(_: Request, e: MiniSGLError) -> JSONResponse:
    return api_error(e).response()


async def _on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    errs = e.errors()
    param = ".".join(str(p) for p in errs[0]["loc"][1:]) if errs and errs[0].get("loc") else None
    message = "; ".join(f"{'.'.join(str(p) for p in x['loc'][1:]) or 'body'}: {x['msg']}" for x in errs)
    return APIError(400, f"invalid request: {message}", "invalid_request_error", "invalid_request", param).response()


async def _on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    type_ = "invalid_request_error" if e.status_code < 500 else "internal_server_error"
    return APIError(e.status_code, str(e.detail), type_).response()


def run_http_server(
    client_address: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    model_name: str = "smollm2",
    log_level: str = "info",
    guard: GuardOptions | None = None,
    served_model_names: Sequence[str] = (),
    enable_admin: bool = False,
) -> None:
    """Serve the HTTP API with uvicorn until interrupted.

    Binding anything but a loopback address needs an api_key: the server never offers
    unauthenticated remote access.
    """
    check_bind(host, api_key)

    guard = (guard or GuardOptions())._replace(bound_host=host)
    app = create_app(
        client_address,
        model_name,
        api_key,
        guard=guard,
        served_model_names=served_model_names,
        enable_admin=enable_admin,
    )
    logger.info(
        "OpenAI-compatible API for %s on http://%s:%d/v1", ", ".join(served_model_names) or model_name, host, port
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

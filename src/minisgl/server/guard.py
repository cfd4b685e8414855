"""What every request passes before a router sees it: the browser-safety and size checks of the HTTP server.

A keyless server on a loopback address is still reachable from any web page the user opens: a page can POST a
`text/plain` body cross-site (no CORS preflight), and DNS rebinding lets it read answers under its own host name.
So: a POST with a body must be `application/json` (415), the Host header must name the bound or an allowed host
(DNS rebinding: 421), a request from another origin is refused unless --allowed-origins lists it (403; the CORS
headers themselves come from Starlette's CORSMiddleware), a body past max_request_bytes is refused (413) before
it reaches the daemon, a JSON body nested deeper than MAX_JSON_DEPTH is refused (400: Python's parser and the
validators recurse, so a body of 100k nested arrays would otherwise end in a RecursionError, a 500), and with an API
key every route but /health needs it (401).

A body is scanned in time linear in its size (server/bodyscan.py), a large one in a worker thread, and only in
UTF-8 (RFC 8259: JSON between systems is UTF-8; 400 otherwise). The scan of a large body travels to the routes in
the scope (server/edge.py checks its prompts before parsing). After a large request the memory it took is handed
back to the system (glibc's malloc_trim, where there is one).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hmac
import json
import threading
from typing import Any, Awaitable, Callable, NamedTuple
from urllib.parse import urlsplit

import anyio.to_thread

from minisgl.server.binding import is_loopback
from minisgl.server.bodyscan import is_utf8_json, scan
from minisgl.server.edge import BODY_SHAPE

MAX_REQUEST_BYTES = 32 * 2**20
MAX_JSON_DEPTH = (
    256  # past any API's own nesting (a schema of max_schema_depth 64 included), far below the recursion limit
)
SCAN_BYTES = 64 * 2**10  # smaller bodies with few brackets need no scan: their bracket count bounds the depth
SCAN_IN_THREAD_BYTES = 256 * 2**10
RELEASE_BYTES = 2**20  # after a body this large, the memory it took is handed back
OPEN_PATHS = ("/health",)  # probes that answer without the API key

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class GuardOptions(NamedTuple):
    api_key: str | None = None
    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # Host header names besides the bound one (and loopback names)
    allowed_origins: tuple[str, ...] = ()  # origins (scheme://host:port) that may call from a browser
    max_request_bytes: int = MAX_REQUEST_BYTES


class RequestGuard:
    """ASGI middleware applying GuardOptions; refusals are OpenAI-style JSON errors."""

    def __init__(self, app: Any, options: GuardOptions) -> None:
        self.app = app
        self.options = options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _send_error(send, *refusal)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body, receive = await self._buffered(receive)  # counted and scanned before anything parses it
        if body is None:
            await _send_error(send, *_too_large(self.options.max_request_bytes))
            return
        size = len(body)
        try:
            refusal = await _scan(body, scope)
            body = b""  # the replaying receive holds it until the route reads it
            if refusal is not None:
                await _send_error(send, *refusal)
                return
            await self.app(scope, receive, send)
        finally:
            if size >= RELEASE_BYTES:
                del receive
                await release_memory()

    async def _buffered(self, receive: Receive) -> tuple[bytes | None, Receive]:
        """The whole body (None when it is past the limit) and a receive that replays it (once)."""
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.options.max_request_bytes:
                return None, receive
        body: bytes | None = b"".join(chunks)  # once: adding up the pieces one by one copies quadratically
        chunks.clear()
        done = False

        async def replay() -> dict[str, Any]:
            nonlocal done, body
            if done:
                return await receive()
            done, whole, body = True, body, None  # the route keeps it as long as it needs it, no longer
            return {"type": "http.request", "body": whole, "more_body": False}

        return body, replay

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        o, method, path = self.options, scope.get("method", "GET"), scope.get("path", "")
        host = headers.get("host", "")
        if not self._host_allowed(host):
            return (
                421,
                f"the Host header {host!r} is not this server's (--allowed-hosts adds names)",
                "host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return 403, f"requests from the origin {origin!r} are not allowed (--allowed-origins)", "origin_not_allowed"
        if int(headers.get("content-length") or 0) > o.max_request_bytes:
            return _too_large(o.max_request_bytes)
        has_body = int(headers.get("content-length") or 0) > 0 or "chunked" in headers.get("transfer-encoding", "")
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if method == "POST" and has_body and kind != "application/json" and not kind.endswith("+json"):
            return (
                415,
                f"POST bodies must be JSON: send 'Content-Type: application/json' (got {kind or 'none'!r})",
                ("unsupported_media_type"),
            )
        if o.api_key is not None and path not in OPEN_PATHS and method != "OPTIONS":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), o.api_key.encode()):
                return 401, "invalid or missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
        return None

    def _host_allowed(self, host: str) -> bool:
        name = urlsplit(f"//{host}").hostname or ""
        if name in self.options.allowed_hosts or "*" in self.options.allowed_hosts:
            return True
        if not is_loopback(self.options.bound_host):
            return not self.options.allowed_hosts  # a remote bind (it has a key): any name, unless listed
        return is_loopback(name) or name == self.options.bound_host

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if origin in self.options.allowed_origins or "*" in self.options.allowed_origins:
            return True
        return urlsplit(origin).netloc == host  # the server's own pages (/docs)


async def _scan(body: bytes, scope: Scope) -> tuple[int, str, str] | None:
    """The refusal of a body that is not UTF-8 or nests too deeply; a large body's scan is left in the scope."""
    if not body:
        return None
    if not is_utf8_json(body):
        return 400, "the JSON body must be UTF-8 encoded", "invalid_encoding"
    brackets = body.count(b"[") + body.count(b"{")
    if len(body) < SCAN_BYTES and brackets <= MAX_JSON_DEPTH:
        return None  # its depth is at most its bracket count: nearly every body stops here
    if len(body) < SCAN_IN_THREAD_BYTES:
        shape = scan(body)
    else:
        shape = await anyio.to_thread.run_sync(scan, body)
    if shape.depth > MAX_JSON_DEPTH:
        return 400, f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", "json_too_deep"
    scope[BODY_SHAPE] = shape
    return None


def json_depth(body: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest, counted without parsing it (in linear time)."""
    return scan(body).depth


_releasing = threading.Lock()


async def release_memory() -> None:
    """Hand back to the system what a large request freed (its objects went with their last reference): glibc's
    malloc_trim returns the free pages its arenas keep, in a worker thread (it leaves the GIL); one at a time.
    No gc.collect: a full collection holds the GIL, and the event loop with it, for a large heap's whole walk."""
    if not _releasing.acquire(blocking=False):
        return
    try:
        await anyio.to_thread.run_sync(_trim)
    finally:
        _releasing.release()


def _trim() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_TRIM: list[Any] = []


def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None (musl, macOS: their allocators hand memory back themselves)."""
    if not _TRIM:
        name = ctypes.util.find_library("c")
        try:
            _TRIM.append(getattr(ctypes.CDLL(name), "malloc_trim") if name else None)
        except (OSError, AttributeError):
            _TRIM.append(None)
    return _TRIM[0]


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", []) if k.lower() == name), None)


def _too_large(limit: int) -> tuple[int, str, str]:
    return 413, f"the request body is larger than {limit} bytes (--max-request-bytes)", "request_too_large"


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    body = body.encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

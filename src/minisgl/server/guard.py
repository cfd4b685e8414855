"""What every request passes before a router sees it: the browser-safety and size checks of the HTTP server.

A keyless server on a loopback address is still reachable from any web page the user opens: a page can POST a
`text/plain` body cross-site (no CORS preflight), and DNS rebinding lets it read answers under its own host name.
So: a POST with a body must be `application/json` (415), the Host header must name the bound or an allowed host
(DNS rebinding: 421), a request from another origin is refused unless --allowed-origins lists it (403; the CORS
headers themselves come from Starlette's CORSMiddleware), a body past max_request_bytes is refused (413) before
it reaches the daemon, a JSON body nested deeper than MAX_JSON_DEPTH is refused (400: Python's parser and the
validators recurse, so a body of 100k nested arrays would otherwise end in a RecursionError, a 500), and with an API
key every route but /health needs it (401).
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any, Awaitable, Callable, NamedTuple
from urllib.parse import urlsplit

from minisgl.server.state import is_loopback

MAX_REQUEST_BYTES = 32 * 2**20
MAX_JSON_DEPTH = (
    256  # past any API's own nesting (a schema of max_schema_depth 64 included), far below the recursion limit
)
_JSON_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"', re.S)  # brackets inside strings are no nesting
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
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
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            body, receive = await self._buffered(receive)  # counted and its depth checked before anything parses it
            if body is None:
                await _send_error(send, *_too_large(self.options.max_request_bytes))
                return
            if await _depth(body) > MAX_JSON_DEPTH:
                message = f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep"
                await _send_error(send, 400, message, "json_too_deep")
                return
        await self.app(scope, receive, send)

    async def _buffered(self, receive: Receive) -> tuple[bytes | None, Receive]:
        """The whole body (None when it is past the limit) and a receive that replays it."""
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.options.max_request_bytes:
                return None, receive
        done = False

        async def replay() -> dict[str, Any]:
            nonlocal done
            if done:
                return await receive()
            done = True
            return {"type": "http.request", "body": body, "more_body": False}

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


async def _depth(body: bytes) -> int:
    if len(body) < 2**20:
        return json_depth(body)
    import anyio.to_thread

    return await anyio.to_thread.run_sync(json_depth, body)  # a large body's scan takes seconds: off the event loop


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (at most, when that is at most MAX_JSON_DEPTH), counted
    without parsing it: numpy, not recursion."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return body.count(b"[") + body.count(b"{")  # a bound, without the scan: nearly every body stops here
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    import numpy as np

    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


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

"""The OpenAI-compatible HTTP server: FastAPI endpoints over one AsyncClient to the daemon.

The server holds no model: it validates requests, translates them into Client calls and
translates chunks back into OpenAI JSON (or SSE). Errors found before the first streamed
byte are ordinary HTTP errors; a client that goes away aborts its request in the daemon.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.errors import (
    ConfigError,
    DaemonError,
    InvalidRequestError,
    MiniSGLError,
    OutOfMemoryError,
    PromptTooLongError,
    RequestAbortedError,
    UnknownModelError,
)
from minisgl.server.metrics import RequestTimer, ServerMetrics
from minisgl.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from minisgl.server.streams import ClientDisconnected, gather_all, merge_streams
from minisgl.server.streams import close_stream as _close
from minisgl.server.streams import first_item as _first
from minisgl.server.streams import unless_disconnected as _unless_disconnected

logger = logging.getLogger("minisgl.server")

_LOOPBACK_NAMES = ("localhost", "ip6-localhost")


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


def check_bind(host: str, api_key: str | None) -> None:
    """Binding anything but a loopback address needs an api_key (ConfigError otherwise)."""
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"refusing to serve HTTP on {host!r} without an API key: pass --api-key (or bind 127.0.0.1)")


def is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------- chunk -> OpenAI


def _usage(u: Any) -> Usage:
    """The OpenAI usage of a client Usage (prompt/completion/cached tokens); zeros when absent."""
    if u is None:
        return Usage.of(0, 0, 0)
    return Usage.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries: Sequence[dict[str, Any]] | None) -> ChoiceLogprobs | None:
    """The daemon's per-token logprobs ({token, logprob, top_logprobs: [{token, logprob}]}) in chat form."""
    if not entries:
        return None
    content = [
        TokenLogprob(
            token=e["token"],
            logprob=e["logprob"],
            bytes=_utf8(e["token"]),
            top_logprobs=[
                TopLogprob(token=t["token"], logprob=t["logprob"], bytes=_utf8(t["token"]))
                for t in e.get("top_logprobs") or []
            ],
        )
        for e in entries
    ]
    return ChoiceLogprobs(content=content)


def completion_logprobs(entries: Sequence[dict[str, Any]] | None, text_offset: int) -> CompletionLogprobs | None:
    """The daemon's per-token logprobs in the legacy completions form; offsets start at text_offset."""
    if not entries:
        return None
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(e["token"])
        out.token_logprobs.append(e["logprob"])
        if e["logprob"] is None:  # an echoed prompt's first token: nothing predicts it
            out.top_logprobs.append(None)
        else:  # the alternatives and, as OpenAI's (up to logprobs + 1 entries), the token itself
            top = {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []}
            top.setdefault(e["token"], e["logprob"])
            out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(e["token"])
    return out


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def _chunk_json(chunk: ChatCompletionChunk | CompletionResponse, include_usage: bool) -> dict[str, Any]:
    """OpenAI's chunk shape: deltas carry only the fields they set; usage is present iff asked for."""
    d = chunk.model_dump()
    for choice in d["choices"]:
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if not include_usage:
        d.pop("usage", None)
    return d


# ---------------------------------------------------------------------------- helpers


# ---------------------------------------------------------------------------- the app


class _Server:
    """What the endpoints share: the daemon client, model facts, metrics."""

    def __init__(self, client_address: str, model_name: str, client_factory: Callable[[], Any] | None) -> None:
        self.client_address = client_address
        self.model_name = model_name
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
            from minisgl.client import AsyncClient

            self.client = AsyncClient(model=self.model_name, address=self.client_address, auto_start=False)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = dict(await self.client.model_info())
        return self._info

    async def context_len(self) -> int:
        return int((await self.info())["context_length"])

    async def check_model(self, requested: str | None) -> None:
        if not requested or requested == self.model_name:
            return
        info = await self.info()
        if requested not in (info.get("name"), info.get("path")):
            raise APIError(
                404,
                f"the model {requested!r} does not exist: this server serves {self.model_name!r}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )


def create_app(
    client_address: str,
    model_name: str,
    api_key: str | None = None,
    client_factory: Callable[[], Any] | None = None,
) -> FastAPI:
    """The FastAPI app serving `model_name` from the daemon at `client_address`.

    With api_key set, every /v1 route needs `Authorization: Bearer <api_key>`.
    client_factory (tests, embedding) builds the async client instead of minisgl.AsyncClient.
    """
    server = _Server(client_address, model_name, client_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.close()

    app = FastAPI(title="minisgl", version=_version(), lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(MiniSGLError)
    async def _on_minisgl_error(_: Request, e: MiniSGLError) -> JSONResponse:
        return api_error(e).response()

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        param = ".".join(str(p) for p in errs[0]["loc"][1:]) if errs and errs[0].get("loc") else None
        message = "; ".join(f"{'.'.join(str(p) for p in x['loc'][1:]) or 'body'}: {x['msg']}" for x in errs)
        error = APIError(400, f"invalid request: {message}", "invalid_request_error", "invalid_request", param)
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if e.status_code < 500 else "internal_server_error"
        return APIError(e.status_code, str(e.detail), type_).response()

    async def check_key(request: Request) -> None:
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

    @app.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(server.client.stats(), timeout=5.0)  # a round trip: is the daemon serving now?
        except (MiniSGLError, asyncio.TimeoutError) as e:
            reason = str(e) or "no answer within 5s"
            return APIError(503, f"the minisgl daemon is unavailable: {reason}", "service_unavailable").response()
        return JSONResponse({"status": "ok", "model": model_name})

    # What other servers answer at these paths, for clients that probe them: Ollama's root ("Ollama is running",
    # GET and HEAD, which its CLI and chat UIs check), vLLM's /version and /ping (the SageMaker liveness route).
    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return Response(
            f"minisgl is running ({model_name}): OpenAI /v1, Ollama /api, SGLang /generate", media_type="text/plain"
        )

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": _version()})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            server.metrics.set_daemon_stats(await asyncio.wait_for(server.client.stats(), timeout=2.0))
        except (MiniSGLError, asyncio.TimeoutError):
            pass  # the server's own metrics are still worth scraping
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    # vLLM's token routes (at the root, as vLLM serves them); the API key guards them too.
    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        await server.check_model(body.model)
        prompt, kwargs = body.tokenize_args()
        tokens = await server.client.tokenize(prompt, **kwargs)
        return TokenizeResponse(count=len(tokens), max_model_len=await server.context_len(), tokens=tokens)

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        await server.check_model(body.model)
        return DetokenizeResponse(prompt=await server.client.detokenize(body.tokens))

    # SGLang's and vLLM's names for dropping the prefix cache (what no running request holds).
    @app.post("/flush_cache", dependencies=[Depends(check_key)])
    @app.post("/reset_prefix_cache", dependencies=[Depends(check_key)])
    async def flush_cache() -> JSONResponse:
        stats = await server.client.flush_cache()
        return JSONResponse({"status": "ok", "cached_pages": stats["cached_pages"]})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=await server.context_len())])

    @v1.get("/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        await server.check_model(model)
        return ModelCard(id=model_name, max_model_len=await server.context_len())

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        timer = server.metrics.request("chat")
        try:
            await server.check_model(body.model)
            kwargs = dict(
                sampling_params=body.to_sampling_params(),
                tools=body.tools or None,
                tool_choice=body.tool_choice,
                response_format=body.response_format_dict(),
                chat_template_kwargs=body.chat_template_kwargs,
                parallel_tool_calls=body.parallel_tool_calls,
            )
            messages = body.chat_messages()
            rid = new_id("chatcmpl")
            if body.stream:
                stream = server.client.stream(messages, rid=rid, **kwargs)
                first = await _first(stream)
                return _sse_response(_chat_events(server, body, rid, first, stream, timer))
            out = await _unless_disconnected(request, server.client.generate(messages, rid=rid, **kwargs))
        except BaseException as e:
            return _fail(timer, e)
        response = _chat_response(out, rid, model_name, body)
        if body.prompt_logprobs is not None:
            response.prompt_logprobs = out.prompt_logprobs  # the rendered chat prompt's tokens
        u = response.usage
        timer.done(200, u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens)
        return JSONResponse(response.model_dump())

    @v1.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        timer = server.metrics.request("embeddings")
        try:
            await server.check_model(body.model)
            out = await _unless_disconnected(request, server.client.embed(body.inputs()))
        except BaseException as e:
            return _fail(timer, e)
        data = [
            EmbeddingData(
                index=i, embedding=_base64_floats(e.embedding) if body.encoding_format == "base64" else e.embedding
            )
            for i, e in enumerate(out)
        ]
        tokens = sum(e.prompt_tokens for e in out)
        timer.done(200, tokens, 0, 0)
        response = EmbeddingResponse(
            data=data, model=model_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        )
        return JSONResponse(response.model_dump())

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        timer = server.metrics.request("completions")
        try:
            await server.check_model(body.model)
            kwargs = dict(sampling_params=body.to_sampling_params(), response_format=body.response_format_dict())
            prompts = body.prompts()
            rid = new_id("cmpl")
            rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
            if body.stream:
                streams = [server.client.stream(p, rid=r, **kwargs) for p, r in zip(prompts, rids)]
                merged = merge_streams(streams)
                first = await _first(merged)
                return _sse_response(_completion_events(body, rid, model_name, first, merged, timer))
            outs = await _unless_disconnected(
                request, gather_all([server.client.generate(p, rid=r, **kwargs) for p, r in zip(prompts, rids)])
            )
            # Echoed token-id prompts are decoded whole (as vLLM): token by token, a character split across
            # tokens (an emoji) would come back as replacement characters.
            echoes = None
            if body.echo:
                echoes = [p if isinstance(p, str) else await server.client.detokenize(p) for p in prompts]
        except BaseException as e:
            return _fail(timer, e)
        response = _completion_response(outs, rid, model_name, body, echoes)
        u = response.usage or Usage()
        timer.done(200, u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens)
        return JSONResponse(response.model_dump())

    app.include_router(v1)
    from minisgl.server.responses import responses_router

    app.include_router(responses_router(server, check_key, _fail, _response_error))
    from minisgl.server.ollama import ollama_router

    app.include_router(ollama_router(server, check_key, api_error))  # for tools written for Ollama
    from minisgl.server.native import native_router

    app.include_router(native_router(server, check_key, _fail, _error_event))  # SGLang's /generate and friends
    return app


def _base64_floats(values: list[float]) -> str:
    """OpenAI's encoding_format="base64": the vector as little-endian float32 bytes, base64-encoded."""
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def _response_error(e: BaseException) -> dict[str, Any]:
    """The fields of a Responses API "error" event."""
    err = api_error(e)
    return {"code": err.code or err.type, "message": err.message, "param": err.param}


def _version() -> str:
    from minisgl import __version__

    return __version__


def _fail(timer: RequestTimer, e: BaseException) -> Response:
    if isinstance(e, ClientDisconnected):
        timer.done(499)
        return Response(status_code=499)
    if not isinstance(e, Exception):  # cancellation and the like are not ours to answer
        timer.done(499)
        raise e
    err = api_error(e)
    timer.done(err.status)
    return err.response()


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _error_event(e: BaseException) -> str:
    err = api_error(e)
    info = ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code or err.status)
    return _sse(ErrorResponse(error=info).model_dump())


def _chat_finish(finish: str | None, body: ChatCompletionRequest) -> str | None:
    """The daemon's finish reason ("tool_calls" when a call was made), as OpenAI's chat API reports it: a call
    forced by a named tool_choice finishes with "stop" there (vLLM aligned with it too)."""
    return "stop" if finish == "tool_calls" and isinstance(body.tool_choice, dict) else finish


def _chat_response(out: Any, rid: str, model: str, body: ChatCompletionRequest) -> ChatCompletionResponse:
    choices = []
    for o in out.outputs:
        calls = [ToolCall.model_validate(c) for c in o.tool_calls or []] or None
        message = ChatMessage(
            content=o.text if (o.text or not calls) else None, tool_calls=calls, reasoning_content=o.reasoning_content
        )
        choices.append(
            ChatChoice(
                index=o.index,
                message=message,
                logprobs=chat_logprobs(o.logprobs),
                finish_reason=_chat_finish(o.finish_reason, body),
            )
        )
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=_usage(out.usage))


def _completion_response(
    outs: list[Any], rid: str, model: str, body: CompletionRequest, echoes: list[str] | None
) -> CompletionResponse:
    """One choice per prompt and sample; with echo each starts with its prompt's text, echoes[p] (and, with
    logprobs, its prompt tokens' logprobs, offsets counted from the prompt's start)."""
    choices = []
    usage = Usage.of(0, 0, 0)
    for p, out in enumerate(outs):
        prompt_entries = out.prompt_logprobs or []
        echoed = echoes[p] if echoes is not None else ""
        for o in out.outputs:
            entries = (
                ([*prompt_entries, *(o.logprobs or [])] if body.echo else o.logprobs)
                if body.logprobs is not None
                else None
            )
            choices.append(
                CompletionChoice(
                    index=p * body.n + o.index,
                    text=echoed + o.text,
                    logprobs=completion_logprobs(entries, 0),
                    finish_reason=o.finish_reason,
                    prompt_logprobs=out.prompt_logprobs if body.prompt_logprobs is not None else None,
                )
            )
        usage = usage + _usage(out.usage)
    return CompletionResponse(id=rid, model=model, choices=choices, usage=usage)


async def _chat_events(
    server: _Server,
    body: ChatCompletionRequest,
    rid: str,
    first: tuple[Any, bool],
    stream: AsyncIterator[Any],
    timer: RequestTimer,
) -> AsyncIterator[str]:
    model, include_usage = server.model_name, body.include_usage
    created = now()  # every chunk carries the stream's one timestamp, as OpenAI's
    started: set[int] = set()
    usage: Usage | None = None
    status = 200

    def event(choice: ChatChunkChoice) -> str:
        piece = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
        return _sse(_chunk_json(piece, include_usage))

    try:
        chunk, empty = first
        while not empty:
            timer.first_token()
            index = int(chunk.index)
            if index not in started:
                started.add(index)
                yield event(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            tool_deltas, finish = chunk.tool_calls, _chat_finish(chunk.finish_reason, body)
            logprobs = chat_logprobs(chunk.logprobs) if body.logprobs else None
            if chunk.text or chunk.reasoning or tool_deltas or logprobs or finish:
                delta = DeltaMessage(
                    content=chunk.text or None,
                    tool_calls=tool_deltas or None,
                    reasoning_content=chunk.reasoning or None,
                )
                yield event(ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish))
            if chunk.usage is not None:
                usage = _usage(chunk.usage)
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                empty = True
        if include_usage:
            final = ChatCompletionChunk(
                id=rid, created=created, model=model, choices=[], usage=usage or Usage.of(0, 0, 0)
            )
            yield _sse(_chunk_json(final, True))
    except Exception as e:  # noqa: BLE001 - after the first byte an error can only travel in the stream
        status = api_error(e).status
        yield _error_event(e)
    except BaseException:
        status = 499  # the HTTP client went away: closing the stream below aborts the request
        raise
    finally:
        await _close(stream)
        u = usage or Usage()
        timer.done(status, u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens)
    yield _sse("[DONE]")


async def _completion_events(
    body: CompletionRequest,
    rid: str,
    model: str,
    first: tuple[Any, bool],
    merged: AsyncIterator[tuple[int, Any]],
    timer: RequestTimer,
) -> AsyncIterator[str]:
    include_usage, created = body.include_usage, now()
    usage = Usage.of(0, 0, 0)
    offsets: dict[int, int] = {}
    status = 200
    try:
        item, empty = first
        while not empty:
            timer.first_token()
            p, chunk = item
            index = p * body.n + int(chunk.index)
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(chunk.logprobs, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(chunk.text)
            if chunk.text or logprobs or chunk.finish_reason:
                choice = CompletionChoice(
                    index=index, text=chunk.text, logprobs=logprobs, finish_reason=chunk.finish_reason
                )
                piece = CompletionResponse(id=rid, created=created, model=model, choices=[choice])
                yield _sse(_chunk_json(piece, include_usage))
            if chunk.usage is not None:
                usage = usage + _usage(chunk.usage)
            try:
                item = await merged.__anext__()
            except StopAsyncIteration:
                empty = True
        if include_usage:
            yield _sse(
                _chunk_json(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage), True)
            )
    except Exception as e:  # noqa: BLE001 - after the first byte an error can only travel in the stream
        status = api_error(e).status
        yield _error_event(e)
    except BaseException:
        status = 499
        raise
    finally:
        await _close(merged)
        timer.done(status, usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens)
    yield _sse("[DONE]")


def run_http_server(
    client_address: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    model_name: str = "smollm2",
    log_level: str = "info",
) -> None:
    """Serve the OpenAI-compatible API with uvicorn until interrupted.

    Binding anything but a loopback address needs an api_key: the server never offers
    unauthenticated remote access.
    """
    check_bind(host, api_key)
    import uvicorn

    app = create_app(client_address, model_name, api_key)
    logger.info("OpenAI-compatible API for %s on http://%s:%d/v1", model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

"""Ollama's REST API (/api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version) on the same server.

Tools written for Ollama (its Python/JS clients, editors, chat UIs) point at this server unchanged. The
bodies are Ollama's: `options` (temperature, top_p, top_k, min_p, seed, stop, num_predict, repeat_penalty,
presence_penalty, frequency_penalty; the others, such as num_ctx, are the daemon's and ignored), `format`
("json" or a JSON schema), `tools`, `think`, streaming as NDJSON (on by default, as in Ollama), durations
in nanoseconds, errors as {"error": message}. Sampling defaults are minisgl's (the OpenAI API's), not a
Modelfile's. /api/generate renders the prompt (and `system`) with the chat template unless `raw`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl import __version__
from minisgl.client import merge_tool_calls
from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequestError
from minisgl.server.edge import MAX_CHARS_PER_TOKEN, OllamaEdgeRoute
from minisgl.server.params import sampling_params_for
from minisgl.server.state import ClientDisconnected, ServerState, api_error, check_key, server_of
from minisgl.server.streams import StreamWriter, close_stream, json_object, streamed_response, unless_disconnected
from minisgl.tokenizer import flatten_message

# Ollama option -> SamplingParams field (num_predict apart: its negative values mean no limit)
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("options must be an object")
    params = {ours: options[theirs] for theirs, ours in _OPTIONS.items() if options.get(theirs) is not None}
    num_predict = options.get("num_predict")
    if num_predict is not None and (isinstance(num_predict, bool) or not isinstance(num_predict, int)):
        raise InvalidRequestError(f"options.num_predict must be an integer (-1: no limit), got {num_predict!r}")
    if num_predict is not None and num_predict >= 0:  # -1 (infinite) and -2 (fill the context): to the context's end
        params["max_tokens"] = num_predict
    return sampling_params_for("ollama", params)


def response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise InvalidRequestError('format must be "json" or a JSON schema object')


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Ollama messages as chat-template messages: images refused, tool-call arguments as JSON text."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("images"):
            raise InvalidRequestError(f"messages[{i}]: images are not supported (text only)")
        m = flatten_message(m, i)
        calls = m.get("tool_calls")
        if calls:
            m = {
                **m,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": c.get("function", {}).get("name"),
                            "arguments": json.dumps(c.get("function", {}).get("arguments") or {}),
                        },
                    }
                    for c in calls
                ],
            }
        out.append({k: v for k, v in m.items() if k not in ("images", "thinking")})
    return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI tool calls (arguments as JSON text) in Ollama's shape (arguments as an object)."""
    if not calls:
        return None
    out = []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = {}
        out.append({"function": {"name": fn.get("name"), "arguments": args}})
    return out


class _Clock:
    """Ollama's durations (ns): total, and prompt evaluation up to the first token."""

    def __init__(self) -> None:
        self.start = time.perf_counter_ns()
        self.first: int | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter_ns()

    def stats(self, usage: Any, done_reason: str | None) -> dict[str, Any]:
        end = time.perf_counter_ns()
        first = self.first if self.first is not None else end
        return {
            "done": True,
            "done_reason": done_reason or "stop",
            "total_duration": end - self.start,
            "load_duration": 0,
            "prompt_eval_count": getattr(usage, "prompt_tokens", 0),
            "prompt_eval_duration": first - self.start,
            "eval_count": getattr(usage, "completion_tokens", 0),
            "eval_duration": end - first,
        }


async def _gather(stream: Any, clock: _Clock) -> tuple[str, str, list[dict[str, Any]], Any]:
    """A whole answer from its stream: text, reasoning, tool calls and the last chunk (usage, finish_reason)."""
    text, reasoning, calls, chunk = "", "", [], None
    try:
        async for chunk in stream:
            clock.token()
            text, reasoning = text + chunk.text, reasoning + (chunk.reasoning or "")
            merge_tool_calls(calls, chunk.tool_calls or [])
    finally:
        await close_stream(stream)
    return text, reasoning, calls, chunk


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


router = APIRouter(prefix="/api", dependencies=[Depends(check_key)], route_class=OllamaEdgeRoute)


class _NotFound(Exception):
    pass


async def _body(request: Request) -> dict[str, Any]:
    """The JSON body; a model other than the served one is a 404 (Ollama's "model not found")."""
    body = await json_object(request)
    model, server = body.get("model"), server_of(request)
    if model and model != server.model_name:
        names = {model, model.removesuffix(":latest")}  # Ollama's tag defaults to "latest": "m" is "m:latest"
        if not await server.serves(names):
            raise _NotFound(f"model '{model}' not found: this server serves '{server.model_name}'")
    return body


def _loaded(model: str, piece: dict[str, Any]) -> Response:
    """Ollama's answer to a request with nothing to generate, its way to load a model (kept loaded here: the
    daemon serves other clients too)."""
    return JSONResponse({"model": model, "created_at": _now(), **piece, "done": True, "done_reason": "load"})


_Shape = Callable[[str, str, "list[dict[str, Any]] | None"], dict[str, Any]]


async def _run(request: Request, prompt: Any, body: dict[str, Any], shape: _Shape) -> Response:
    """Run one request; stream NDJSON lines (Ollama's default) or answer with one object."""
    server = server_of(request)
    kwargs = dict(
        sampling_params=sampling_params(body),
        response_format=response_format(body.get("format")),
        rid=f"ollama-{uuid.uuid4().hex}",
    )
    if isinstance(prompt, list):
        kwargs["tools"] = body.get("tools") or None
        if body.get("think") is not None:
            kwargs["chat_template_kwargs"] = {"enable_thinking": bool(body["think"])}
    clock = _Clock()
    base = {"model": body.get("model") or server.model_name}
    if body.get("stream", True):
        return await streamed_response(server.client.stream(prompt, **kwargs), _Lines(base, shape, clock))
    # Streamed underneath too: the first chunk's time splits prompt evaluation from generation (eval_duration).
    whole = _gather(server.client.stream(prompt, **kwargs), clock)
    text, reasoning, calls, last = await unless_disconnected(request, whole)
    piece = shape(text, reasoning, _tool_calls(calls))
    return JSONResponse({**base, "created_at": _now(), **piece, **clock.stats(last.usage, last.finish_reason)})


class _Lines(StreamWriter):
    """The NDJSON lines of a streamed answer; tool calls go out whole, on the last line (Ollama sends no fragments)."""

    media_type = "application/x-ndjson"

    def __init__(self, base: dict[str, Any], shape: _Shape, clock: _Clock) -> None:
        self.base, self.shape, self.clock = base, shape, clock
        self.calls: list[dict[str, Any]] = []

    async def item(self, chunk: Any) -> list[str]:
        self.clock.token()
        last = chunk.usage is not None
        merge_tool_calls(self.calls, chunk.tool_calls or [])
        piece = self.shape(chunk.text, chunk.reasoning, _tool_calls(self.calls) if last else None)
        done = self.clock.stats(chunk.usage, chunk.finish_reason) if last else {"done": False}
        return [json.dumps({**self.base, "created_at": _now(), **piece, **done}) + "\n"]

    def error(self, e: BaseException) -> str:
        return json.dumps({"error": str(api_error(e).message)}) + "\n"


def _route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Ollama's error shape ({"error": message}) with the status of the error's kind."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except _NotFound as e:
            return _error(404, str(e))
        except ClientDisconnected:  # nobody reads the answer; the request was aborted
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - Ollama's error shape, with the status of the error's kind
            err = api_error(e)
            return _error(err.status, err.message)

    return wrapped


def _chat_shape(text: str, reasoning: str, calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["thinking"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


def _generate_shape(text: str, reasoning: str, calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"response": text, **({"thinking": reasoning} if reasoning else {})}


@router.post("/chat")
@_route
async def chat(request: Request) -> Response:
    body = await _body(request)
    if not body.get("messages"):  # no messages: Ollama's way to load a model
        model = body.get("model") or server_of(request).model_name
        return _loaded(model, {"message": {"role": "assistant", "content": ""}})
    return await _run(request, chat_messages(body.get("messages")), body, _chat_shape)


def _check_generate(body: dict[str, Any]) -> str:
    """The prompt of an /api/generate body; the fields this server does not support are refused."""
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt must be a string")
    if body.get("images"):
        raise InvalidRequestError("images are not supported (text only)")
    if body.get("suffix"):
        raise InvalidRequestError("suffix (fill-in-the-middle) is not supported")
    if body.get("context"):
        raise InvalidRequestError(
            "context (the deprecated token context of an earlier answer) is not supported: "
            "send the conversation to /api/chat"
        )
    if not isinstance(body.get("system") or "", str):
        raise InvalidRequestError("system must be a string")
    return prompt


@router.post("/generate")
@_route
async def generate(request: Request) -> Response:
    body = await _body(request)
    prompt, server = _check_generate(body), server_of(request)
    if not prompt:  # Ollama's way to load a model: nothing to generate
        return _loaded(body.get("model") or server.model_name, {"response": ""})
    info = await server.info()
    if body.get("raw") or not info.get("has_chat_template"):
        target: Any = prompt
    else:
        system = body.get("system")
        target = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return await _run(request, target, body, _generate_shape)


async def _model_entry(server: ServerState) -> dict[str, Any]:
    info = await server.info()
    details = {
        "format": "gguf" if str(info.get("path", "")).endswith(".gguf") else "safetensors",
        "family": info.get("model_type") or "",
        "families": [info.get("model_type") or ""],
        "parameter_size": "",
        "quantization_level": info.get("dtype") or "",
    }
    name = server.model_name
    return {"name": name, "model": name, "modified_at": _now(), "size": 0, "digest": "", "details": details}


def _embed_inputs(body: dict[str, Any]) -> tuple[list[str], bool]:
    """An /api/embed body's inputs and whether to truncate them."""
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) and x for x in inputs):
        raise InvalidRequestError("input must be a non-empty string or a list of non-empty strings")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise InvalidRequestError("truncate must be true or false")
    if body.get("dimensions") is not None:
        raise InvalidRequestError("dimensions is not supported: the embedding has the model's hidden size")
    return inputs, truncate


@router.post("/embed")
@_route
async def embed(request: Request) -> Response:
    body = await _body(request)
    inputs, truncate = _embed_inputs(body)
    server = server_of(request)
    start = time.perf_counter()
    if truncate:  # Ollama's default: an input longer than the context is cut to fit, not refused
        info, stats = await server.info(), await server.client.stats()  # the KV pool may hold less than a context
        limit = min(int(info["context_length"]), stats["total_pages"] * int(info.get("page_size") or 1)) - 1
        # Tokenized once here (concurrently), past what `limit` tokens can spell unread; the daemon then embeds the
        # ids as they are.
        cut = (limit + 1) * MAX_CHARS_PER_TOKEN
        inputs = [ids[:limit] for ids in await asyncio.gather(*(server.client.tokenize(t[:cut]) for t in inputs))]
    out = await unless_disconnected(request, server.client.embed(inputs))
    return JSONResponse(
        {
            "model": body.get("model") or server.model_name,
            "embeddings": [e.embedding for e in out],
            "total_duration": int((time.perf_counter() - start) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": sum(e.prompt_tokens for e in out),
        }
    )


@router.post("/embeddings")
@_route
async def embeddings(request: Request) -> Response:  # Ollama's older route: one prompt, one vector
    body = await _body(request)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequestError("prompt must be a non-empty string")
    out = await unless_disconnected(request, server_of(request).client.embed(prompt))
    return JSONResponse({"embedding": out[0].embedding})


@router.get("/tags")
@_route
async def tags(request: Request) -> Response:
    return JSONResponse({"models": [await _model_entry(server_of(request))]})


@router.get("/ps")
@_route
async def ps(request: Request) -> Response:
    entry = await _model_entry(server_of(request))
    return JSONResponse({"models": [{**entry, "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0}]})


@router.post("/show")
@_route
async def show(request: Request) -> Response:
    await _body(request)
    server = server_of(request)
    info = await server.info()
    arch = info.get("model_type") or "unknown"
    entry = await _model_entry(server)
    capabilities = ["completion"] + (["tools"] if info.get("has_chat_template") else [])
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": entry["details"],
            "model_info": {
                "general.architecture": arch,
                f"{arch}.context_length": info.get("context_length"),
                f"{arch}.vocab_size": info.get("vocab_size"),
            },
            "capabilities": capabilities,
            "modified_at": entry["modified_at"],
        }
    )


@router.get("/version")
async def version() -> Response:
    return JSONResponse({"version": __version__})

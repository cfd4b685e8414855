"""OpenAI's Responses API (POST /v1/responses) over the daemon: text in, text out, whole or streamed as events.

What newer OpenAI clients (the openai package's `client.responses`, agent SDKs) send: `input` as a string or a
list of role messages (input_text / output_text parts), `instructions` as the system message, sampling fields,
`text.format` for JSON output. Function tools (and a tool_choice that needs them), logprobs, images, stored
conversations (`previous_response_id`) and background runs are refused with a 400 that names the chat completions
API instead; nothing is dropped silently.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequestError
from minisgl.server.protocol import _Request, now
from minisgl.server.state import api_error, check_key, fail, server_of, sse_response
from minisgl.server.edge import EdgeRoute
from minisgl.server.streams import close_stream, first_item, unless_disconnected


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None

    def check(self) -> None:
        if self.tools:
            raise InvalidRequestError(
                "tools are not supported on /v1/responses: use /v1/chat/completions for tool calls"
            )
        if self.tool_choice not in (None, "auto", "none"):
            raise InvalidRequestError(
                f"tool_choice {self.tool_choice!r} needs tools, which /v1/responses does not support: "
                "use /v1/chat/completions for tool calls"
            )
        if self.top_logprobs or "message.output_text.logprobs" in (self.include or []):
            raise InvalidRequestError("logprobs are not supported on /v1/responses: use /v1/chat/completions")
        if self.previous_response_id:
            raise InvalidRequestError(
                "previous_response_id is not supported: responses are not stored; send the whole input"
            )
        if self.background:
            raise InvalidRequestError("background responses are not supported")

    def messages(self) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            if not self.input:
                raise InvalidRequestError("input must not be empty")
            return out + [{"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequestError("input must not be empty")
        for i, item in enumerate(self.input):
            if item.get("type", "message") != "message" or "role" not in item:
                raise InvalidRequestError(
                    f"input[{i}]: only role messages are supported (got type {item.get('type')!r}); "
                    "tool calls and their outputs go through /v1/chat/completions"
                )
            role = "system" if item["role"] == "developer" else item["role"]
            if role not in ("system", "user", "assistant"):
                raise InvalidRequestError(f"input[{i}]: unknown role {item['role']!r}")
            out.append({"role": role, "content": _text_of(item.get("content"), i)})
        return out

    def sampling_params(self) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_output_tokens}
        return SamplingParams.from_openai(given, api="openai.responses")

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None or fmt.get("type", "text") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise InvalidRequestError("text.format json_schema needs a 'schema' object")
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
        raise InvalidRequestError(f"unknown text.format type {fmt.get('type')!r}: use text, json_object or json_schema")


def _text_of(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"input[{i}].content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"input[{i}]: content parts of type {kind!r} are not supported (text only)")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _usage(u: Any) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


class _Shape:
    """The response object and its output items, as OpenAI writes them."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id, self.msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.body, self.model, self.created = body, model, now()

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    def response(
        self, status: str, output: list[dict[str, Any]], usage: Any = None, finish: str | None = None
    ) -> dict[str, Any]:
        b = self.body
        incomplete = status == "completed" and finish == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output,
            "usage": _usage(usage) if usage is not None else None,
            "error": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "text": b.text or {"format": {"type": "text"}},
            "metadata": {},
            "previous_response_id": None,
        }


router = APIRouter(prefix="/v1", dependencies=[Depends(check_key)], route_class=EdgeRoute)


@router.post("/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    server = server_of(request)
    timer = server.metrics.request("responses")
    shape = _Shape(body, server.model_name)
    try:
        await server.check_model(body.model)
        body.check()
        kwargs = dict(sampling_params=body.sampling_params(), response_format=body.response_format(), rid=shape.id)
        messages = body.messages()
        if body.stream:
            stream = server.client.stream(messages, **kwargs)
            first = await first_item(stream)
            return sse_response(_events(shape, first, stream, timer))
        out = await unless_disconnected(request, server.client.generate(messages, **kwargs))
    except BaseException as e:
        return fail(timer, e)
    o = out.outputs[0]
    timer.done(200, out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_tokens)
    item = shape.message(o.text, _item_status(o.finish_reason))
    return JSONResponse(shape.response("completed", [item], out.usage, o.finish_reason))


def _error_fields(e: BaseException) -> dict[str, Any]:
    """The fields of a Responses API "error" event."""
    err = api_error(e)
    return {"code": err.code or err.type, "message": err.message, "param": err.param}


def _item_status(finish: str | None) -> str:
    """The output message's status: "incomplete" when max_output_tokens cut it."""
    return "incomplete" if finish == "length" else "completed"


async def _events(
    shape: _Shape,
    first: tuple[Any, bool],
    stream: AsyncIterator[Any],
    timer: Any,
) -> AsyncIterator[str]:
    """The Responses API's event stream for one message of text (no [DONE]: the stream ends after
    response.completed, or after an error event). A response cut by max_output_tokens has status "incomplete" (and
    so has its message) but still ends with response.completed: the openai SDK's responses.stream() helper waits for
    that event and fails without it, where OpenAI's API sends response.incomplete."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    where = {"item_id": shape.msg_id, "output_index": 0, "content_index": 0}
    text, status = "", 200
    try:
        yield event("response.created", response=shape.response("in_progress", []))
        yield event("response.in_progress", response=shape.response("in_progress", []))
        yield event("response.output_item.added", output_index=0, item=shape.message(None, "in_progress"))
        yield event("response.content_part.added", part=shape.part(""), **where)
        chunk, empty = first
        usage = finish = None
        while not empty:
            timer.first_token()
            if chunk.text:
                text += chunk.text
                yield event("response.output_text.delta", delta=chunk.text, logprobs=[], **where)
            usage, finish = chunk.usage or usage, chunk.finish_reason or finish
            chunk = await anext(stream, None)
            empty = chunk is None
        yield event("response.output_text.done", text=text, logprobs=[], **where)
        yield event("response.content_part.done", part=shape.part(text), **where)
        item = shape.message(text, _item_status(finish))
        yield event("response.output_item.done", output_index=0, item=item)
        yield event("response.completed", response=shape.response("completed", [item], usage, finish))
        if usage is not None:
            timer.done(200, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
    except Exception as e:  # noqa: BLE001 - after the first byte an error travels as an event
        status = 500
        yield event("error", **_error_fields(e))
    except BaseException:
        status = 499  # the HTTP client went away: closing the stream below aborts the request
        raise
    finally:
        await close_stream(stream)
        timer.done(status)

"""OpenAI's Responses API (POST /v1/responses) over the daemon: text and function calls, whole or streamed as events.

What newer OpenAI clients (the openai package's `client.responses`, the OpenAI Agents SDK, pydantic-ai) send:
`input` as a string or a list of items (role messages with input_text / output_text parts, `function_call` and
`function_call_output` items), `instructions` as the system message, sampling fields, `text.format` for JSON
output, function `tools` with `tool_choice` and `parallel_tool_calls`. Input items become the chat the template
renders (function calls as the assistant's tool_calls, their outputs as tool messages); the answer comes back as a
message item and one `function_call` item per call. Hosted tools, logprobs, images, stored conversations
(`previous_response_id`) and background runs are refused with a 400 that says so; nothing is dropped silently.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequestError
from minisgl.server.edge import EdgeRoute
from minisgl.server.params import sampling_params_from_openai
from minisgl.server.protocol import _Request, now
from minisgl.server.state import api_error, check_key, fail, server_of
from minisgl.server.streams import StreamWriter, streamed_response, unless_disconnected
from minisgl.structured.tools import normalize_tools, resolve_tool_choice

_TOOL_CHOICES = '"auto", "none", "required", {"type": "function", "name": ...} or {"type": "allowed_tools", ...}'


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
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None

    def check(self) -> None:
        if self.top_logprobs or "message.output_text.logprobs" in (self.include or []):
            raise InvalidRequestError("logprobs are not supported on /v1/responses: use /v1/chat/completions")
        if self.previous_response_id:
            raise InvalidRequestError(
                "previous_response_id is not supported: responses are not stored; send the whole input"
            )
        if self.background:
            raise InvalidRequestError("background responses are not supported")

    def chat_tools(self) -> tuple[list[dict[str, Any]] | None, Any]:
        """The tools and tool_choice in the chat API's shape (what the daemon takes), validated: an allowed_tools
        tool_choice keeps only the tools it names."""
        tools = [_chat_tool(t, i) for i, t in enumerate(self.tools or [])]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
            tools = [t for t in tools if t["function"]["name"] in allowed]
            choice = choice.get("mode", "auto")
            if not tools:
                raise InvalidRequestError("tool_choice allowed_tools names none of the function tools given")
        elif isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif isinstance(choice, dict) and choice.get("type") != "function":
            raise InvalidRequestError(f"tool_choice type {choice.get('type')!r} is not supported: use {_TOOL_CHOICES}")
        resolve_tool_choice(choice, normalize_tools(tools))  # a bad choice or tool is a 400 before generation
        return tools or None, choice

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if not self.input:
            raise InvalidRequestError("input must not be empty")
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        names: dict[str, str] = {}  # call_id -> function name, for the tool messages that answer them
        for i, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise InvalidRequestError(f"input[{i}] must be an object (a message or a function call item)")
            kind = item.get("type", "message")
            if kind == "message":
                out.append(_message_of(item, i))
            elif kind == "function_call":
                call = _call_of(item, i)
                names[call["id"]] = call["function"]["name"]
                if out and out[-1]["role"] == "assistant":  # text and calls of one turn, or parallel calls
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                call_id = item.get("call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise InvalidRequestError(f"input[{i}]: a function_call_output needs its call_id")
                tool = {"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), i)}
                out.append({**tool, "name": names[call_id]} if call_id in names else tool)
            elif kind != "reasoning":  # reasoning items: chat templates drop earlier turns' reasoning anyway
                raise InvalidRequestError(
                    f"input[{i}]: items of type {kind!r} are not supported; "
                    "use messages, function_call and function_call_output items"
                )
        return out

    def sampling_params(self) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_output_tokens}
        return sampling_params_from_openai(given, api="openai.responses")

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


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool ({"type": "function", "name", "description", "parameters", "strict"}) in the chat
    API's shape; one already in that shape passes as it is."""
    kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
    if kind != "function":
        raise InvalidRequestError(
            f"tools[{i}]: only function tools are supported (got {kind!r}); hosted tools need OpenAI's servers"
        )
    if "function" in tool:
        return tool
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def _message_of(item: dict[str, Any], i: int) -> dict[str, Any]:
    if "role" not in item:
        raise InvalidRequestError(f"input[{i}]: a message needs a role")
    role = "system" if item["role"] == "developer" else item["role"]
    if role not in ("system", "user", "assistant"):
        raise InvalidRequestError(f"input[{i}]: unknown role {item['role']!r}")
    return {"role": role, "content": _text_of(item.get("content"), i)}


def _call_of(item: dict[str, Any], i: int) -> dict[str, Any]:
    """A function_call item as a chat tool call (its arguments stay the model's JSON text)."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise InvalidRequestError(f"input[{i}]: a function_call needs call_id and name")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _text_of(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"input[{i}]: content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text", "refusal"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"input[{i}]: content parts of type {kind!r} are not supported (text only)")
        texts.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(texts)


def _usage(u: Any) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _item_status(finish: str | None) -> str:
    """An output item's status: "incomplete" when max_output_tokens cut it."""
    return "incomplete" if finish == "length" else "completed"


class _Shape:
    """The response object and its output items, as OpenAI writes them."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id, self.body, self.model, self.created = f"resp_{uuid.uuid4().hex}", body, model, now()

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        msg_id = f"msg_{uuid.uuid4().hex}"
        return {"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": content}

    def function_call(self, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def output(self, text: str, calls: list[dict[str, Any]], finish: str | None) -> list[dict[str, Any]]:
        """A whole answer's items: its text as a message (when there is text, or no call), then one per call."""
        items = [self.message(text, _item_status(finish))] if text.strip() or not calls else []
        for c in calls:
            items.append(self.function_call(c["id"], c["function"]["name"], c["function"]["arguments"], "completed"))
        return items

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
            "tools": b.tools or [],
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
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
        tools, tool_choice = body.chat_tools()
        kwargs = dict(
            sampling_params=body.sampling_params(),
            response_format=body.response_format(),
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            rid=shape.id,
        )
        messages = body.messages()
        if body.stream:
            stream = server.client.stream(messages, **kwargs)
            return await streamed_response(stream, _StreamedItems(shape), timer)
        out = await unless_disconnected(request, server.client.generate(messages, **kwargs))
    except BaseException as e:
        return fail(timer, e)
    o = out.outputs[0]
    timer.done(200, out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_tokens)
    items = shape.output(o.text, o.tool_calls or [], o.finish_reason)
    return JSONResponse(shape.response("completed", items, out.usage, o.finish_reason))


def _error_fields(e: BaseException) -> dict[str, Any]:
    """The fields of a Responses API "error" event."""
    err = api_error(e)
    return {"code": err.code or err.type, "message": err.message, "param": err.param}


class _StreamedItems(StreamWriter):
    """A streamed response's output items, each opened when its first text or call piece arrives and closed when
    the next item opens or the answer ends, written as OpenAI's events (sequence-numbered SSE, no [DONE]): created,
    in_progress, each item's events, then the final response or an error event."""

    def __init__(self, shape: _Shape) -> None:
        self.shape, self.seq = shape, 0
        self.items: list[dict[str, Any]] = []  # what the final response lists, in output order
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the daemon's tool-call index -> its item
        self.held = ""  # whitespace with no item open (between calls): sent only when text follows
        self.usage: Any = None  # the client's Usage, on the last chunk
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **fields})}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any]) -> list[str]:
        events = self.close("completed")
        self.items.append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        return events

    def _open_message(self) -> list[str]:
        events = self._add(self.shape.message(None, "in_progress"))
        where = self._where()
        events.append(self.event("response.content_part.added", part=self.shape.part(""), content_index=0, **where))
        self.open["content"] = [self.shape.part("")]
        return events

    def _text_delta(self, delta: str) -> str:
        self.open["content"][0]["text"] += delta
        return self.event("response.output_text.delta", delta=delta, logprobs=[], content_index=0, **self._where())

    def text(self, delta: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != "message":
            delta, self.held = self.held + delta, ""
            if not delta.strip():
                self.held = delta
                return events
            events += self._open_message()
        events.append(self._text_delta(delta))
        return events

    def call(self, delta: dict[str, Any]) -> list[str]:
        """One tool-call delta of the daemon's (OpenAI chat shape): the first of a call has its id and name."""
        events: list[str] = []
        fn = delta.get("function") or {}
        if delta.get("id"):
            self.held = ""
            item = self.shape.function_call(delta["id"], fn.get("name", ""), "", "in_progress")
            events += self._add(item)
            self.calls[delta["index"]] = item
        # A call's pieces all come before the next call starts (the parser reads the text in order).
        item, fragment = self.calls[delta["index"]], fn.get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            events.append(self.event("response.function_call_arguments.delta", delta=fragment, **self._where()))
        return events

    def close(self, status: str) -> list[str]:
        """The events that end the open item (none when no item is open)."""
        item, events = self.open, []
        if item is None:
            return events
        where = self._where()
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events.append(self.event("response.output_text.done", text=text, logprobs=[], content_index=0, **where))
            events.append(
                self.event("response.content_part.done", part=self.shape.part(text), content_index=0, **where)
            )
        else:
            done = dict(arguments=item["arguments"], name=item["name"])
            events.append(self.event("response.function_call_arguments.done", **done, **where))
        item["status"], self.open = status, None
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def finish(self, finish: str | None) -> list[str]:
        """The events that end the answer's items; an answer with no text and no call is one (empty) message."""
        events: list[str] = []
        if not self.items:
            events += self._open_message()
            if self.held:
                events.append(self._text_delta(self.held))
        return events + self.close(_item_status(finish))

    def start(self) -> list[str]:
        in_progress = self.shape.response("in_progress", [])
        return [
            self.event("response.created", response=in_progress),
            self.event("response.in_progress", response=in_progress),
        ]

    async def item(self, chunk: Any) -> list[str]:
        calls = chunk.tool_calls or []
        text_first = not calls or bool(calls[0].get("id"))  # a chunk's text precedes a call that starts in it
        events = self.text(chunk.text) if chunk.text and text_first else []
        for delta in calls:
            events += self.call(delta)
        events += self.text(chunk.text) if chunk.text and not text_first else []
        self.usage, self.finish_reason = chunk.usage or self.usage, chunk.finish_reason or self.finish_reason
        return events

    def end(self) -> list[str]:
        """The open item's closing events, then response.completed, or response.incomplete when max_output_tokens
        cut the answer (as OpenAI's API ends it)."""
        events = self.finish(self.finish_reason)
        final = self.shape.response("completed", self.items, self.usage, self.finish_reason)
        return [*events, self.event(f"response.{final['status']}", response=final)]

    def error(self, e: BaseException) -> str:
        return self.event("error", **_error_fields(e))

    def tokens(self) -> tuple[int, int, int]:
        u = self.usage
        return (0, 0, 0) if u is None else (u.prompt_tokens, u.completion_tokens, u.cached_tokens)

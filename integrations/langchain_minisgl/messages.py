"""LangChain messages in and out of minisgl: BaseMessages as the OpenAI-style chat dicts the daemon's chat templates
take, the daemon's Chunks as ChatGenerationChunks (and a whole ChatResult), LangChain's tool_choice and
structured-output schemas in OpenAI's terms."""

from __future__ import annotations

import json
from typing import Any, Sequence

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call as create_invalid_tool_call
from langchain_core.messages.tool import tool_call as create_tool_call
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool

from minisgl import Chunk, InvalidRequestError, Usage

PROVIDER = "minisgl"

# Content blocks that only repeat what tool_calls already say, or the model's own reasoning:
# dropped when an assistant turn is sent back.
_AI_ONLY_BLOCKS = frozenset({"tool_use", "tool_call", "tool_call_chunk", "thinking", "redacted_thinking", "reasoning"})


class MessageChunks:
    """Turns one request's Chunks into ChatGenerationChunks; the last carries usage and finish_reason."""

    def __init__(self, model: str) -> None:
        self.model = model

    def convert(self, chunk: Chunk) -> ChatGenerationChunk | None:
        calls = _tool_call_chunks(chunk.tool_calls or [])
        if not (chunk.text or chunk.reasoning or calls or chunk.done):
            return None
        metadata: dict[str, Any] = {"model_provider": PROVIDER}
        usage = None
        if chunk.done:
            metadata["model_name"] = self.model
            metadata["finish_reason"] = chunk.finish_reason  # "tool_calls" when it called tools (the daemon's rule)
            usage = _usage_metadata(chunk.usage)
        message = AIMessageChunk(
            content=chunk.text,
            # A daemon with --reasoning-parser: the <think> part, where langchain-deepseek puts it too.
            additional_kwargs={"reasoning_content": chunk.reasoning} if chunk.reasoning else {},
            tool_call_chunks=calls,
            usage_metadata=usage,
            response_metadata=metadata,
            chunk_position="last" if chunk.done else None,
        )
        return ChatGenerationChunk(message=message)


def chat_result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    """The whole answer. Unlike a merged stream, whose tool calls LangChain parses leniently (a call
    cut short by max_tokens keeps the arguments it got), a call is valid only if its arguments are
    a complete JSON object; the others are invalid_tool_calls."""
    merged = chunks[0].message + [c.message for c in chunks[1:]]
    tool_calls, invalid = [], []
    for call in merged.tool_call_chunks:
        try:
            args = json.loads(call["args"] or "{}")
        except json.JSONDecodeError as e:
            args, error = None, f"arguments are not valid JSON: {e}"
        else:
            error = None if isinstance(args, dict) else "arguments are not a JSON object"
        if error is None:
            tool_calls.append(create_tool_call(name=call["name"] or "", args=args, id=call["id"]))
        else:
            invalid.append(create_invalid_tool_call(name=call["name"], args=call["args"], id=call["id"], error=error))
    message = AIMessage(
        content=merged.content,
        additional_kwargs=merged.additional_kwargs,  # reasoning_content, when the daemon separates it
        tool_calls=tool_calls,
        invalid_tool_calls=invalid,
        usage_metadata=merged.usage_metadata,
        response_metadata=merged.response_metadata,
        id=merged.id,
    )
    return ChatResult(generations=[ChatGeneration(message=message)])


def _tool_call_chunks(deltas: list[dict[str, Any]]) -> list[Any]:
    """One tool_call_chunk per call index: a Chunk may hold several deltas of one call (its name and
    the first argument fragments), and LangChain only merges pieces of a call across messages."""
    calls: dict[Any, dict[str, Any]] = {}
    for delta in deltas:
        function = delta.get("function") or {}
        call = calls.setdefault(delta.get("index"), {"name": None, "args": "", "id": None})
        call["name"] = call["name"] or function.get("name")
        call["id"] = call["id"] or delta.get("id")
        call["args"] += function.get("arguments") or ""
    return [tool_call_chunk(index=index, **call) for index, call in calls.items()]


def _usage_metadata(usage: Usage | None) -> UsageMetadata:
    usage = usage or Usage(0, 0, 0)
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    return UsageMetadata(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=prompt + completion,
        input_token_details=InputTokenDetails(cache_read=usage.cached_tokens),
    )


def merge_stops(*groups: str | Sequence[str] | None) -> list[str]:
    """The stop strings of every group, once each; a plain string is one stop string (as OpenAI's stop)."""
    out: list[str] = []
    for group in groups:
        for s in [group] if isinstance(group, str) else group or []:
            if s not in out:
                out.append(s)
    return out


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the OpenAI-style dicts minisgl's chat templates take."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m, SystemMessage):
            d: dict[str, Any] = {"role": "system", "content": _text(m.content, i)}
        elif isinstance(m, HumanMessage):
            d = {"role": "user", "content": _text(m.content, i)}
        elif isinstance(m, AIMessage):
            d = {"role": "assistant", "content": _text(m.content, i, skip=_AI_ONLY_BLOCKS)}
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)},
                }
                for c in m.tool_calls
            ] + [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"] or ""}}
                for c in m.invalid_tool_calls
                if c.get("name")
            ]
            if calls:
                d["tool_calls"] = calls
        elif isinstance(m, ToolMessage):
            d = {"role": "tool", "content": _text(m.content, i), "tool_call_id": m.tool_call_id}
        elif isinstance(m, ChatMessage):
            d = {"role": m.role, "content": _text(m.content, i)}
        else:
            raise InvalidRequestError(f"messages[{i}]: {type(m).__name__} is not supported by ChatMiniSGL")
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def _text(content: str | list[Any], i: int, skip: frozenset[str] = frozenset()) -> str:
    """Message content as text; minisgl serves text models, so other media are an error."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text", ""))
        elif kind not in skip:
            raise InvalidRequestError(
                f"messages[{i}]: content blocks of type {kind!r} are not supported: minisgl models take text only"
            )
    return "".join(parts)


def tool_choice_of(choice: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any] | None:
    """LangChain's tool_choice in OpenAI's terms ("any" → "required", a name → that function)."""
    names = [t["function"]["name"] for t in tools]
    if choice is None or isinstance(choice, dict):
        return choice
    if choice is True:
        return {"type": "function", "function": {"name": names[0]}} if len(names) == 1 else "required"
    if choice is False:
        return "none"
    if choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, str) and choice in names:
        return {"type": "function", "function": {"name": choice}}
    raise InvalidRequestError(
        f"tool_choice must be 'auto', 'none', 'required', 'any', True, a bound tool's name {names} "
        f"or an OpenAI tool_choice dict; got {choice!r}"
    )


def json_schema_of(schema: dict[str, Any] | type, strict: bool | None) -> tuple[str, dict[str, Any]]:
    """(name, JSON schema) of a structured-output schema; a plain JSON schema dict is used as is."""
    if (
        isinstance(schema, dict)
        and "function" not in schema
        and ("properties" in schema or schema.get("type") == "object")
    ):
        return str(schema.get("title") or "response"), schema
    function = convert_to_openai_tool(schema, strict=strict)["function"]
    return function["name"], function["parameters"]

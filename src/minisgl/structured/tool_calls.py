"""What a tool-call parser emits: whole calls, streamed call pieces, and the folds between them."""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple


class ToolCall(NamedTuple):
    id: str  # "call_<24 hex>"
    name: str
    arguments: str  # JSON text of the arguments object

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ParsedToolOutput(NamedTuple):
    content: str | None  # text outside calls; None when it is empty or only whitespace
    tool_calls: list[ToolCall]


class ToolCallDelta(NamedTuple):
    """One streamed piece of a call: the first has id and name (arguments ""), later ones carry
    argument fragments only."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {} if self.name is None else {"name": self.name}
        function["arguments"] = self.arguments
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        out["function"] = function
        return out


class Delta(NamedTuple):
    """One streamed event: a content fragment or a tool-call piece."""

    content: str | None = None
    tool_call: ToolCallDelta | None = None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat.completion.chunk choices[i].delta."""
        if self.tool_call is not None:
            return {"tool_calls": [self.tool_call.to_openai()]}
        return {"content": self.content}


def split_deltas(deltas: list[Delta]) -> tuple[str, list[dict[str, Any]] | None]:
    """A batch of deltas as one stream chunk: (content text, OpenAI tool_call deltas or None), one tool_call
    delta per call index (a call's pieces merged, its arguments joined), as OpenAI's chunks carry them: the
    openai SDK's stream accumulator takes two entries of one index for two calls."""
    text = "".join(d.content for d in deltas if d.content is not None)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.tool_call is None:
            continue
        piece = d.tool_call.to_openai()
        call = calls.setdefault(piece["index"], piece)
        if call is not piece:  # a later piece of the call: only argument text (id and name come with the first)
            call["function"]["arguments"] += piece["function"]["arguments"]
    return text, [calls[i] for i in sorted(calls)] or None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def assemble(deltas: list[Delta]) -> ParsedToolOutput:
    """Fold streamed deltas into the non-streaming result."""
    content = "".join(d.content for d in deltas if d.content is not None)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        tc = d.tool_call
        if tc is None:
            continue
        if tc.index not in calls:
            calls[tc.index] = [tc.id or "", tc.name or "", ""]
        calls[tc.index][2] += tc.arguments
    return ParsedToolOutput(
        content if content.strip() else None,
        [ToolCall(*calls[i]) for i in sorted(calls)],
    )

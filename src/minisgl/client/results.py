"""A request's result, folded from its chunks: GenerateResult (per sample: text, token ids, tool calls, logprobs,
finish reason; usage) and Embedding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.core import CompletionOutput, FirstOutputShortcuts
from minisgl.runtime.protocol import Chunk, ProtocolError, Usage


@dataclass
class GenerateResult(FirstOutputShortcuts):
    """A finished request: outputs[i] is sample i (n > 1); the shortcuts read outputs[0]."""

    rid: str
    outputs: list[CompletionOutput]
    usage: Usage
    prompt_logprobs: list[dict[str, Any]] | None = None  # with SamplingParams.prompt_logprobs (see Chunk)

    @property
    def matched_stop(self) -> str | int | None:
        return self.outputs[0].matched_stop

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return self.outputs[0].tool_calls

    @property
    def logprobs(self) -> list[dict[str, Any]] | None:
        return self.outputs[0].logprobs


@dataclass
class Embedding:
    """An embedding request's answer: the prompt's last hidden state (after the final norm, L2-normalised)."""

    embedding: list[float]
    prompt_tokens: int


def embedding_of(chunks: list[Chunk]) -> Embedding:
    vector = next((c.embedding for c in chunks if c.embedding is not None), None)
    usage = next((c.usage for c in chunks if c.usage is not None), None)
    if vector is None or usage is None:
        raise ProtocolError("the daemon answered an embedding request without a vector")
    return Embedding(list(vector), usage.prompt_tokens)


def merge_tool_calls(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Fold OpenAI-style tool-call deltas (by "index": name first, argument fragments after) into calls."""
    for delta in deltas:
        index = delta.get("index")
        if index is None or index >= len(calls):
            call = {k: v for k, v in delta.items() if k != "index"}
            call["function"] = dict(call.get("function") or {})
            call["function"].setdefault("arguments", "")
            calls.append(call)
            continue
        call = calls[index]
        for key in ("id", "type"):
            if delta.get(key):
                call[key] = delta[key]
        fn = delta.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] = fn["name"]
        call["function"]["arguments"] = call["function"].get("arguments", "") + (fn.get("arguments") or "")


class ResultBuilder:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.outputs: dict[int, CompletionOutput] = {}
        self.usage = Usage(0, 0, 0)
        self.prompt_logprobs: list[dict[str, Any]] | None = None

    def add(self, chunk: Chunk) -> None:
        out = self.outputs.setdefault(chunk.index, CompletionOutput(chunk.index))
        out.text += chunk.text
        if chunk.reasoning:
            out.reasoning_content = (out.reasoning_content or "") + chunk.reasoning
        out.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            out.logprobs = (out.logprobs or []) + chunk.logprobs
        if chunk.tool_calls:
            out.tool_calls = out.tool_calls or []
            merge_tool_calls(out.tool_calls, chunk.tool_calls)
        if chunk.finish_reason is not None:
            out.finish_reason, out.matched_stop = chunk.finish_reason, chunk.matched_stop
            out.finish_detail = chunk.finish_detail
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs

    def result(self) -> GenerateResult:
        return GenerateResult(
            self.rid, [self.outputs[i] for i in sorted(self.outputs)], self.usage, self.prompt_logprobs
        )

"""Structured output: grammar-constrained decoding (xgrammar) and OpenAI-style tool calling."""

from __future__ import annotations

from minisgl.structured.grammar import (
    JSON_OBJECT_SCHEMA,
    GrammarBackend,
    GrammarState,
    accept_tokens,
    apply_bitmask,
    fill_bitmask,
    grammar_key,
)
from minisgl.structured.parsers import (
    Delta,
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedToolOutput,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    get_tool_parser,
    split_deltas,
)
from minisgl.structured.tools import (
    HERMES,
    LLAMA3_JSON,
    ToolChoice,
    normalize_tools,
    render_tools_prompt,
    resolve_tool_choice,
    tool_call_constraint,
)

__all__ = [
    "JSON_OBJECT_SCHEMA",
    "GrammarBackend",
    "GrammarState",
    "accept_tokens",
    "apply_bitmask",
    "fill_bitmask",
    "grammar_key",
    "Delta",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ParsedToolOutput",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "get_tool_parser",
    "split_deltas",
    "HERMES",
    "LLAMA3_JSON",
    "ToolChoice",
    "normalize_tools",
    "render_tools_prompt",
    "resolve_tool_choice",
    "tool_call_constraint",
]

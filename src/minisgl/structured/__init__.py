"""Structured output: grammar-constrained decoding (xgrammar) and OpenAI-style tool calling.

The names below load with their module on first use: the HTTP server parses tool calls and checks schemas
without importing torch and xgrammar, which only grammar-constrained decoding (the scheduler) needs."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "JSON_OBJECT_SCHEMA": "minisgl.structured.grammar",
    "GrammarBackend": "minisgl.structured.grammar",
    "GrammarState": "minisgl.structured.grammar",
    "accept_tokens": "minisgl.structured.grammar",
    "apply_bitmask": "minisgl.structured.grammar",
    "fill_bitmask": "minisgl.structured.grammar",
    "grammar_key": "minisgl.structured.grammar",
    "Delta": "minisgl.structured.parsers",
    "HermesToolParser": "minisgl.structured.parsers",
    "Llama3JsonToolParser": "minisgl.structured.parsers",
    "ParsedToolOutput": "minisgl.structured.parsers",
    "StreamingToolParser": "minisgl.structured.parsers",
    "ToolCall": "minisgl.structured.parsers",
    "ToolCallDelta": "minisgl.structured.parsers",
    "get_tool_parser": "minisgl.structured.parsers",
    "split_deltas": "minisgl.structured.parsers",
    "HERMES": "minisgl.structured.tools",
    "LLAMA3_JSON": "minisgl.structured.tools",
    "ToolChoice": "minisgl.structured.tools",
    "normalize_tools": "minisgl.structured.tools",
    "render_tools_prompt": "minisgl.structured.tools",
    "resolve_tool_choice": "minisgl.structured.tools",
    "tool_call_constraint": "minisgl.structured.tools",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minisgl.structured' has no attribute {name!r}")

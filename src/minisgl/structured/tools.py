"""OpenAI-style tool calling without a model server: validate tools and tool_choice, render the
prompt, and build the grammar that forces a call when tool_choice demands one.

A request with tools goes: normalize_tools -> resolve_tool_choice -> render_tools_prompt (the
prompt) + tool_call_constraint ({"ebnf": ...} to merge into SamplingParams, or None) -> generate ->
a parser from minisgl.structured.parsers turns the text back into tool calls.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Literal, NamedTuple, Sequence

from minisgl.errors import GrammarError, InvalidRequestError
from minisgl.structured.schema import check_json_schema

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"

ToolChoiceMode = Literal["auto", "none", "required", "named"]

# Names end up verbatim inside JSON strings and grammar literals: keep them to safe characters.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_TOOL_ROLE_IN_TEMPLATE = re.compile(r"""==\s*['"]tool['"]""")

_HERMES_SYSTEM = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ToolChoice(NamedTuple):
    """A resolved tool_choice: mode, and the function name when mode == "named"."""

    mode: ToolChoiceMode
    name: str | None = None


def normalize_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """Validate tools and return them in OpenAI's shape:
    [{"type": "function", "function": {"name", "description"?, "parameters"}}].

    Bare function dicts ({"name": ..., "parameters": ...}) are accepted and wrapped. A missing
    parameters schema means "no arguments". Raises InvalidRequestError on malformed tools.
    """
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError(f"tools must be a list of function tools, got {type(tools).__name__}")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"tools[{i}] must be an object, got {type(tool).__name__}")
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise InvalidRequestError(f"tools[{i}].type must be 'function', got {tool.get('type')!r}")
            function = tool["function"]
        elif "name" in tool and tool.get("type", "function") == "function":
            function = {k: v for k, v in tool.items() if k != "type"}
        else:
            raise InvalidRequestError(f'tools[{i}] must look like {{"type": "function", "function": {{"name": ...}}}}')
        if not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}].function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise InvalidRequestError(
                f"tools[{i}].function.name must be 1-128 characters of letters, digits, '_', '-', '.', ':'; "
                f"got {name!r}"
            )
        if name in seen:
            raise InvalidRequestError(f"tools[{i}]: duplicate function name {name!r}")
        seen.add(name)
        params = function.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        try:
            check_json_schema(params)
        except GrammarError as e:
            raise InvalidRequestError(f"tools[{i}] ({name}): {e}") from e
        spec: dict[str, Any] = {"name": name}
        if function.get("description") is not None:
            spec["description"] = str(function["description"])
        spec["parameters"] = params
        out.append({"type": "function", "function": spec})
    return out


def resolve_tool_choice(tool_choice: Any, tools: Sequence[dict[str, Any]]) -> ToolChoice:
    """Resolve OpenAI's tool_choice against normalized tools.

    Accepts "auto" | "none" | "required" | {"type": "function", "function": {"name": N}} |
    {"type": "function", "name": N} | a bare function name. None means "auto" with tools, "none"
    without. A named function missing from tools raises GrammarError; a malformed value or
    "required" without tools raises InvalidRequestError.
    """
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("auto", "none"):
        return ToolChoice(tool_choice)
    if tool_choice == "required":
        if not tools:
            raise InvalidRequestError("tool_choice='required' needs a non-empty tools list")
        return ToolChoice("required")
    if isinstance(tool_choice, dict):
        if tool_choice.get("type", "function") != "function":
            raise InvalidRequestError(f"tool_choice.type must be 'function', got {tool_choice.get('type')!r}")
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
    elif isinstance(tool_choice, str):
        name = tool_choice
    else:
        raise InvalidRequestError(f"tool_choice must be a string or an object, got {type(tool_choice).__name__}")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise GrammarError(f"tool_choice names function {name!r}, which is not in tools (have: {names})")
    return ToolChoice("named", name)


def tool_call_constraint(
    tools: Sequence[dict[str, Any]],
    tool_choice: ToolChoice | Any,
    parser_format: str = HERMES,
    *,
    parallel_tool_calls: bool = True,
    max_whitespace_cnt: int | None = None,
) -> dict[str, str] | None:
    """The SamplingParams fields that force tool calls ({"ebnf": grammar}), or None when the model
    may answer freely ("auto"/"none").

    "required": one or more calls (one when parallel_tool_calls is False) of any tool; "named":
    exactly one call of that tool. Hermes: <tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>
    separated by newlines; llama3_json: {"name": N, "parameters": ARGS} separated by "; ". ARGS
    follows the tool's parameters schema. Built from an xgrammar structural tag.
    """
    import xgrammar as xgr  # lazy: xgrammar loads torch

    tools = normalize_tools(tools)
    choice = tool_choice if isinstance(tool_choice, ToolChoice) else resolve_tool_choice(tool_choice, tools)
    if choice.mode in ("auto", "none"):
        return None
    if parser_format == HERMES:
        begin, end, separator, args_key = "<tool_call>\n", "}\n</tool_call>", "\n", "arguments"
    elif parser_format == LLAMA3_JSON:
        begin, end, separator, args_key = "", "}", "; ", "parameters"
    else:
        raise InvalidRequestError(f"unknown tool-call format {parser_format!r}; use {HERMES!r} or {LLAMA3_JSON!r}")

    def tag(tool: dict[str, Any]) -> dict[str, Any]:
        fn = tool["function"]
        return {
            "type": "tag",
            "begin": f'{begin}{{"name": "{fn["name"]}", "{args_key}": ',
            "content": {
                "type": "json_schema",
                "json_schema": fn["parameters"],
                "max_whitespace_cnt": max_whitespace_cnt,
            },
            "end": end,
        }

    if choice.mode == "named":
        fmt: dict[str, Any] = tag(next(t for t in tools if t["function"]["name"] == choice.name))
    else:
        fmt = {
            "type": "tags_with_separator",
            "tags": [tag(t) for t in tools],
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": not parallel_tool_calls,
        }
    try:
        grammar = xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt})
    except Exception as e:
        raise GrammarError(f"cannot build the tool-call grammar: {e}") from e
    return {"ebnf": str(grammar)}


def template_supports_tools(tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None) -> bool:
    """Whether the tokenizer's chat template renders tools itself (it mentions 'tools')."""
    try:
        template = tokenizer.get_chat_template(tools=list(tools) if tools else None)
    except (ValueError, AttributeError):
        return False
    return isinstance(template, str) and "tools" in template


def render_tools_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[Any] | None,
    add_generation_prompt: bool = True,
    tool_choice: Any = "auto",
    **template_kwargs: Any,
) -> str:
    """The prompt text for a chat with tools.

    The model's own template renders the tools when it knows how (it mentions 'tools'); otherwise
    a Hermes/Qwen-style system block lists them in <tools></tools> and asks for <tool_call> JSON,
    past assistant tool_calls become <tool_call> text and tool results become <tool_response>
    blocks in a user turn (or a tool turn when the template has a tool role). With
    tool_choice="none" the tools are left out of the prompt.
    """
    norm = normalize_tools(tools)
    choice = resolve_tool_choice(tool_choice, norm)
    prompt_tools = norm if choice.mode != "none" else []
    msgs = [_normalize_message(m, i) for i, m in enumerate(messages)]
    if template_supports_tools(tokenizer, prompt_tools or None):
        return _apply_template(tokenizer, msgs, prompt_tools or None, add_generation_prompt, template_kwargs)
    template = ""
    try:
        template = tokenizer.get_chat_template()
    except (ValueError, AttributeError):
        pass
    has_tool_role = isinstance(template, str) and bool(_TOOL_ROLE_IN_TEMPLATE.search(template))
    msgs = _hermes_messages(msgs, prompt_tools, has_tool_role)
    return _apply_template(tokenizer, msgs, None, add_generation_prompt, template_kwargs)


def _apply_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except ValueError as e:
        raise InvalidRequestError(f"cannot render the chat: {e}") from e
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template did not render to text")
    return text


def _content_text(content: Any) -> str:
    """Message content as text: None -> "", OpenAI content parts -> their text joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _normalize_message(message: dict[str, Any], i: int) -> dict[str, Any]:
    """A copy with text content and tool-call arguments as objects (what HF templates expect)."""
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidRequestError(f"messages[{i}] must be an object with a 'role'")
    m = copy.deepcopy(message)
    m["content"] = _content_text(m.get("content"))
    calls = m.get("tool_calls")
    if calls:
        for call in calls:
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(f"messages[{i}].tool_calls entries need function.name")
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    pass  # keep the model's raw text; templates print strings as-is
            elif args is None:
                fn["arguments"] = {}
    return m


def _hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], has_tool_role: bool
) -> list[dict[str, Any]]:
    """Rewrite a chat with tools into plain system/user/assistant turns, Hermes style."""
    out: list[dict[str, Any]] = []
    if tools:
        block = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            first = messages[0]["content"]
            out.append({"role": "system", "content": f"{first}\n\n{block}" if first else block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    merging_responses = False
    for m in messages:
        role = m["role"]
        if role == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if has_tool_role:
                out.append({"role": "tool", "content": m["content"]})
            elif merging_responses:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
                merging_responses = True
            continue
        merging_responses = False
        if role == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                args = fn["arguments"]
                args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                call_json = f'{{"name": {json.dumps(fn["name"])}, "arguments": {args_text}}}'
                parts.append(f"<tool_call>\n{call_json}\n</tool_call>")
            out.append({"role": "assistant", "content": "\n".join(parts)})
            continue
        out.append({"role": role, "content": m["content"]})
    return out

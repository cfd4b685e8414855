"""The limits of one request (EngineConfig's max_n, max_stop_strings, ...): past one, a typed error (HTTP 400).

They keep one request from stalling the others: every sequence of `n` decodes, every stop string is searched on
every token, every tool is rendered into the prompt, a schema is walked by recursive code, and every character is
tokenized (max_request_chars; max_chars_per_token bounds a text against the context window before it is).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping, NamedTuple

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequestError, PromptTooLongError

_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


class RequestLimits(NamedTuple):
    max_n: int = _DEFAULTS["max_n"]
    max_stop_strings: int = _DEFAULTS["max_stop_strings"]
    max_stop_string_len: int = _DEFAULTS["max_stop_string_len"]
    max_tools: int = _DEFAULTS["max_tools"]
    max_schema_depth: int = _DEFAULTS["max_schema_depth"]
    max_request_chars: int = _DEFAULTS["max_request_chars"]
    max_chars_per_token: int | None = _DEFAULTS["max_chars_per_token"]

    @classmethod
    def from_config(cls, config: EngineConfig | Mapping[str, Any]) -> "RequestLimits":
        """The limits of an EngineConfig, or of its to_dict() (what the daemon's workers get)."""
        get = config.get if isinstance(config, Mapping) else lambda name, default: getattr(config, name, default)
        return cls(*(get(name, default) for name, default in zip(cls._fields, cls._field_defaults.values())))

    def check_params(self, params: SamplingParams) -> None:
        if params.n > self.max_n:
            raise InvalidRequestError(f"n={params.n} is more sequences than this server allows (max_n={self.max_n})")
        if len(params.stop) > self.max_stop_strings:
            raise InvalidRequestError(
                f"{len(params.stop)} stop strings are more than this server allows "
                f"(max_stop_strings={self.max_stop_strings})"
            )
        longest = max((len(s) for s in params.stop), default=0)
        if longest > self.max_stop_string_len:
            raise InvalidRequestError(
                f"a stop string of {longest} characters is longer than this server allows "
                f"(max_stop_string_len={self.max_stop_string_len})"
            )

    def check_tools(self, tools: Any) -> None:
        """Before a tool is rendered or its schema walked: their number and how deeply each nests."""
        from minisgl.structured.grammar import check_schema_shape  # xgrammar and torch: only when tools come

        if not isinstance(tools, (list, tuple)):
            return  # normalize_tools says what is wrong with it
        if len(tools) > self.max_tools:
            raise InvalidRequestError(
                f"{len(tools)} tools are more than this server allows (max_tools={self.max_tools})"
            )
        for i, tool in enumerate(tools):
            check_schema_shape(tool, f"tools[{i}]", self.max_schema_depth)

    def check_schema(self, schema: Any, what: str) -> None:
        from minisgl.structured.grammar import check_schema_shape  # xgrammar and torch: only when a schema comes

        check_schema_shape(schema, what, self.max_schema_depth)

    def check_request_chars(self, *parts: Any) -> None:
        """Before anything is rendered or tokenized: the characters the request carries (text_chars of its parts)."""
        if text_chars(parts, self.max_request_chars) > self.max_request_chars:
            raise PromptTooLongError(
                f"the request carries more than {self.max_request_chars} characters (its prompt or token ids, "
                "messages and tools): shorten it, or raise the server's max_request_chars"
            )


def text_chars(value: Any, limit: int) -> int:
    """The characters of the strings in value (lists and dicts walked, keys included), counted until past `limit`.

    Every item counts at least one (a token id, an empty string, a list itself), so the walk takes at most `limit`
    steps and stops there.
    """
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += max(chars_of(item), 1)
        elif isinstance(item, (list, tuple, dict)):
            total += 1
            if len(item) > limit - total:  # each element counts at least one: past the limit without a look
                return limit + 1
            stack.extend(item.items() if isinstance(item, dict) else item)
        else:
            total += 1
    return total


_UTF8_CONTINUATION = bytes(range(0x80, 0xC0))


def chars_of(text: str | bytes) -> int:
    """The characters of a str, or of UTF-8 bytes (a message's text before it is decoded): every byte but the
    continuation bytes starts one."""
    return len(text) if isinstance(text, str) else len(text.translate(None, _UTF8_CONTINUATION))

"""Tool-call parsers: turn generated text back into OpenAI tool calls, whole or while streaming.

Formats:
- hermes (Hermes, Qwen2.5, Qwen3, Mistral fallback): <tool_call>{"name": N, "arguments": {...}}</tool_call>,
  any number of them, anywhere in the text; the rest is content, less the template's tags (<tool_call>,
  </tool_call>, <tool_response>, </tool_response>: a malformed call's text stays, its tags go).
- llama3_json (Llama 3.1/3.2 JSON tool calling): the output starts with {"name": N, "parameters": {...}}
  (optionally after <|python_tag|>), several separated by ";"; text after the last call is content.

One parser instance follows one response: feed(delta) -> deltas, then finish(). parse(text) runs
the same machine over the whole text, so streamed deltas concatenate to parse(text) for every
output in which each call is well formed or breaks before its arguments start. (A call whose
arguments are cut short or corrupted after the name was streamed cannot be unstreamed; streaming
then ends that call with what it sent, while parse leaves the text as content.)

A call's arguments are the model's own JSON text of the arguments object (not re-serialised), so
the streamed fragments and the final string agree byte for byte. Malformed calls stay in content (hermes: untagged).
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from minisgl.errors import ConfigError
from minisgl.structured.tool_calls import (
    Delta,
    ParsedToolOutput,
    ToolCall,
    ToolCallDelta,
    assemble,
    new_call_id,
    split_deltas,
)

# The value types live in tool_calls; they stay importable from here, where the parsers produce them.
__all__ = [
    "PARSERS",
    "Delta",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ParsedToolOutput",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "assemble",
    "get_tool_parser",
    "new_call_id",
    "partial_suffix",
    "split_deltas",
]


# Canonical call prefix: name first, then the arguments object; the header can stream once seen.
_CANON = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
# Characters JSON allows outside strings; anything else (e.g. the "<" of a closing tag) ends the object.
_JSON_BARE = frozenset(" \t\n\r{}[],:.+-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_WS = re.compile(r"\s*")

_OPEN, _COMPLETE, _BAD = 0, 1, 2


class _Call:
    """One call being read: an incremental scan of its JSON object inside the parser's buffer."""

    __slots__ = (
        "prefix",
        "start",
        "pos",
        "depth",
        "in_str",
        "esc",
        "end",
        "status",
        "canon_name",
        "args_start",
        "args_end",
        "sent_to",
        "index",
        "id",
    )

    def __init__(self, prefix: str, start: int) -> None:
        self.prefix = prefix  # raw text before the object (tag, separators): content if the call is malformed
        self.start = start  # buffer index of "{"
        self.pos = start  # next buffer index to scan
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.end = -1  # buffer index just past the object's "}"
        self.status = _OPEN
        self.canon_name: str | None = None
        self.args_start = -1
        self.args_end = -1  # buffer index just past the arguments object
        self.sent_to = -1  # buffer index up to which argument text was streamed
        self.index = -1  # OpenAI index once the header was sent
        self.id = ""

    def advance(self, buf: str) -> int:
        if self.status != _OPEN:
            return self.status
        if self.canon_name is None:
            m = _CANON.match(buf, self.start)
            if m is not None:
                try:
                    self.canon_name = json.loads(f'"{m.group(1)}"')
                    self.args_start = m.end()
                except json.JSONDecodeError:
                    pass
        i, n = self.pos, len(buf)
        depth, in_str, esc = self.depth, self.in_str, self.esc
        while i < n:
            c = buf[i]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c == "{" or c == "[":
                depth += 1
            elif c == "}" or c == "]":
                depth -= 1
                if depth == 1 and self.args_end < 0:
                    self.args_end = i + 1
                if depth == 0:
                    i += 1
                    self.end = i
                    self.status = _COMPLETE
                    break
            elif c not in _JSON_BARE:
                self.status = _BAD
                break
            i += 1
        self.pos, self.depth, self.in_str, self.esc = i, depth, in_str, esc
        if self.canon_name is None or self.args_start < 0:
            self.args_end = -1  # only meaningful when the arguments object opened at depth 2
        return self.status

    def decide(self, buf: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) if this is a call, else None.

        A complete object with a string name and an object (or JSON-object string) under
        "arguments"/"parameters" is a call; so is a canonical prefix followed by a complete, valid
        arguments object even when what follows it is broken, which keeps parse() in step with
        what streaming already sent.
        """
        canon_args = self._canon_args(buf)
        if self.status == _COMPLETE:
            try:
                obj = json.loads(buf[self.start : self.end])
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                name = obj.get("name")
                key = "arguments" if "arguments" in obj else "parameters"
                args = obj.get(key)
                if isinstance(name, str) and name and key in obj:
                    if canon_args is not None and name == self.canon_name and isinstance(args, dict):
                        return name, canon_args
                    if isinstance(args, dict):
                        return name, json.dumps(args, ensure_ascii=False)
                    if isinstance(args, str) and _is_json_object(args):
                        return name, args
        if canon_args is not None and self.canon_name:
            return self.canon_name, canon_args
        return None

    def _canon_args(self, buf: str) -> str | None:
        if self.canon_name is None or self.args_end < 0:
            return None
        text = buf[self.args_start : self.args_end]
        return text if _is_json_object(text) else None

    @property
    def resume(self) -> int:
        """Buffer index where parsing continues after this call."""
        return self.end if self.status == _COMPLETE else self.pos


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (to hold back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class StreamingToolParser:
    """Base of the tool-call parsers: per-response streaming state and the shared call reader."""

    name: ClassVar[str] = ""

    def __init__(self, *, incremental: bool = True) -> None:
        self._incremental = incremental  # False: emit a call only once decided (parse())
        self._buf = ""
        self._state = 0
        self._call: _Call | None = None
        self._num_calls = 0
        self._out: list[Delta] = []
        self._held_ws = ""  # leading whitespace: content only if real text follows
        self._seen_text = False

    @classmethod
    def parse(cls, text: str) -> ParsedToolOutput:
        """Split a whole response into content and tool calls."""
        parser = cls(incremental=False)
        return assemble(parser.feed(text) + parser.finish())

    def feed(self, delta_text: str) -> list[Delta]:
        """Consume the next piece of generated text; return the deltas it completes."""
        self._buf += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        """End of generation: flush everything still held back."""
        self._advance(final=True)
        return self._take()

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    # ---- output ----------------------------------------------------------------------------

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if not self._seen_text:
            if not text.strip():
                self._held_ws += text
                return
            text, self._held_ws, self._seen_text = self._held_ws + text, "", True
        if self._out and self._out[-1].tool_call is None:
            self._out[-1] = Delta(content=self._out[-1].content + text)  # type: ignore[operator]
        else:
            self._out.append(Delta(content=text))

    def _emit_args(self, call: _Call, upto: int) -> None:
        if upto <= call.sent_to:
            return
        fragment = self._buf[call.sent_to : upto]
        call.sent_to = upto
        last = self._out[-1].tool_call if self._out else None
        if last is not None and last.index == call.index and last.id is None:
            self._out[-1] = Delta(tool_call=last._replace(arguments=last.arguments + fragment))
        else:
            self._out.append(Delta(tool_call=ToolCallDelta(call.index, None, None, fragment)))

    def _send_header(self, call: _Call, name: str) -> None:
        if call.index >= 0:
            return
        call.index, call.id = self._num_calls, new_call_id()
        self._num_calls += 1
        self._out.append(Delta(tool_call=ToolCallDelta(call.index, call.id, name, "")))

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    # ---- the call reader -------------------------------------------------------------------

    def _stream_partial(self, call: _Call) -> None:
        """Mid-call: send the header and the argument text seen so far (canonical calls only)."""
        if not self._incremental or call.canon_name is None or not call.canon_name:
            return
        self._send_header(call, call.canon_name)
        if call.sent_to < 0:
            call.sent_to = call.args_start
        self._emit_args(call, call.args_end if call.args_end > 0 else call.pos)

    def _read_call(self, final: bool) -> bool | None:
        """Advance the current call. None: need more text. True: it was a call (sent; the buffer now
        starts after it). False: malformed (its prefix went to content; the buffer is unchanged)."""
        call = self._call
        assert call is not None
        status = call.advance(self._buf)
        if status == _OPEN and not final:
            self._stream_partial(call)
            return None
        result = call.decide(self._buf)
        if result is None and call.index < 0:
            self._emit_content(call.prefix)
            self._buf = self._buf[call.start :]
            self._call = None
            return False
        if result is not None:
            self._send_header(call, result[0])
            if call.sent_to < 0:
                self._out.append(Delta(tool_call=ToolCallDelta(call.index, None, None, result[1])))
            else:
                self._emit_args(call, call.args_end)
        # A call whose header was streamed ends here even if it turned out broken (see module doc).
        self._buf = self._buf[call.resume :] if status != _OPEN else ""
        self._call = None
        return True


_TEXT, _CALL, _SKIP, _AFTER_CALL = 0, 1, 2, 3


class HermesToolParser(StreamingToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks anywhere in the output."""

    name: ClassVar[str] = "hermes"
    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"
    # Template markup a small model echoes (its prompt wraps tool results in these): never content.
    STRAY: ClassVar[tuple[str, ...]] = ("</tool_call>", "<tool_response>", "</tool_response>")

    def _advance(self, final: bool) -> None:
        start, end = self.START, self.END
        while True:
            buf = self._buf
            if self._state == _TEXT or self._state == _SKIP:
                opener = start if self._state == _TEXT else end
                tags = (opener, *self.STRAY)
                found = [(buf.find(tag), tag) for tag in tags if tag in buf]
                if not found:
                    keep = 0 if final else max(partial_suffix(buf, tag) for tag in tags)
                    self._emit_content(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return
                i, tag = min(found)
                self._emit_content(buf[:i])
                self._buf = buf[i + len(tag) :]
                if tag == opener:  # else a stray template tag, dropped
                    self._state, self._call = (_CALL, _Call("", -1)) if self._state == _TEXT else (_TEXT, None)
            elif self._state == _CALL:
                call = self._call
                assert call is not None
                if call.start < 0:
                    j = _WS.match(buf).end()
                    if j == len(buf) and not final:
                        return
                    if j == len(buf) or buf[j] != "{":
                        self._emit_content(call.prefix)  # not JSON: the block's text is content
                        self._state, self._call = _SKIP, None
                        continue
                    call.prefix += buf[:j]
                    self._buf = buf = buf[j:]
                    call.start = call.pos = 0
                outcome = self._read_call(final)
                if outcome is None:
                    return
                self._state = _AFTER_CALL if outcome else _SKIP
            else:  # after a call: skip whitespace and the closing tag; anything else is text again
                j = _WS.match(buf).end()
                rest = buf[j:]
                if rest.startswith(end):
                    self._buf, self._state = rest[len(end) :], _TEXT
                elif rest and not end.startswith(rest):
                    self._buf, self._state = rest, _TEXT
                elif final:
                    self._buf, self._state = "", _TEXT
                else:
                    return


_START, _BETWEEN, _CONTENT = 0, 2, 3


class Llama3JsonToolParser(StreamingToolParser):
    """Llama 3.1 JSON calls: the output is {"name": ..., "parameters": {...}}[; {...}]*,
    optionally after <|python_tag|>; otherwise it is plain content."""

    name: ClassVar[str] = "llama3_json"
    PYTHON_TAG: ClassVar[str] = "<|python_tag|>"

    def _advance(self, final: bool) -> None:
        tag = self.PYTHON_TAG
        while True:
            buf = self._buf
            if self._state == _CONTENT:
                self._emit_content(buf)
                self._buf = ""
                return
            if self._state == _CALL:
                outcome = self._read_call(final)
                if outcome is None:
                    return
                self._state = _BETWEEN if outcome else _CONTENT
                continue
            j = _WS.match(buf).end()
            if self._state == _START:
                rest = buf[j:]
                if rest.startswith(tag):
                    j = _WS.match(buf, j + len(tag)).end()
                elif rest and tag.startswith(rest) and not final:
                    return
            elif j < len(buf) and buf[j] == ";":  # _BETWEEN: an optional ";" before the next call
                j = _WS.match(buf, j + 1).end()
            if j == len(buf):
                if final:
                    # Trailing whitespace or separators after the last call are dropped.
                    self._state = _CONTENT if self._state == _START else _BETWEEN
                    if self._state == _CONTENT:
                        continue
                    self._buf = ""
                return
            if buf[j] == "{":
                self._call = _Call(buf[:j], j)
                self._state = _CALL
            else:
                self._state = _CONTENT


PARSERS: dict[str, type[StreamingToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "qwen25": HermesToolParser,
    "qwen3": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama3": Llama3JsonToolParser,
    "llama": Llama3JsonToolParser,
}


def get_tool_parser(
    name_or_family: str | None, model_type: str = "", chat_template: str | None = None
) -> type[StreamingToolParser]:
    """The parser class for a model.

    An explicit name (a key of PARSERS, e.g. "hermes" or "llama3_json") wins. Otherwise: a llama
    model whose chat template speaks Llama 3.1 tool calling (mentions <|python_tag|> or ipython)
    gets llama3_json; everything else (qwen2, qwen3, mistral, unknown) gets hermes, which is also
    the format render_tools_prompt's fallback asks for.
    """
    if name_or_family:
        key = name_or_family.lower().replace("-", "_")
        if key not in PARSERS:
            raise ConfigError(f"unknown tool-call parser {name_or_family!r}; choose one of {sorted(PARSERS)}")
        return PARSERS[key]
    template = chat_template or ""
    if model_type.lower().startswith("llama") and ("<|python_tag|>" in template or "ipython" in template):
        return Llama3JsonToolParser
    return HermesToolParser

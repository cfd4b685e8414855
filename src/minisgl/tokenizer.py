"""Tokenizer loading, chat templates and incremental (UTF-8 safe) detokenization with stop strings."""

from __future__ import annotations

import importlib
import json
import threading
from pathlib import Path
from typing import Any, Sequence

from minisgl.errors import InvalidRequestError, ModelLoadError
from minisgl.hf_records import ConfigView, read_configs, read_record, record_path, write_record


def load_tokenizer(model_dir: str | Path) -> Any:
    """AutoTokenizer's tokenizer for a model directory.

    AutoTokenizer's own import takes 2-3 s (it imports torch and the config classes), and it resolves config.json
    only to pick the tokenizer's class. The class it picks is recorded (minisgl/hf_records.py), and a later load of
    the same files builds that class directly; the first load takes the model's config from the same cache.
    """
    directory = Path(model_dir)
    record = record_path(directory, ("tokenizer_config.json", "config.json"), "tokenizer")
    cls = _recorded_class(read_record(record))
    try:
        if cls is not None:
            return cls.from_pretrained(str(directory))
        tokenizer = _auto_tokenizer(directory)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a load failure for the user
        raise ModelLoadError(f"could not load a tokenizer from {model_dir}: {e}") from e
    kind = type(tokenizer)
    if kind.__module__.startswith("transformers."):  # never a class of the model's own (remote) code
        write_record(record, {"module": kind.__module__, "name": kind.__qualname__})
    return tokenizer


def _auto_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer  # lazy: transformers' import takes seconds

    try:
        config, _ = read_configs(directory)
    except Exception:  # noqa: BLE001 - no readable config: AutoTokenizer decides as it always does
        config = None
    if isinstance(config, ConfigView) and not _tokenizer_config(directory).get("tokenizer_class"):
        config = None  # AutoTokenizer would pick the class by the config's type
    return AutoTokenizer.from_pretrained(str(directory), config=config)


def _recorded_class(record: dict[str, Any] | None) -> Any:
    if record is None:
        return None
    try:
        return getattr(importlib.import_module(record["module"]), record["name"])
    except (ImportError, AttributeError, KeyError, TypeError):
        return None


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """A model directory's tokenizer_config.json ({} when it has none or it cannot be read)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


class TokenizerLoad:
    """A model directory's tokenizer, loaded on first use (`get`) or ahead of it on a thread (`start`).

    A daemon's scheduler needs a tokenizer only for stop strings and grammars, and transformers' import takes
    seconds: it starts serving first and loads the tokenizer in the background. One load runs at a time (a
    `get` during the thread's load waits for it); a failed load raises ModelLoadError at every `get`.
    """

    def __init__(self, model_dir: str | Path | None, loaded: Any = None) -> None:
        self.model_dir = model_dir
        self._tokenizer = loaded
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The tokenizer (None for a model given without a directory or a tokenizer)."""
        with self._lock:
            if self._tokenizer is None and self.model_dir is not None:
                self._tokenizer = load_tokenizer(self.model_dir)
            return self._tokenizer

    def start(self) -> None:
        threading.Thread(target=self._load_quietly, name="tokenizer-load", daemon=True).start()

    def _load_quietly(self) -> None:
        try:
            self.get()
        except ModelLoadError:
            pass  # the next get() raises it where a request needs the tokenizer


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether a model directory ships a chat template (where AutoTokenizer reads one), read without transformers."""
    directory = Path(model_dir)
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    if (directory / "additional_chat_templates").is_dir():
        return True
    return bool(_tokenizer_config(directory).get("chat_template"))


def check_message(message: Any, i: int) -> None:
    """An OpenAI-style chat message's shape: an object with a string role and a content that is a string, a list of
    parts or None (a chat template given anything else fails inside, as a 500); InvalidRequestError otherwise."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"messages[{i}] must be an object with a 'role' (a string)")
    content = message.get("content")
    if not isinstance(content, (str, list)) and content is not None:
        raise InvalidRequestError(
            f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}"
        )


def flatten_message(message: Any, i: int) -> dict[str, Any]:
    """An OpenAI-style chat message with text-only content: content parts joined, None content -> "".

    Raises InvalidRequestError for a message check_message refuses or a non-text part (image, audio, ...).
    """
    check_message(message, i)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(f"messages[{i}]: content part of type {kind!r} is not supported (text only)")
            texts.append(str(part.get("text", "")))
        return {**message, "content": "".join(texts)}
    if content is None:
        return {**message, "content": ""}  # assistant turns that only call tools
    return message


# apply_chat_template's own arguments: a chat_template_kwargs key with one of these names would
# change how the prompt is built rather than give the template a variable.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_chat_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """chat_template_kwargs (vLLM/SGLang's name): extra variables for the chat template, such as Qwen3's
    {"enable_thinking": False}. A dict with string keys, none of them an argument of the render itself."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError(
            'chat_template_kwargs must be an object of template variables, e.g. {"enable_thinking": false}'
        )
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)} (not template variables)")
    return dict(kwargs)


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    tool_choice: Any = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render a conversation with the model's chat template and tokenize it (render_chat_template's arguments)."""
    text = render_chat_template(tokenizer, messages, tools, add_generation_prompt, tool_choice, chat_template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    tool_choice: Any = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """A conversation rendered with the model's chat template: the text apply_chat_template tokenizes.

    chat_template_kwargs: extra template variables (check_chat_template_kwargs).
    """
    template_kwargs = check_chat_template_kwargs(chat_template_kwargs)
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        check_message(m, i)
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template: send a plain prompt instead of messages")
    if "developer" not in str(tokenizer.chat_template):
        # OpenAI's developer messages replace system messages; a template without the role gets them as system
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    # Past tool calls and results need the tool-aware rendering even when this turn offers no tools.
    history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    from jinja2 import TemplateError  # lazy: jinja2 comes with transformers' templates

    try:
        if tools or history:
            from minisgl.structured.tools import render_tools_prompt  # lazy: structured/ loads xgrammar and torch

            text = render_tools_prompt(
                tokenizer,
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                tool_choice=tool_choice,
                **template_kwargs,
            )
        else:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
    except TemplateError as e:  # the template's own check of the conversation (raise_exception), as vLLM a 400
        raise InvalidRequestError(f"the model's chat template refused these messages: {e}") from None
    return text


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> list[int]:
    """A str prompt is tokenized (with the tokenizer's BOS handling); a token-id list is passed through."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("empty prompt: give at least one character or token")
        return tokenizer.encode(prompt)
    ids = list(prompt)
    if not ids:
        raise InvalidRequestError("empty prompt: give at least one token id")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("a token-id prompt must be a list of ints")
    return ids


def shown_ids(ids: Sequence[int], finish_reason: str | None, matched_stop: Any) -> Sequence[int]:
    """The ids whose text an answer shows: a stop token (EOS or one of stop_token_ids) that ended it is left out
    of the text, as vLLM (unless include_stop_str_in_output) and SGLang do; its id stays in token_ids."""
    if finish_reason == "stop" and isinstance(matched_stop, int) and ids and ids[-1] == matched_stop:
        return ids[:-1]
    return ids


class _StopPrefix:
    """How much of one stop string the text ends with (its longest proper prefix that is a suffix of the text),
    kept up to date as text is appended: Knuth-Morris-Pratt, so each new character costs O(1) amortised."""

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = [0] * (len(stop) + 1)  # fail[k]: longest proper border of stop[:k]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i + 1] = k
        self.state = 0

    def feed(self, text: str) -> None:
        stop, fail, k = self.stop, self.fail, self.state
        for ch in text:
            if k == len(stop):
                k = fail[k]
            while k and ch != stop[k]:
                k = fail[k]
            if ch == stop[k]:
                k += 1
        self.state = k

    def held(self) -> int:
        return self.state if self.state < len(self.stop) else self.fail[self.state]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Never emits half a UTF-8 character, and holds back text that might be the start of a
    stop string; when a stop string appears the text is cut before it and `stopped` is set.
    min_tokens: as vLLM, a stop string counts only if it ends in the text of the min_tokens-th token or later.

    Each call costs O(stops x (new text + longest stop)), never the text so far: a stop string cannot start in
    text already shown (that text was not a prefix of any stop), so only the unshown tail is kept and searched.
    """

    def __init__(
        self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True, min_tokens: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self._boundary: int | None = 0 if min_tokens <= 1 else None  # chars before the min_tokens-th token's text
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self._prefixes = [_StopPrefix(s) for s in self.stop]
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.length = 0  # chars of text decoded so far (stop-trimmed once stopped)
        self._tail = ""  # the text from char _tail_start on: what is not shown yet, and what a stop may still match
        self._tail_start = 0
        self.emitted = 0  # chars of text already returned
        self.stopped: str | None = None
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int]) -> str:
        """Feed generated token ids; returns the text that is now safe to show."""
        if self.stopped is not None:
            return ""
        self.token_ids.extend(new_ids)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        if full_text.endswith("\ufffd"):
            return self._flush(final=False)  # wait for the rest of the character
        old_len = self.length
        self._append(full_text[len(prefix_text) :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._check_stop(old_len)
        return self._flush(final=self.stopped is not None)

    def _append(self, text: str) -> None:
        self._tail += text
        self.length += len(text)
        for prefix in self._prefixes:
            prefix.feed(text)

    def _check_stop(self, old_len: int) -> None:
        if not self.stop:
            return
        if self._boundary is None:
            if len(self.token_ids) < self.min_tokens:
                return
            self._boundary = len(self._decode(self.token_ids[: self.min_tokens - 1]))
        start = max(0, old_len - self._longest + 1)
        hits = []
        for s in self.stop:
            pos = self._tail.find(s, max(start, self._boundary - len(s) + 1, self._tail_start) - self._tail_start)
            if pos >= 0:
                hits.append((pos + self._tail_start, s))
        if hits:
            pos, s = min(hits)
            self._tail = self._tail[: pos - self._tail_start]
            self.length = pos
            self.stopped = s

    def _flush(self, final: bool) -> str:
        end = self.length
        if not final and self.stop:
            end -= max(prefix.held() for prefix in self._prefixes)
        end = max(end, self.emitted)
        delta = self._tail[self.emitted - self._tail_start : end - self._tail_start]
        self.emitted = end
        keep_from = min(self.emitted, max(0, self.length - self._longest + 1))  # what the next stop search reads
        if keep_from > self._tail_start:
            self._tail = self._tail[keep_from - self._tail_start :]
            self._tail_start = keep_from
        return delta

    def finish(self) -> str:
        """The request ended: return whatever was held back."""
        if self.stopped is None and self.token_ids[self._read_offset :]:
            self._append(
                self._decode(self.token_ids[self._prefix_offset :])[
                    len(self._decode(self.token_ids[self._prefix_offset : self._read_offset])) :
                ]
            )
            self._read_offset = len(self.token_ids)
        return self._flush(final=True)

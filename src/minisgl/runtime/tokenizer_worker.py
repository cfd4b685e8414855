"""The text worker's request side: chat templates (with tools), tokenization and the one validation.

A request that cannot be served is answered with a typed error and never reaches the scheduler;
the rest go on as AddRequest, whose params the scheduler takes as they are (already validated).
A text is measured before it is tokenized: a request past max_request_chars, or a prompt whose characters make more
tokens than the context holds even at the most characters one token can stand for (CharBound), is refused unread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any, NamedTuple

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequestError, PromptTooLongError
from minisgl.limits import RequestLimits, chars_of, text_chars
from minisgl.runtime.protocol import AddRequest, Detokenize, DetokenizeReply, Generate, Tokenize, TokenizeReply
from minisgl.tokenizer import apply_chat_template, encode_prompt, render_chat_template

logger = logging.getLogger("minisgl")


def apply_response_format(params: SamplingParams, response_format: Any) -> SamplingParams:
    """OpenAI's response_format as a grammar on the params ({"type": "text" | "json_object" | "json_schema"})."""
    if response_format is None:
        return params
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise InvalidRequestError("response_format must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return params
    if params.has_grammar:
        raise InvalidRequestError("give either response_format or a json_schema/regex/ebnf constraint, not both")
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise InvalidRequestError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"
            )
        schema = spec.get("schema", {})
    else:
        raise InvalidRequestError(f"unknown response_format type {kind!r}: use text, json_object or json_schema")
    return params.with_grammar(json_schema=schema)


# Parts of a HF fast tokenizer that never drop a character of the text. NFC/NFKC compose at most 4 characters into
# one (omega and three marks into U+1FA4); anything else (Strip, BertNormalizer, Whitespace splits...) may delete.
_KEEPING_NORMALIZERS = frozenset({"Prepend", "Replace", "NFD", "NFKD", "ByteLevel"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"})
MAX_COMPOSED = 4
_WHITESPACE = re.compile(r"\s+")


class CharBound(NamedTuple):
    """The most characters one token can stand for, so that a text of n characters makes at least
    ceil(n / chars_per_token) tokens; None where this tokenizer may drop characters (no bound holds)."""

    chars_per_token: int | None
    count_whitespace: bool = True  # False: an added token absorbs the whitespace beside it (lstrip/rstrip)

    def fewest_tokens(self, text: str | bytes) -> int:
        """The fewest tokens a text (a str, or its UTF-8 bytes) can make: 0 where no bound holds."""
        if self.chars_per_token is None or (isinstance(text, bytes) and not self.count_whitespace):
            return 0  # (the whitespace of UTF-8 bytes is not counted: measured once decoded)
        chars = chars_of(text) if self.count_whitespace else len(text) - sum(map(len, _WHITESPACE.findall(text)))
        return -(-chars // self.chars_per_token)

    @classmethod
    def of(cls, tokenizer: Any, configured: int | None = None) -> "CharBound":
        """configured (max_chars_per_token) when given, else the vocabulary's longest entry: a byte-level entry has a
        character per byte, a SentencePiece one its text, an added token its content, so none covers more of the
        text than its length (times MAX_COMPOSED after NFC/NFKC); None for a tokenizer that may drop characters."""
        absorbs = any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) for t in _added_tokens(tokenizer))
        if configured is not None:
            return cls(configured, not absorbs)
        ratio = _composition_ratio(tokenizer)
        if ratio is None:
            return cls(None)
        return cls(max(map(len, tokenizer.get_vocab()), default=1) * ratio, not absorbs)


def _added_tokens(tokenizer: Any) -> list[Any]:
    return list((getattr(tokenizer, "added_tokens_decoder", None) or {}).values())


def _parts(state: Any, key: str) -> list[dict[str, Any]]:
    """A tokenizers component's JSON state, its Sequence flattened."""
    return [] if state is None else _parts_of(json.loads(state.__getstate__()), key)


def _parts_of(spec: dict[str, Any], key: str) -> list[dict[str, Any]]:
    if spec.get("type") == "Sequence":
        return [p for inner in spec[key] for p in _parts_of(inner, key)]
    return [spec]


def _composition_ratio(tokenizer: Any) -> int | None:
    """1 or MAX_COMPOSED for a fast tokenizer every character of whose text ends up in a token; None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    normalizers = _parts(backend.normalizer, "normalizers")
    pre_tokenizers = _parts(backend.pre_tokenizer, "pretokenizers")
    for part in normalizers:
        kind = part.get("type")
        if kind not in _KEEPING_NORMALIZERS | _COMPOSING_NORMALIZERS or (kind == "Replace" and not part.get("content")):
            return None
    for part in pre_tokenizers:
        if part.get("type") not in _KEEPING_PRE_TOKENIZERS or part.get("behavior") == "Removed":
            return None
    byte_level = any(p.get("type") == "ByteLevel" for p in normalizers + pre_tokenizers)
    model = backend.model
    if type(model).__name__ not in ("BPE", "Unigram") or not (byte_level or getattr(model, "byte_fallback", False)):
        return None  # an unknown character could become nothing, or one unknown token for a whole run
    return MAX_COMPOSED if any(p.get("type") in _COMPOSING_NORMALIZERS for p in normalizers) else 1


class RequestPreparer:
    """Turns a Generate message into a tokenized, validated AddRequest."""

    def __init__(self, tokenizer: Any, model_info: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.context_length = int(model_info["context_length"])
        self.model_type = str(model_info.get("model_type") or "")
        self.reasoning_parser = (model_info.get("config") or {}).get("reasoning_parser")
        self.limits = RequestLimits.from_config(model_info.get("config") or {})
        self.char_bound = CharBound.of(tokenizer, self.limits.max_chars_per_token)
        if self.char_bound.chars_per_token is None:
            logger.info(
                "this tokenizer may drop characters: prompts are bounded by max_request_chars only (set "
                "max_chars_per_token to bound them against the context window before tokenizing)"
            )
        self._tool_format: str | None = None

    def prepare(self, msg: Generate) -> AddRequest:
        params = SamplingParams.from_dict(msg.params)  # the one validation: the scheduler trusts AddRequest
        self.limits.check_params(params)
        given = [name for name in ("prompt", "input_ids", "messages") if getattr(msg, name) is not None]
        if len(given) != 1:
            raise InvalidRequestError(f"give exactly one of prompt, input_ids and messages (got {given or 'none'})")
        self.measure(msg._asdict())  # before a look at each token id, any rendering or tokenizing
        if msg.embed is not False:
            self._check_embed(msg)
            params = SamplingParams.for_embedding()
        params = apply_response_format(params, msg.response_format)
        if isinstance(params.json_schema, (dict, list)):
            self.limits.check_schema(params.json_schema, "json_schema")
        tools, forced = self._tools(msg)
        if tools and msg.messages is None:
            raise InvalidRequestError("tools need a chat request: send messages, not a plain prompt")
        if msg.parallel_tool_calls not in (None, True, False):
            raise InvalidRequestError("parallel_tool_calls must be true or false")
        if msg.chat_template_kwargs is not None and msg.messages is None:
            raise InvalidRequestError("chat_template_kwargs need a chat request: send messages, not a plain prompt")
        if forced:
            if params.has_grammar:
                raise InvalidRequestError("a forced tool call cannot be combined with response_format or a grammar")
            params = params.with_grammar(**forced)
        input_ids = self._input_ids(msg, tools)
        self._check_fits(len(input_ids))
        params = params.for_prompt(len(input_ids), self.context_length)  # max_tokens unset: to the context's end
        # Chat answers of a thinking model: does the prompt leave the output inside <think>?
        reasoning = self._opens_in_reasoning(input_ids) if self.reasoning_parser and msg.messages else None
        if reasoning and params.has_grammar:  # as vLLM and SGLang: think freely, then answer in the grammar
            from minisgl.structured.reasoning import END  # lazy: structured/ loads xgrammar and torch

            params = dataclasses.replace(params, grammar_after=END)
        detok = {
            "n": params.n,
            "stop": params.stop,
            "min_tokens": params.min_tokens,
            "skip_special_tokens": params.skip_special_tokens,
            "tool_parser": self.tool_format if tools else None,
            "max_tool_calls": 1 if msg.parallel_tool_calls is False else None,
            "reasoning": reasoning,
            "grammar": next((g for g in ("json_schema", "regex", "ebnf") if getattr(params, g) is not None), None),
            "prompt_ids": input_ids if params.prompt_logprobs is not None else None,  # to name prompt_logprobs' tokens
        }
        return AddRequest(msg.rid, input_ids, params.to_dict(), detok, msg.embed)

    def _input_ids(self, msg: Generate, tools: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids (measure() has bounded the prompt or the messages; a rendered text is measured)."""
        if msg.messages is not None:
            text = render_chat_template(
                self.tokenizer,
                msg.messages,
                tools=tools or None,
                tool_choice=msg.tool_choice or "auto",
                chat_template_kwargs=msg.chat_template_kwargs,
            )
            self._check_text_fits(text)  # measured as rendered, too
            return self.tokenizer.encode(text, add_special_tokens=False)
        if msg.prompt is not None:
            if not isinstance(msg.prompt, str):
                raise InvalidRequestError(f"prompt must be a string, got {type(msg.prompt).__name__}")
            return encode_prompt(self.tokenizer, msg.prompt)
        if not isinstance(msg.input_ids, list):
            raise InvalidRequestError("input_ids must be a list of token ids")
        return encode_prompt(self.tokenizer, msg.input_ids)

    def measure(self, fields: dict[str, Any]) -> None:
        """The size checks of prepare() on a Generate's fields as the wire has them, text still UTF-8 bytes: a
        request refused here is never decoded (30 MB of text take up to 0.6 s to decode, holding the GIL)."""
        if isinstance(fields.get("input_ids"), list):
            self._check_fits(len(fields["input_ids"]))
        names = ("prompt", "input_ids", "messages", "tools", "chat_template_kwargs")
        self.limits.check_request_chars(*(fields.get(name) for name in names))
        if isinstance(fields.get("prompt"), (str, bytes)):
            self._check_text_fits(fields["prompt"])
        if fields.get("messages") is not None:
            self._check_messages_fit(fields["messages"])

    def _check_text_fits(self, text: str | bytes) -> None:
        fewest = self.char_bound.fewest_tokens(text)
        if fewest >= self.context_length:
            raise PromptTooLongError(
                f"the prompt has {chars_of(text)} characters, at least {fewest} tokens at up to "
                f"{self.char_bound.chars_per_token} characters per token (max_chars_per_token), but the context "
                f"window is {self.context_length} tokens: shorten the prompt"
            )

    def _check_messages_fit(self, messages: Any) -> None:
        """Before rendering (30 MB take seconds): every character a conversation carries counts, even one its
        template leaves out (an earlier turn's reasoning); the rendered text is measured again."""
        per_token = self.char_bound.chars_per_token
        if per_token is None or not self.char_bound.count_whitespace:
            return  # whitespace may vanish beside an added token: measured once rendered
        limit = (self.context_length - 1) * per_token
        if text_chars(messages, limit) > limit:
            raise PromptTooLongError(
                f"the messages carry more than {limit} characters, more tokens than the context window of "
                f"{self.context_length} holds at up to {per_token} characters per token (max_chars_per_token): "
                "shorten them"
            )

    def _check_fits(self, num_tokens: int) -> None:
        if num_tokens >= self.context_length:
            raise PromptTooLongError(
                f"the prompt has {num_tokens} tokens but the context window is {self.context_length}: "
                "shorten the prompt"
            )

    @staticmethod
    def _check_embed(msg: Generate) -> None:
        if msg.embed is not True:
            raise InvalidRequestError("embed must be true or false")
        if msg.messages is not None or msg.tools or msg.response_format or msg.chat_template_kwargs:
            raise InvalidRequestError(
                "an embedding request takes a prompt or token ids only (no chat, tools or formats)"
            )
        if msg.params:
            raise InvalidRequestError("an embedding request takes no sampling parameters")

    def tokenize(self, msg: Tokenize) -> TokenizeReply:
        """The ids a generate request with this prompt or these messages would get (vLLM's /tokenize)."""
        for name in ("add_special_tokens", "add_generation_prompt"):
            if not isinstance(getattr(msg, name), bool):
                raise InvalidRequestError(f"{name} must be true or false")
        if (msg.prompt is None) == (msg.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages")
        self.limits.check_request_chars(msg.prompt, msg.messages, msg.tools, msg.chat_template_kwargs)
        if msg.messages is not None:
            self.limits.check_tools(msg.tools)
            input_ids = apply_chat_template(
                self.tokenizer,
                msg.messages,
                tools=msg.tools or None,
                add_generation_prompt=msg.add_generation_prompt,
                chat_template_kwargs=msg.chat_template_kwargs,
            )
        elif msg.tools is not None or msg.chat_template_kwargs is not None:
            raise InvalidRequestError("tools and chat_template_kwargs need messages, not a plain prompt")
        elif not isinstance(msg.prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(msg.prompt).__name__}")
        else:
            input_ids = self.tokenizer.encode(msg.prompt, add_special_tokens=msg.add_special_tokens)
        return TokenizeReply(msg.rid, list(input_ids), self.context_length)

    def detokenize(self, msg: Detokenize) -> DetokenizeReply:
        ids, size = msg.input_ids, len(self.tokenizer)
        self.limits.check_request_chars(ids if isinstance(ids, list) else None)
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("tokens must be a list of token ids (ints)")
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the tokenizer's vocabulary (0..{size - 1})")
        if not isinstance(msg.skip_special_tokens, bool):
            raise InvalidRequestError("skip_special_tokens must be true or false")
        return DetokenizeReply(msg.rid, self.tokenizer.decode(ids, skip_special_tokens=msg.skip_special_tokens))

    def _opens_in_reasoning(self, input_ids: list[int]) -> bool:
        from minisgl.structured.reasoning import opens_in_reasoning  # lazy: structured/ loads xgrammar and torch

        return opens_in_reasoning(self.tokenizer.decode(input_ids[-16:], skip_special_tokens=False))

    @property
    def tool_format(self) -> str:
        """The tool-call format this model writes (and the detokenizer parses): "hermes" or "llama3_json"."""
        if self._tool_format is None:
            from minisgl.structured.parsers import get_tool_parser  # lazy: structured/ loads xgrammar and torch

            template = getattr(self.tokenizer, "chat_template", None)
            self._tool_format = get_tool_parser(
                None, self.model_type, template if isinstance(template, str) else None
            ).name
        return self._tool_format

    def _tools(self, msg: Generate) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """(the tools the model may call, the grammar fields that force a call or None)."""
        if msg.tools is None and msg.tool_choice in (None, "none", "auto"):
            return [], None
        from minisgl.structured.tools import (  # lazy: xgrammar, torch
            normalize_tools,
            resolve_tool_choice,
            tool_call_constraint,
        )

        self.limits.check_tools(msg.tools)
        tools = normalize_tools(msg.tools)
        choice = resolve_tool_choice(msg.tool_choice, tools)
        if choice.mode == "none":
            return [], None
        # A forced call is one call: weak models otherwise repeat it until max_tokens.
        return tools, tool_call_constraint(tools, choice, self.tool_format, parallel_tool_calls=False)

"""The text worker's request side: chat templates (with tools), tokenization and the one validation.

A request that cannot be served is answered with a typed error and never reaches the scheduler;
the rest go on as AddRequest, whose params the scheduler takes as they are (already validated).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequestError, PromptTooLongError
from minisgl.limits import RequestLimits
from minisgl.runtime.protocol import AddRequest, Detokenize, DetokenizeReply, Generate, Tokenize, TokenizeReply
from minisgl.tokenizer import apply_chat_template, encode_prompt


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


class RequestPreparer:
    """Turns a Generate message into a tokenized, validated AddRequest."""

    def __init__(self, tokenizer: Any, model_info: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.context_length = int(model_info["context_length"])
        self.model_type = str(model_info.get("model_type") or "")
        self.reasoning_parser = (model_info.get("config") or {}).get("reasoning_parser")
        self.limits = RequestLimits.from_config(model_info.get("config") or {})
        self._tool_format: str | None = None

    def prepare(self, msg: Generate) -> AddRequest:
        params = SamplingParams.from_dict(msg.params)  # the one validation: the scheduler trusts AddRequest
        self.limits.check_params(params)
        given = [name for name in ("prompt", "input_ids", "messages") if getattr(msg, name) is not None]
        if len(given) != 1:
            raise InvalidRequestError(f"give exactly one of prompt, input_ids and messages (got {given or 'none'})")
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
        if msg.messages is not None:
            input_ids = apply_chat_template(
                self.tokenizer,
                msg.messages,
                tools=tools or None,
                tool_choice=msg.tool_choice or "auto",
                chat_template_kwargs=msg.chat_template_kwargs,
            )
        elif msg.prompt is not None:
            if not isinstance(msg.prompt, str):
                raise InvalidRequestError(f"prompt must be a string, got {type(msg.prompt).__name__}")
            input_ids = encode_prompt(self.tokenizer, msg.prompt)
        else:
            if not isinstance(msg.input_ids, list):
                raise InvalidRequestError("input_ids must be a list of token ids")
            input_ids = encode_prompt(self.tokenizer, msg.input_ids)
        if len(input_ids) >= self.context_length:
            raise PromptTooLongError(
                f"the prompt has {len(input_ids)} tokens but the context window is {self.context_length}: "
                "shorten the prompt"
            )
        params = params.for_prompt(len(input_ids), self.context_length)  # max_tokens unset: to the context's end
        # Chat answers of a thinking model: does the prompt leave the output inside <think>?
        reasoning = self._opens_in_reasoning(input_ids) if self.reasoning_parser and msg.messages else None
        if reasoning and params.has_grammar:  # as vLLM and SGLang: think freely, then answer in the grammar
            from minisgl.structured.reasoning import END

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
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("tokens must be a list of token ids (ints)")
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the tokenizer's vocabulary (0..{size - 1})")
        if not isinstance(msg.skip_special_tokens, bool):
            raise InvalidRequestError("skip_special_tokens must be true or false")
        return DetokenizeReply(msg.rid, self.tokenizer.decode(ids, skip_special_tokens=msg.skip_special_tokens))

    def _opens_in_reasoning(self, input_ids: list[int]) -> bool:
        from minisgl.structured.reasoning import opens_in_reasoning

        return opens_in_reasoning(self.tokenizer.decode(input_ids[-16:], skip_special_tokens=False))

    @property
    def tool_format(self) -> str:
        """The tool-call format this model writes (and the detokenizer parses): "hermes" or "llama3_json"."""
        if self._tool_format is None:
            from minisgl.structured.parsers import get_tool_parser

            template = getattr(self.tokenizer, "chat_template", None)
            self._tool_format = get_tool_parser(
                None, self.model_type, template if isinstance(template, str) else None
            ).name
        return self._tool_format

    def _tools(self, msg: Generate) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """(the tools the model may call, the grammar fields that force a call or None)."""
        if msg.tools is None and msg.tool_choice in (None, "none", "auto"):
            return [], None
        from minisgl.structured.tools import normalize_tools, resolve_tool_choice, tool_call_constraint

        self.limits.check_tools(msg.tools)
        tools = normalize_tools(msg.tools)
        choice = resolve_tool_choice(msg.tool_choice, tools)
        if choice.mode == "none":
            return [], None
        # A forced call is one call: weak models otherwise repeat it until max_tokens.
        return tools, tool_call_constraint(tools, choice, self.tool_format, parallel_tool_calls=False)

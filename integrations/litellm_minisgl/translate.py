"""LiteLLM <-> minisgl: request parameters in, responses, stream chunks and errors out.

Mirrors the OpenAI server (minisgl.server): the same sampling_params_from_openai mapping, message
flattening and usage with prompt_tokens_details.cached_tokens.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Mapping

import litellm
from litellm.types.utils import ChoiceLogprobs, Choices, GenericStreamingChunk, Message, ModelResponse, Usage

from minisgl import (
    ConfigError,
    DaemonError,
    DaemonTimeoutError,
    InvalidRequestError,
    MiniSGLError,
    OutOfMemoryError,
    PromptTooLongError,
    RequestAbortedError,
    SamplingParams,
    UnknownModelError,
    flatten_message,
    sampling_params_from_openai,
)

PROVIDER = "minisgl"

# The OpenAI sampling parameters this provider takes, and the engine extras a caller may pass as
# kwargs or in extra_body (as vLLM/SGLang accept them); sampling_params_from_openai maps them.
_OPENAI = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "logit_bias",
)
_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens")


class Request:
    """One chat completion as the minisgl client takes it: messages plus generate() keyword arguments."""

    def __init__(
        self,
        messages: list[dict[str, Any]],
        params: dict[str, Any],
        optional_params: Mapping[str, Any],
        sampling: SamplingParams | None = None,
    ):
        self.messages = messages
        self._sampling = sampling if sampling is not None else sampling_params_from_openai(params)
        self.params = params  # the OpenAI sampling parameters given (for sampling_params_from_openai)
        self.tools = optional_params.get("tools") or None
        self.tool_choice = optional_params.get("tool_choice")
        self.parallel_tool_calls = optional_params.get("parallel_tool_calls")
        self.response_format = _response_format(optional_params.get("response_format"))
        self.chat_template_kwargs = optional_params.get("chat_template_kwargs")  # vLLM/SGLang's extra_body field
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, Mapping):
            raise InvalidRequestError("chat_template_kwargs must be an object of template variables")

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; without max_tokens it may run to the end of the context (as OpenAI)."""
        return self._sampling  # validated once, in build_request; max_tokens unset: the daemon fills the context

    def generate_kwargs(self) -> dict[str, Any]:
        return {
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "response_format": self.response_format,
            "chat_template_kwargs": dict(self.chat_template_kwargs) if self.chat_template_kwargs else None,
            "parallel_tool_calls": self.parallel_tool_calls,
        }


def build_request(messages: Any, optional_params: Mapping[str, Any], stream: bool = False) -> Request:
    """Validate LiteLLM's messages and optional_params; bad values raise minisgl InvalidRequestError."""
    given = dict(optional_params or {})
    extra_body = given.get("extra_body") or {}
    if not isinstance(extra_body, Mapping):
        raise InvalidRequestError("extra_body must be an object")
    given = {**extra_body, **{k: v for k, v in given.items() if k != "extra_body"}}
    if given.get("functions") is not None or given.get("function_call") is not None:
        raise InvalidRequestError(
            "functions / function_call (OpenAI's deprecated form) are not supported: pass tools and tool_choice"
        )
    params: dict[str, Any] = {k: given[k] for k in (*_OPENAI, *_EXTRAS) if given.get(k) is not None}
    if "logprobs" in params:
        params["logprobs"] = bool(params["logprobs"])  # a chat API: logprobs is a switch, top_logprobs the count
    if given.get("stop"):
        params["stop"] = given["stop"]
    if stream and params.get("n", 1) != 1:
        raise InvalidRequestError("n > 1 cannot be streamed through LiteLLM's provider interface: use stream=False")
    if stream and params.get("logprobs"):
        raise InvalidRequestError("logprobs are returned only with stream=False")
    sampling = sampling_params_from_openai(params)  # validate now, before a daemon is found or started
    return Request(chat_messages(messages), params, given, sampling)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Plain-dict messages with OpenAI content parts flattened to text, as chat templates expect."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    return [_flatten(plain_data(m), i) for i, m in enumerate(messages)]


def plain_data(obj: Any) -> Any:
    """LiteLLM/OpenAI message objects (an agent loop appends response messages as they are) as plain data."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_none=True)
    if isinstance(obj, Mapping):
        return {k: plain_data(v) for k, v in obj.items() if v is not None or k == "content"}
    if isinstance(obj, (list, tuple)):
        return [plain_data(v) for v in obj]
    return obj


def _flatten(message: Any, i: int) -> dict[str, Any]:
    if isinstance(message, dict):
        message = {k: v for k, v in message.items() if k != "provider_specific_fields"}
    return flatten_message(message, i)


def _response_format(fmt: Any) -> dict[str, Any] | None:
    fmt = plain_data(fmt)
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise InvalidRequestError("response_format must be an object with a 'type'")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_schema" and not (fmt.get("json_schema") or {}).get("schema"):
        raise InvalidRequestError("response_format json_schema needs json_schema.schema (a JSON schema object)")
    return fmt


# ---------------------------------------------------------------------------- responses


def usage_dict(usage: Any) -> dict[str, Any]:
    """OpenAI usage of a minisgl Usage: prompt/completion/total tokens and prompt_tokens_details.cached_tokens."""
    if usage is None:
        prompt, completion, cached = 0, 0, 0
    else:
        prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    token = entry["token"]
    return {"token": token, "logprob": entry["logprob"], "bytes": list(token.encode("utf-8", "replace"))}


def _logprobs(entries: list[dict[str, Any]] | None) -> ChoiceLogprobs | None:
    """The daemon's per-token logprobs ({token, logprob, top_logprobs}) in OpenAI's chat form."""
    if not entries:
        return None
    content = [
        {**_token_logprob(e), "top_logprobs": [_token_logprob(t) for t in e.get("top_logprobs") or []]} for e in entries
    ]
    return ChoiceLogprobs(content=content)


def to_model_response(result: Any, model_response: ModelResponse, model: str) -> ModelResponse:
    """Fill LiteLLM's ModelResponse from a minisgl GenerateResult (one choice per sampled sequence)."""
    choices = []
    for out in result.outputs:
        calls = out.tool_calls or None
        message = Message(
            role="assistant",
            content=out.text if (out.text or not calls) else None,
            tool_calls=calls,
            reasoning_content=out.reasoning_content,
        )
        choice = Choices(index=out.index, message=message, finish_reason=out.finish_reason or "stop")
        logprobs = _logprobs(out.logprobs)
        if logprobs is not None:
            choice.logprobs = logprobs
        choices.append(choice)
    model_response.id = f"chatcmpl-{result.rid}"
    model_response.choices = choices
    model_response.created = int(time.time())
    model_response.model = model
    setattr(model_response, "usage", Usage(**usage_dict(result.usage)))
    return model_response


def stream_chunks(chunk: Any) -> Iterator[GenericStreamingChunk]:
    """The GenericStreamingChunks of one daemon Chunk: its text, one per tool-call delta, then the finish
    (the daemon already reports a sequence that called tools and stopped as "tool_calls")."""
    index = int(chunk.index)
    text = chunk.text
    if chunk.reasoning:  # LiteLLM's streaming interface has no reasoning field: delta.provider_specific_fields
        yield GenericStreamingChunk(
            text="",
            tool_use=None,
            is_finished=False,
            finish_reason="",
            usage=None,
            index=index,
            provider_specific_fields={"reasoning_content": chunk.reasoning},
        )
    for delta in chunk.tool_calls or []:
        fn = delta.get("function") or {}
        tool_use = {
            "id": delta.get("id"),
            "type": "function",
            "index": int(delta.get("index", 0)),
            "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or ""},
        }
        yield GenericStreamingChunk(
            text=text, tool_use=tool_use, is_finished=False, finish_reason="", usage=None, index=index
        )
        text = ""
    if chunk.finish_reason is not None or chunk.usage is not None:
        usage = usage_dict(chunk.usage) if chunk.usage is not None else None
        yield GenericStreamingChunk(
            text=text,
            tool_use=None,
            is_finished=True,
            finish_reason=chunk.finish_reason or "stop",
            usage=usage,
            index=index,
        )
    elif text:
        yield GenericStreamingChunk(
            text=text, tool_use=None, is_finished=False, finish_reason="", usage=None, index=index
        )


# ---------------------------------------------------------------------------- errors


def litellm_error(e: BaseException, model: str) -> Exception:
    """The LiteLLM exception for a minisgl error: 4xx for bad requests, 503 when the daemon is unreachable."""
    args = {"message": f"minisgl: {e}", "model": model, "llm_provider": PROVIDER}
    if isinstance(e, PromptTooLongError):
        return litellm.ContextWindowExceededError(**args)
    if isinstance(e, (InvalidRequestError, OutOfMemoryError, ConfigError)):
        return litellm.BadRequestError(**args)
    if isinstance(e, UnknownModelError):
        return litellm.NotFoundError(**args)
    if isinstance(e, DaemonTimeoutError):
        return litellm.Timeout(**args)
    if isinstance(e, (DaemonError, RequestAbortedError)):
        # 503, not APIConnectionError: a Router cools a failing deployment down on a 503 but, by
        # design, never on an APIConnectionError, so a dead daemon would keep getting traffic.
        return litellm.ServiceUnavailableError(**args)
    if isinstance(e, MiniSGLError):
        return litellm.InternalServerError(**args)
    return litellm.InternalServerError(message=f"minisgl: {type(e).__name__}: {e}", model=model, llm_provider=PROVIDER)

"""OpenAI-compatible request and response bodies (pydantic v2).

Requests ignore fields they do not know (like vLLM) so that clients written for newer
OpenAI APIs keep working; fields they know but cannot honour raise InvalidRequestError.
"""

from __future__ import annotations

import time
import types
import typing
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequestError
from minisgl.server.params import sampling_params_from_openai
from minisgl.tokenizer import flatten_message


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI's API marks most fields nullable (n, echo, logprobs, penalties, ...), and clients send null for
        "not given": a null takes the field's default, as vLLM's Optional fields do. A field whose type has
        None keeps it (a null max_tokens on /v1/completions: no limit, as vLLM)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or _nullable(fields[k])}


def _nullable(field: Any) -> bool:
    """Whether a field takes None itself (a required field keeps its null too: the error names the field)."""
    annotation = field.annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return field.is_required() or annotation is Any or (union and type(None) in typing.get_args(annotation))


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None  # {"name": ..., "schema": {...}, "strict": ...}


class _SamplingFields(_Request):
    """The sampling fields chat and text completions share (plus the common vLLM/SGLang extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extras beyond the OpenAI API.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's extra: the prompt tokens' logprobs (top-k), in the choice
    logit_bias: dict[str, float] | None = None  # OpenAI's: {"token id": bias in [-100, 100]}
    # Grammar-constrained output as SGLang (json_schema, regex, ebnf) and vLLM (guided_*, structured_outputs) take
    # it in the body (sampling_params_from_openai maps them); response_format is OpenAI's way.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true (as OpenAI and vLLM refuse it)")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM/SGLang: extra chat-template variables

    def to_sampling_params(self) -> SamplingParams:
        """Without max_tokens the answer may run to the end of the context window (as OpenAI's): the
        daemon resolves the unset max_tokens."""
        return sampling_params_from_openai(dict(self), api="openai.chat")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages with OpenAI content parts flattened to text, as chat templates expect."""
        if not self.messages:
            raise InvalidRequestError("messages must be a non-empty list")
        return [flatten_message(m, i) for i, m in enumerate(self.messages)]

    def response_format_dict(self) -> dict[str, Any] | None:
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_schema" and not (self.response_format.json_schema or {}).get("schema"):
            raise InvalidRequestError("response_format json_schema needs json_schema.schema (a JSON schema object)")
        return self.response_format.model_dump(exclude_none=True)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # unset: the API's default (16, API_DEFAULTS); null: up to the context's end (vLLM)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None

    def to_sampling_params(self) -> SamplingParams:
        """echo: the prompt comes back in front of each answer, with its tokens' logprobs when logprobs is set
        (the whole prompt is then computed: the prefix cache has no logits)."""
        if self.echo and self.stream:
            raise InvalidRequestError("echo is supported without stream only")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (leave it unset or equal to n)")
        request = dict(self)
        if "max_tokens" not in self.model_fields_set:
            del request["max_tokens"]  # OpenAI's default for this API applies (sampling_params_for)
        if self.echo and self.prompt_logprobs is None:
            request["prompt_logprobs"] = 0 if self.logprobs is None else self.logprobs  # the prompt's tokens, logprobs
        return sampling_params_from_openai(request, api="openai.completions")

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per entry of a batched request."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise InvalidRequestError("prompt must not be empty")
        return list(p)  # type: ignore[arg-type]

    def response_format_dict(self) -> dict[str, Any] | None:
        return ChatCompletionRequest.response_format_dict(self)  # type: ignore[arg-type]


# ---- responses ----


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0  # OpenAI's name; here the speculative drafts accepted (--speculative)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # only from a daemon that speculates

    @model_serializer(mode="wrap")
    def _without_empty_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The usage object OpenAI sends: completion_tokens_details only where there is something to say."""
        out = handler(self)
        if out.get("completion_tokens_details") is None:
            out.pop("completion_tokens_details", None)
        return out

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int, accepted: int = 0) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=CompletionTokensDetails(accepted_prediction_tokens=accepted)
            if accepted
            else None,
        )

    def __add__(self, other: "Usage") -> "Usage":
        accepted = [
            u.completion_tokens_details.accepted_prediction_tokens for u in (self, other) if u.completion_tokens_details
        ]
        return Usage.of(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.prompt_tokens_details.cached_tokens + other.prompt_tokens_details.cached_tokens,
            sum(accepted),
        )


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class _OmitWhenNone(BaseModel):
    """Extensions of OpenAI's shapes (OMIT_WHEN_NONE) are left out of the JSON while they are None."""

    OMIT_WHEN_NONE: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_absent_extensions(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in self.OMIT_WHEN_NONE:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatMessage(_OmitWhenNone):
    OMIT_WHEN_NONE = ("reasoning_content",)

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # vLLM/SGLang's field, with --reasoning-parser


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_OmitWhenNone):
    OMIT_WHEN_NONE = ("prompt_logprobs",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # when the request set prompt_logprobs (vLLM)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI tool-call deltas, passed through as the daemon sends them
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_OmitWhenNone):
    OMIT_WHEN_NONE = ("prompt_logprobs",)

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # when the request set prompt_logprobs (vLLM)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingRequest(_Request):
    """OpenAI's /v1/embeddings body: a text, token ids, or a list of either."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    def inputs(self) -> list[str | list[int]]:
        if self.dimensions is not None:
            raise InvalidRequestError("dimensions is not supported: the embedding has the model's hidden size")
        items = (
            [self.input]
            if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int))
            else self.input
        )
        if not items or any(not x for x in items):
            raise InvalidRequestError("input must be a non-empty text or token list, or a non-empty list of them")
        return list(items)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format="base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeRequest(_Request):
    """vLLM's /tokenize body: a prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # prompt only (a chat template writes its own special tokens)
    add_generation_prompt: bool = True  # messages only
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def tokenize_args(self) -> tuple[str | list[dict[str, Any]], dict[str, Any]]:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages")
        if self.return_token_strs:
            raise InvalidRequestError("return_token_strs is not supported: /detokenize turns ids into text")
        kwargs = dict(tools=self.tools, chat_template_kwargs=self.chat_template_kwargs)
        if self.messages is not None:
            if not self.messages:
                raise InvalidRequestError("messages must be a non-empty list")
            messages = [flatten_message(m, i) for i, m in enumerate(self.messages)]
            return messages, dict(kwargs, add_generation_prompt=self.add_generation_prompt)
        return self.prompt or "", dict(kwargs, add_special_tokens=self.add_special_tokens)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "minisgl"
    max_model_len: int | None = None
    quantization: str | None = None  # the daemon's weights: none, fp16, int8 or fp8
    threads: int | None = None  # CPU threads of its computing process


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

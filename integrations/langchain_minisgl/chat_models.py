"""ChatMiniSGL: a langchain-core chat model over minisgl's Client / AsyncClient.

One module that translates in and out: LangChain messages become OpenAI-style chat dicts, tools
become OpenAI function tools, structured output becomes response_format or a forced tool call;
the daemon's chunks come back as AIMessageChunks (text deltas, tool_call_chunks, usage and
response metadata on the last one). The daemon batches concurrent requests itself, so
batch/abatch are LangChain's own (threads / asyncio.gather over invoke / ainvoke).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from operator import itemgetter
from typing import Any, AsyncIterator, Callable, Iterator, Literal, NamedTuple, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
)
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils import from_env
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from langchain_core.utils.utils import _build_model_kwargs, get_pydantic_field_names
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from langchain_minisgl.messages import (
    PROVIDER,
    MessageChunks,
    chat_result,
    json_schema_of,
    merge_stops,
    to_chat_messages,
    tool_choice_of,
)
from minisgl import (
    DEFAULT_TIMEOUT_S,
    AsyncClient,
    Chunk,
    Client,
    DaemonNotRunningError,
    InvalidRequestError,
    SamplingParams,
    sampling_params_from_openai,
)

# SamplingParams fields a call may set through kwargs (stop comes as its own argument; one
# completion per call, so no n; LangChain messages have no place for per-token logprobs).
_CALL_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"stop", "n", "logprobs"}
# The ones that are also constructor fields.
_MODEL_PARAMS = (
    "temperature",
    "max_tokens",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class _Request(NamedTuple):
    """One call, translated: what the Client gets (max_tokens None: up to the context window)."""

    model: str
    messages: list[dict[str, Any]]
    params: dict[str, Any]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    response_format: dict[str, Any] | None
    chat_template_kwargs: dict[str, Any] | None
    parallel_tool_calls: bool | None

    def sampling_params(self) -> SamplingParams:
        return sampling_params_from_openai(self.params)  # max_tokens unset: the daemon fills the context

    def chat(self) -> dict[str, Any]:
        """The Client's chat keywords of this call."""
        return dict(
            tools=self.tools,
            tool_choice=self.tool_choice,
            response_format=self.response_format,
            chat_template_kwargs=self.chat_template_kwargs,
            parallel_tool_calls=self.parallel_tool_calls,
        )


class ChatMiniSGL(BaseChatModel):
    """A chat model served by the local minisgl daemon (found, or started, for `model`).

        llm = ChatMiniSGL(model="smollm2", temperature=0, max_tokens=128)
        llm.invoke([("system", "Be brief."), ("human", "Hi!")])
        for chunk in llm.stream("Tell me a story"): print(chunk.content, end="")
        await llm.ainvoke("Hello")                      # zmq.asyncio, no thread pool
        llm.bind_tools([add], tool_choice="any").invoke("What is 2 + 3?").tool_calls
        llm.with_structured_output(Joke).invoke("A joke about cats")
        llm.invoke("Hi", model="Qwen/Qwen2.5-0.5B-Instruct")  # per call: that model's daemon

    usage_metadata carries input/output/total tokens and input_token_details.cache_read (prompt
    tokens served from the prefix cache); response_metadata carries model_name, finish_reason
    and model_provider="minisgl". When streaming, usage and finish_reason are on the last chunk.
    Errors are minisgl's typed exceptions (InvalidRequestError, PromptTooLongError, ...).
    """

    model: str = "smollm2"
    """A model name/path as `minisgl serve --model` takes it (an alias, a directory, a .gguf, a hub id)."""
    address: str | None = Field(default_factory=from_env("MINISGL_ADDRESS", default=None))
    """The daemon serving `model` (ipc:///path or tcp://host:port; default $MINISGL_ADDRESS). None: the
    daemon registered for the model, started when none runs. A per-call `model=` other than
    `model` is always located this way."""
    auto_start: bool = True
    """Start a daemon when none serves the model."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Engine options (num_pages, dtype, ...) for a daemon started here; a found daemon must match them."""

    temperature: float | None = None
    max_tokens: int | None = None
    """Tokens to generate at most; None: until the end of the answer or of the context window."""
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Stop strings for every call; a call's own `stop` adds to them."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Call keywords for every call that are not fields here (SamplingParams fields such as min_tokens,
    logit_bias or ignore_eos); unknown constructor arguments are moved here with a warning, as in ChatOpenAI,
    and a call then rejects the ones that are not parameters (InvalidRequestError)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra chat-template variables for every call, e.g. {"enable_thinking": False} for Qwen3 (vLLM and
    SGLang's name); a call's own `chat_template_kwargs` are merged over them."""

    timeout: float | None = DEFAULT_TIMEOUT_S
    """Seconds to wait for each reply of the daemon (and for a daemon to start); None: no limit."""
    max_retries: int = 2
    """Times a request is sent again when the daemon went away before answering it (the daemon is
    located again, and restarted with auto_start)."""
    api_key: SecretStr | None = None
    """Accepted like every LangChain chat model's; the local daemon needs none (a remote one is
    protected with CURVE keys: $MINISGL_CURVE_CLIENT_KEY / $MINISGL_CURVE_SERVER_KEY)."""
    streaming: bool = False
    """Route invoke through _stream, as LangChain's other chat models do (callbacks get every token
    either way: the daemon always streams)."""

    model_config = ConfigDict(populate_by_name=True)

    _clients: dict[tuple[str, str | None], Client] = PrivateAttr(default_factory=dict)
    _async_clients: dict[Any, dict[tuple[str, str | None], AsyncClient]] = PrivateAttr(default_factory=dict)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="before")
    @classmethod
    def _extra_to_model_kwargs(cls, values: Any) -> Any:
        """Constructor arguments that are not fields go to model_kwargs (with LangChain's warning)."""
        if not isinstance(values, dict):
            return values
        return _build_model_kwargs(dict(values), get_pydantic_field_names(cls))

    # ------------------------------------------------------------------ LangChain's hooks

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """dumpd()/load() round-trip the settings (never the connections; api_key as a secret)."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_minisgl", "chat_models"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "MINISGL_API_KEY"}

    @property
    def lc_attributes(self) -> dict[str, Any]:
        # Always written, None included: a revived model keeps this one's daemon, not $MINISGL_ADDRESS's.
        return {"address": self.address}

    @property
    def _llm_type(self) -> str:
        return "minisgl-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        params = {"model": self.model, "address": self.address, "stop": self.stop}
        params.update({name: getattr(self, name) for name in _MODEL_PARAMS if getattr(self, name) is not None})
        return params

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER, ls_model_name=kwargs.get("model") or self.model, ls_model_type="chat"
        )
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = merge_stops(self.stop, stop)
        if stops:
            params["ls_stop"] = stops
        return params

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # The daemon always streams; callbacks get the tokens as they come.
        return chat_result(list(self._stream(messages, stop, run_manager, **kwargs)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return chat_result([chunk async for chunk in self._astream(messages, stop, run_manager, **kwargs)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        message_chunks = MessageChunks(request.model)
        for chunk in self._client_chunks(request):
            generation = message_chunks.convert(chunk)
            if generation is None:
                continue
            if run_manager is not None:
                run_manager.on_llm_new_token(generation.text, chunk=generation)
            yield generation

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        message_chunks = MessageChunks(request.model)
        async for chunk in self._aclient_chunks(request):
            generation = message_chunks.convert(chunk)
            if generation is None:
                continue
            if run_manager is not None:
                await run_manager.on_llm_new_token(generation.text, chunk=generation)
            yield generation

    # ------------------------------------------------------------------ tools, structured output

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer tools to the model; the answer's AIMessage.tool_calls holds its calls.

        tools: LangChain tools, functions, pydantic models, TypedDicts or OpenAI/Anthropic tool dicts.
        tool_choice: "auto" (default: the model decides), "none", "required" or "any" (at least one
        call; here exactly one), a tool name or {"type": "function", "function": {"name": ...}}
        (that tool), True (the only tool, or any tool when several). Forced calls are
        grammar-constrained, so their arguments always match the tool's schema.
        parallel_tool_calls=False: at most one call (as OpenAI's).
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        choice = tool_choice_of(tool_choice, formatted)
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Answers parsed into `schema` (a pydantic class → instances; a TypedDict or JSON schema → dicts).

        method "json_schema" (default): the reply is constrained to the schema's JSON by a grammar;
        "function_calling": a forced call of a tool built from the schema; "json_mode": the reply
        is any JSON object (say in the prompt which keys to use). include_raw: return
        {"raw": AIMessage, "parsed": ..., "parsing_error": ...} instead of raising on bad output.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        output_parser: Runnable
        if method == "json_schema":
            name, json_schema = json_schema_of(schema, strict)
            response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema}}
            if strict is not None:
                response_format["json_schema"]["strict"] = strict
            llm = self.bind(response_format=response_format, ls_structured_output_format=trace)
            output_parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        elif method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, ls_structured_output_format=trace)
            if is_pydantic:
                output_parser = PydanticToolsParser(tools=[schema], first_tool_only=True)
            else:
                output_parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        elif method == "json_mode":
            trace["kwargs"] = {"method": method}
            llm = self.bind(response_format={"type": "json_object"}, ls_structured_output_format=trace)
            output_parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"unknown method {method!r}: use 'json_schema', 'function_calling' or 'json_mode'")
        if not include_raw:
            return llm | output_parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | output_parser, parsing_error=lambda _: None)
        keep_error = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([keep_error], exception_key="parsing_error")

    # ------------------------------------------------------------------ token counting (the model's own tokenizer)

    def get_token_ids(self, text: str) -> list[int]:
        """The model's token ids of `text`, from its tokenizer in the daemon (no BOS); LangChain's default would
        use GPT-2's. get_num_tokens(text) counts these."""
        return self._client(self.model).tokenize(text, add_special_tokens=False)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """The prompt tokens of these messages as this model reads them: rendered with its chat template (with the
        tools and chat_template_kwargs), the count a call reports as usage_metadata["input_tokens"]."""
        openai_tools = [convert_to_openai_tool(t) for t in tools] if tools else None
        return len(
            self._client(self.model).tokenize(
                to_chat_messages(messages),
                tools=openai_tools,
                chat_template_kwargs=self.chat_template_kwargs,
            )
        )

    # ------------------------------------------------------------------ clients

    def close(self) -> None:
        """Close the sync clients (the async ones of a running loop: `await aclose()`)."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    async def aclose(self) -> None:
        """Close the clients of this event loop and the sync clients."""
        clients = self._async_clients.pop(asyncio.get_running_loop(), {})
        for client in clients.values():
            await client.close()
        self.close()

    def _address_for(self, model: str) -> str | None:
        return self.address if model == self.model else None

    def _client(self, model: str) -> Client:
        key = (model, self._address_for(model))
        with self._lock:  # one Client per daemon, also when a batch starts in many threads at once
            client = self._clients.get(key)
            if client is None:
                client = Client(model, key[1], self.auto_start, self.timeout, **self.engine_kwargs)
                self._clients[key] = client
        return client

    def _forget_client(self, model: str) -> None:
        with self._lock:
            client = self._clients.pop((model, self._address_for(model)), None)
        if client is not None:
            client.close()

    def _async_client(self, model: str) -> AsyncClient:
        # An AsyncClient belongs to the loop it connected in: one set per loop. Clients of loops
        # that are closed can no longer be closed; drop them.
        loop = asyncio.get_running_loop()
        key = (model, self._address_for(model))
        with self._lock:  # loops of other threads share the table
            for stale in [other for other in list(self._async_clients) if other.is_closed()]:
                del self._async_clients[stale]
            clients = self._async_clients.setdefault(loop, {})
            client = clients.get(key)
            if client is None:
                client = clients[key] = AsyncClient(model, key[1], self.auto_start, self.timeout, **self.engine_kwargs)
        return client

    def _client_chunks(self, request: _Request) -> Iterator[Chunk]:
        for attempt in range(self.max_retries + 1):
            client = self._client(request.model)
            answered = False
            try:
                stream = client.stream(request.messages, request.sampling_params(), **request.chat())
                with stream:
                    for chunk in stream:
                        answered = True
                        yield chunk
                return
            except DaemonNotRunningError:
                if answered or attempt == self.max_retries:
                    raise
                self._forget_client(request.model)

    async def _aclient_chunks(self, request: _Request) -> AsyncIterator[Chunk]:
        for attempt in range(self.max_retries + 1):
            client = await self._async_client(request.model).connect()
            answered = False
            try:
                stream = client.stream(request.messages, request.sampling_params(), **request.chat())
                async with stream:
                    async for chunk in stream:
                        answered = True
                        yield chunk
                return
            except DaemonNotRunningError:
                if answered or attempt == self.max_retries:
                    raise
                clients = self._async_clients.get(asyncio.get_running_loop(), {})
                clients.pop((request.model, self._address_for(request.model)), None)
                await client.close()

    # ------------------------------------------------------------------ LangChain → minisgl

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Request:
        kwargs = {**self.model_kwargs, **kwargs}
        kwargs.pop("stream", None)  # stream=True reaches here from invoke(); we always stream
        model = kwargs.pop("model", None) or self.model
        tools = kwargs.pop("tools", None) or None
        tool_choice = kwargs.pop("tool_choice", None)
        response_format = kwargs.pop("response_format", None)
        parallel_tool_calls = kwargs.pop("parallel_tool_calls", None)
        template_kwargs = kwargs.pop("chat_template_kwargs", None)
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise InvalidRequestError("chat_template_kwargs must be a dict of template variables")
        if self.chat_template_kwargs or template_kwargs:
            template_kwargs = {**(self.chat_template_kwargs or {}), **(template_kwargs or {})}
        unknown = set(kwargs) - _CALL_PARAMS
        if unknown:
            raise InvalidRequestError(
                f"ChatMiniSGL does not take {sorted(unknown)}: a call takes model, stop, tools, tool_choice, "
                f"parallel_tool_calls, response_format, chat_template_kwargs and the sampling parameters "
                f"{sorted(_CALL_PARAMS)}"
            )
        params = {name: getattr(self, name) for name in _MODEL_PARAMS if getattr(self, name) is not None}
        params.update(kwargs)
        params["stop"] = merge_stops(self.stop, stop)
        return _Request(
            model,
            to_chat_messages(messages),
            params,
            tools,
            tool_choice,
            response_format,
            template_kwargs or None,
            parallel_tool_calls,
        )


# ---------------------------------------------------------------------- minisgl → LangChain

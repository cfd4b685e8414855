"""OpenAI's API: /v1/models, /v1/chat/completions, /v1/completions and /v1/embeddings.

The routes validate the body (server/protocol.py), translate it into one Client call and translate the daemon's
chunks back into OpenAI JSON (or SSE). Errors found before the first streamed byte are ordinary HTTP errors; after
it they travel as an error event.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl.server.edge import EdgeRoute
from minisgl.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ModelCard,
    ModelList,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from minisgl.server.state import check_key, error_event, fail, server_of, sse
from minisgl.server.streams import StreamWriter, gather_all, merge_streams, streamed_response, unless_disconnected

router = APIRouter(prefix="/v1", dependencies=[Depends(check_key)], route_class=EdgeRoute)


def _usage(u: Any) -> Usage:
    """The OpenAI usage of a client Usage (prompt/completion/cached tokens); zeros when absent."""
    if u is None:
        return Usage.of(0, 0, 0)
    return Usage.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens, getattr(u, "spec_accepted_tokens", 0))


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries: Sequence[dict[str, Any]] | None) -> ChoiceLogprobs | None:
    """The daemon's per-token logprobs ({token, logprob, top_logprobs: [{token, logprob}]}) in chat form."""
    if not entries:
        return None
    content = [
        TokenLogprob(
            token=e["token"],
            logprob=e["logprob"],
            bytes=_utf8(e["token"]),
            top_logprobs=[
                TopLogprob(token=t["token"], logprob=t["logprob"], bytes=_utf8(t["token"]))
                for t in e.get("top_logprobs") or []
            ],
        )
        for e in entries
    ]
    return ChoiceLogprobs(content=content)


def completion_logprobs(entries: Sequence[dict[str, Any]] | None, text_offset: int) -> CompletionLogprobs | None:
    """The daemon's per-token logprobs in the legacy completions form; offsets start at text_offset."""
    if not entries:
        return None
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(e["token"])
        out.token_logprobs.append(e["logprob"])
        if e["logprob"] is None:  # an echoed prompt's first token: nothing predicts it
            out.top_logprobs.append(None)
        else:  # the alternatives and, as OpenAI's (up to logprobs + 1 entries), the token itself
            top = {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []}
            top.setdefault(e["token"], e["logprob"])
            out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(e["token"])
    return out


def _chunk_json(chunk: ChatCompletionChunk | CompletionResponse, include_usage: bool) -> dict[str, Any]:
    """OpenAI's chunk shape: deltas carry only the fields they set; usage is present iff asked for."""
    d = chunk.model_dump()
    for choice in d["choices"]:
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if not include_usage:
        d.pop("usage", None)
    return d


@router.get("/models")
async def list_models(request: Request) -> ModelList:
    server = server_of(request)
    context_len, engine = await server.context_len(), _engine_facts(await server.info())
    return ModelList(data=[ModelCard(id=name, max_model_len=context_len, **engine) for name in server.served_names])


@router.get("/models/{model:path}")
async def get_model(model: str, request: Request) -> ModelCard:
    server = server_of(request)
    await server.check_model(model)
    engine = _engine_facts(await server.info())
    return ModelCard(id=server.model_name, max_model_len=await server.context_len(), **engine)


def _engine_facts(info: dict[str, Any]) -> dict[str, Any]:
    """The quantization and threads the daemon reports (absent from a daemon of an older version)."""
    return {key: info.get(key) for key in ("quantization", "threads")}


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    server = server_of(request)
    timer = server.metrics.request("chat")
    try:
        await server.check_model(body.model)
        kwargs = dict(
            sampling_params=body.to_sampling_params(),
            tools=body.tools or None,
            tool_choice=body.tool_choice,
            response_format=body.response_format_dict(),
            chat_template_kwargs=body.chat_template_kwargs,
            parallel_tool_calls=body.parallel_tool_calls,
        )
        messages = body.chat_messages()
        rid = new_id("chatcmpl")
        if body.stream:
            stream = server.client.stream(messages, rid=rid, **kwargs)
            return await streamed_response(stream, _ChatEvents(body, rid, server.model_name), timer)
        out = await unless_disconnected(request, server.client.generate(messages, rid=rid, **kwargs))
    except BaseException as e:
        return fail(timer, e)
    response = _chat_response(out, rid, server.model_name, body)
    if body.prompt_logprobs is not None:
        response.prompt_logprobs = out.prompt_logprobs  # the rendered chat prompt's tokens
    u = response.usage
    timer.done(200, u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens)
    return JSONResponse(response.model_dump())


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    server = server_of(request)
    timer = server.metrics.request("embeddings")
    try:
        await server.check_model(body.model)
        out = await unless_disconnected(request, server.client.embed(body.inputs()))
    except BaseException as e:
        return fail(timer, e)
    data = [
        EmbeddingData(
            index=i, embedding=_base64_floats(e.embedding) if body.encoding_format == "base64" else e.embedding
        )
        for i, e in enumerate(out)
    ]
    tokens = sum(e.prompt_tokens for e in out)
    timer.done(200, tokens, 0, 0)
    response = EmbeddingResponse(
        data=data, model=server.model_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )
    return JSONResponse(response.model_dump())


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    server = server_of(request)
    timer = server.metrics.request("completions")
    try:
        await server.check_model(body.model)
        kwargs = dict(sampling_params=body.to_sampling_params(), response_format=body.response_format_dict())
        prompts = body.prompts()
        rid = new_id("cmpl")
        rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        if body.stream:
            streams = [server.client.stream(p, rid=r, **kwargs) for p, r in zip(prompts, rids)]
            merged = merge_streams(streams)
            return await streamed_response(merged, _CompletionEvents(body, rid, server.model_name), timer)
        outs = await unless_disconnected(
            request, gather_all([server.client.generate(p, rid=r, **kwargs) for p, r in zip(prompts, rids)])
        )
        # Echoed token-id prompts are decoded whole (as vLLM): token by token, a character split across
        # tokens (an emoji) would come back as replacement characters.
        echoes = None
        if body.echo:
            echoes = [p if isinstance(p, str) else await server.client.detokenize(p) for p in prompts]
    except BaseException as e:
        return fail(timer, e)
    response = _completion_response(outs, rid, server.model_name, body, echoes)
    u = response.usage or Usage()
    timer.done(200, u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens)
    return JSONResponse(response.model_dump())


def _base64_floats(values: list[float]) -> str:
    """OpenAI's encoding_format="base64": the vector as little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def _chat_finish(finish: str | None, body: ChatCompletionRequest) -> str | None:
    """The daemon's finish reason ("tool_calls" when a call was made), as OpenAI's chat API reports it: a call
    forced by a named tool_choice finishes with "stop" there (vLLM aligned with it too)."""
    return "stop" if finish == "tool_calls" and isinstance(body.tool_choice, dict) else finish


def _chat_response(out: Any, rid: str, model: str, body: ChatCompletionRequest) -> ChatCompletionResponse:
    choices = []
    for o in out.outputs:
        calls = [ToolCall.model_validate(c) for c in o.tool_calls or []] or None
        message = ChatMessage(
            content=o.text if (o.text or not calls) else None, tool_calls=calls, reasoning_content=o.reasoning_content
        )
        choices.append(
            ChatChoice(
                index=o.index,
                message=message,
                logprobs=chat_logprobs(o.logprobs),
                finish_reason=_chat_finish(o.finish_reason, body),
            )
        )
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=_usage(out.usage))


def _completion_response(
    outs: list[Any], rid: str, model: str, body: CompletionRequest, echoes: list[str] | None
) -> CompletionResponse:
    """One choice per prompt and sample; with echo each starts with its prompt's text, echoes[p] (and, with
    logprobs, its prompt tokens' logprobs, offsets counted from the prompt's start)."""
    choices = []
    usage = Usage.of(0, 0, 0)
    for p, out in enumerate(outs):
        prompt_entries = out.prompt_logprobs or []
        echoed = echoes[p] if echoes is not None else ""
        for o in out.outputs:
            entries = (
                ([*prompt_entries, *(o.logprobs or [])] if body.echo else o.logprobs)
                if body.logprobs is not None
                else None
            )
            choices.append(
                CompletionChoice(
                    index=p * body.n + o.index,
                    text=echoed + o.text,
                    logprobs=completion_logprobs(entries, 0),
                    finish_reason=o.finish_reason,
                    prompt_logprobs=out.prompt_logprobs if body.prompt_logprobs is not None else None,
                )
            )
        usage = usage + _usage(out.usage)
    return CompletionResponse(id=rid, model=model, choices=choices, usage=usage)


class _OpenAIEvents(StreamWriter):
    """OpenAI's SSE: an error travels as an event with OpenAI's error body, and [DONE] ends the stream either way."""

    trailer = sse("[DONE]")

    def __init__(self, include_usage: bool) -> None:
        self.include_usage, self.created = include_usage, now()  # every chunk carries the stream's one timestamp
        self.usage: Usage | None = None

    def error(self, e: BaseException) -> str:
        return error_event(e)

    def tokens(self) -> tuple[int, int, int]:
        u = self.usage or Usage()
        return u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens


class _ChatEvents(_OpenAIEvents):
    """/v1/chat/completions' chunks: a role delta when a choice starts, then its content, tool-call, reasoning and
    logprob deltas, and with include_usage a last chunk of usage alone."""

    def __init__(self, body: ChatCompletionRequest, rid: str, model: str) -> None:
        super().__init__(body.include_usage)
        self.body, self.rid, self.model = body, rid, model
        self.started: set[int] = set()

    def _event(self, choice: ChatChunkChoice) -> str:
        piece = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[choice])
        return sse(_chunk_json(piece, self.include_usage))

    async def item(self, chunk: Any) -> list[str]:
        events, index, body = [], int(chunk.index), self.body
        if index not in self.started:
            self.started.add(index)
            events.append(self._event(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))))
        tool_deltas, finish = chunk.tool_calls, _chat_finish(chunk.finish_reason, body)
        logprobs = chat_logprobs(chunk.logprobs) if body.logprobs else None
        if chunk.text or chunk.reasoning or tool_deltas or logprobs or finish:
            delta = DeltaMessage(
                content=chunk.text or None, tool_calls=tool_deltas or None, reasoning_content=chunk.reasoning or None
            )
            events.append(
                self._event(ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish))
            )
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage)
        return events

    def end(self) -> list[str]:
        if not self.include_usage:
            return []
        usage = self.usage or Usage.of(0, 0, 0)
        final = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage)
        return [sse(_chunk_json(final, True))]


class _CompletionEvents(_OpenAIEvents):
    """/v1/completions' chunks over the merged streams of its prompts: choice index prompt * n + sample."""

    def __init__(self, body: CompletionRequest, rid: str, model: str) -> None:
        super().__init__(body.include_usage)
        self.body, self.rid, self.model = body, rid, model
        self.usage = Usage.of(0, 0, 0)
        self.offsets: dict[int, int] = {}  # per choice, the characters streamed so far (logprobs' text_offset)

    async def item(self, item: tuple[int, Any]) -> list[str]:
        p, chunk = item
        body, events = self.body, []
        index = p * body.n + int(chunk.index)
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(chunk.logprobs, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + len(chunk.text)
        if chunk.text or logprobs or chunk.finish_reason:
            choice = CompletionChoice(
                index=index, text=chunk.text, logprobs=logprobs, finish_reason=chunk.finish_reason
            )
            piece = CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[choice])
            events.append(sse(_chunk_json(piece, self.include_usage)))
        if chunk.usage is not None:
            self.usage = self.usage + _usage(chunk.usage)
        return events

    def end(self) -> list[str]:
        if not self.include_usage:
            return []
        final = CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[], usage=self.usage)
        return [sse(_chunk_json(final, True))]

"""The daemon's wire protocol: typed, versioned messages and the one codec that packs them.

Every message is a NamedTuple registered under a short tag; on the wire it is the msgpack
array ``[PROTOCOL_VERSION, tag, *fields]``. Nested NamedTuples travel as arrays and are rebuilt
by the receiving class's ``from_wire``. Anything that does not decode to a known message of
this version raises ProtocolError, which the daemon answers with an error reply.
"""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple, TypeVar, Union

import msgpack

from minisgl import errors
from minisgl.core import TokenOutput, describe_int, int64_overflow
from minisgl.errors import DaemonError

PROTOCOL_VERSION = (
    4  # 2: embed, tokenize, detokenize, flush_cache; 3: Chunk.finish_detail; 4: Usage.spec_accepted_tokens
)

_BY_TAG: dict[str, type] = {}
_T = TypeVar("_T")


class ProtocolError(DaemonError):
    """A message that is not valid msgpack, not a known message type, or of another protocol version."""


def _message(tag: str) -> Callable[[type[_T]], type[_T]]:
    def register(cls: type[_T]) -> type[_T]:
        assert tag not in _BY_TAG, f"duplicate message tag {tag!r}"
        cls.TAG = tag  # type: ignore[attr-defined]
        _BY_TAG[tag] = cls
        return cls

    return register


# ---------------------------------------------------------------------------- client -> daemon


@_message("generate")
class Generate(NamedTuple):
    """Generate from exactly one of prompt (text), input_ids or messages (chat)."""

    rid: str
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    # SamplingParams.to_dict() (validated again by the daemon: the socket is a trust boundary); None: SamplingParams().
    # Its keys are SamplingParams' fields: renaming or retyping one is a new PROTOCOL_VERSION.
    params: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI-style tool definitions
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    response_format: dict[str, Any] | None = None  # OpenAI-style {"type": "json_object" | "json_schema" | "text", ...}
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat-template variables (messages only)
    embed: bool = False  # an embedding request (prompt or input_ids): answered by one Chunk with `embedding`
    parallel_tool_calls: bool | None = None  # OpenAI's: False allows at most one tool call (messages with tools)


@_message("flush_cache")
class FlushCache(NamedTuple):
    """Forget every cached prefix no request holds (SGLang's /flush_cache, vLLM's /reset_prefix_cache); the reply
    is a StatsReply taken after it."""

    rid: str


@_message("tokenize")
class Tokenize(NamedTuple):
    """The token ids of exactly one of prompt (text) or messages (chat, rendered as a generate request renders them)."""

    rid: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # prompt only: the tokenizer's BOS (what a generate request gets)
    add_generation_prompt: bool = True  # messages only: end with the assistant's turn opening
    tools: list[dict[str, Any]] | None = None  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only


@_message("detokenize")
class Detokenize(NamedTuple):
    rid: str
    input_ids: list[int]
    skip_special_tokens: bool = False


@_message("abort")
class Abort(NamedTuple):
    rid: str


@_message("ping")
class Ping(NamedTuple):
    rid: str


@_message("get_model_info")
class GetModelInfo(NamedTuple):
    rid: str


@_message("get_stats")
class GetStats(NamedTuple):
    rid: str


@_message("shutdown")
class Shutdown(NamedTuple):
    rid: str
    reason: str = "asked by a client"


# ---------------------------------------------------------------------------- daemon -> client


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    spec_accepted_tokens: int = 0  # of completion_tokens, draft tokens accepted (--speculative)


class Chunk(NamedTuple):
    """One piece of a request's output: new text and tokens of sequence `index`.

    finish_reason is set on the last chunk of each sequence; done and usage on the last chunk
    of the whole request (all n sequences finished).
    """

    rid: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None = None  # per token: {token_id, token, logprob, top_logprobs}
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "tool_calls"
    matched_stop: str | int | None = None
    tool_calls: list[dict[str, Any]] | None = None  # tool-call deltas (see minisgl.structured.parsers)
    usage: Usage | None = None
    done: bool = False
    reasoning: str = ""  # new reasoning text (<think> part), with a --reasoning-parser; text is then the answer
    # With prompt_logprobs, once (first chunk of sample 0): per prompt token {token_id, token, logprob,
    # top_logprobs}; the first token's logprob is None (nothing predicts it).
    prompt_logprobs: list[dict[str, Any]] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (its one chunk)
    finish_detail: str | None = None  # with finish_reason: what the user should know of it (a cut-off grammar)


@_message("chunks")
class Chunks(NamedTuple):
    items: list[Chunk]

    @classmethod
    def from_wire(cls, fields: list[Any]) -> "Chunks":
        items = []
        for item in fields[0]:
            chunk = Chunk(*item)
            if chunk.usage is not None:
                chunk = chunk._replace(usage=Usage(*chunk.usage))
            items.append(chunk)
        return cls(items)


@_message("error")
class Error(NamedTuple):
    """The request `rid` failed (or, with rid "", the connection sent something unusable)."""

    rid: str
    error_type: str  # a class name from minisgl.errors (or ProtocolError)
    message: str


@_message("pong")
class Pong(NamedTuple):
    rid: str
    state: str  # "starting" | "ready" | "stopping"
    pid: int
    model: str
    address: str
    version: str  # minisgl version
    config: dict[str, Any]


@_message("model_info")
class ModelInfoReply(NamedTuple):
    rid: str
    info: dict[str, Any]


@_message("tokens")
class TokenizeReply(NamedTuple):
    rid: str
    input_ids: list[int]
    max_model_len: int


@_message("text")
class DetokenizeReply(NamedTuple):
    rid: str
    text: str


@_message("stats")
class StatsReply(NamedTuple):
    rid: str
    stats: dict[str, Any]


# ---------------------------------------------------------------------------- inside the daemon


@_message("add_request")
class AddRequest(NamedTuple):
    """Tokenizer worker -> scheduler: a tokenized, validated request."""

    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    detok: dict[str, Any]  # what the detokenizer needs (stop, skip_special_tokens, n, tools); passed through
    embed: bool = False  # an embedding request (Scheduler.add_request's embed)


@_message("request_meta")
class RequestMeta(NamedTuple):
    """Scheduler -> detokenizer, ahead of the request's first output on the same pipe."""

    rid: str
    detok: dict[str, Any]


@_message("token_outputs")
class TokenOutputs(NamedTuple):
    """Scheduler -> detokenizer: everything one step produced."""

    items: list[TokenOutput]

    @classmethod
    def from_wire(cls, fields: list[Any]) -> "TokenOutputs":
        return cls([TokenOutput(*item) for item in fields[0]])


@_message("worker_init")
class WorkerInit(NamedTuple):
    """What the tokenizer and detokenizer workers need from the loaded model."""

    model_info: dict[str, Any]
    tokenizer_dir: str  # where the scheduler loaded its tokenizer from: the workers load the same files


@_message("tokenizer_dir")
class TokenizerDir(NamedTuple):
    """Where the model's tokenizer is, sent by the scheduler before it loads the weights: the text worker reads the
    tokenizer meanwhile (WorkerInit follows with the same directory once the model is up)."""

    tokenizer_dir: str


@_message("scheduler_ready")
class SchedulerReady(NamedTuple):
    model_info: dict[str, Any]
    stats: dict[str, Any]


@_message("worker_ready")
class WorkerReady(NamedTuple):
    worker: str


@_message("worker_failed")
class WorkerFailed(NamedTuple):
    """A worker hit an error it cannot recover from; the daemon reports it and shuts down."""

    worker: str
    error_type: str
    message: str


Message = Union[
    Generate,
    Tokenize,
    Detokenize,
    FlushCache,
    Abort,
    Ping,
    GetModelInfo,
    GetStats,
    Shutdown,
    Chunks,
    Error,
    Pong,
    ModelInfoReply,
    TokenizeReply,
    DetokenizeReply,
    StatsReply,
    AddRequest,
    RequestMeta,
    TokenOutputs,
    WorkerInit,
    TokenizerDir,
    SchedulerReady,
    WorkerReady,
    WorkerFailed,
]
CLIENT_MESSAGES = (Generate, Tokenize, Detokenize, FlushCache, Abort, Ping, GetModelInfo, GetStats, Shutdown)


def encode(msg: Message) -> bytes:
    """The message's bytes; text that has no UTF-8 form (an unpaired UTF-16 surrogate, which JSON can carry)
    is the sender's InvalidRequestError."""
    try:
        return msgpack.packb([PROTOCOL_VERSION, type(msg).TAG, *msg], use_bin_type=True)  # type: ignore[union-attr]
    except UnicodeEncodeError as e:
        bad = e.object[e.start : e.end]
        raise errors.InvalidRequestError(
            f"the request holds text that is not valid Unicode ({bad!r}: half of a UTF-16 surrogate pair): "
            "send whole characters"
        ) from None
    except OverflowError:
        found = int64_overflow(msg._asdict())  # type: ignore[union-attr]
        what = f"{found[0]} is {describe_int(found[1])}" if found else "an integer of the request is too large"
        raise errors.InvalidRequestError(
            f"{what}: token ids and every other integer must fit in 64 bits ([-2**63, 2**63 - 1])"
        ) from None


def decode(data: bytes) -> Message:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types for bad input
        raise ProtocolError(f"malformed message: not msgpack ({type(e).__name__})") from e
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], str):
        raise ProtocolError("malformed message: expected [version, type, fields...]")
    version, tag, fields = obj[0], obj[1], obj[2:]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION}): "
            "use the same minisgl version for the client and the daemon"
        )
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    required = len(cls._fields) - len(cls._field_defaults)
    if not required <= len(fields) <= len(cls._fields):
        raise ProtocolError(f"message {tag!r} takes {required}..{len(cls._fields)} fields, got {len(fields)}")
    try:
        return cls.from_wire(fields) if hasattr(cls, "from_wire") else cls(*fields)
    except (TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"malformed {tag!r} message: {e}") from e


def error_class(name: str) -> type[Exception]:
    """The exception class an Error reply names (a minisgl.errors class, ProtocolError, else MiniSGLError)."""
    if name == ProtocolError.__name__:
        return ProtocolError
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.MiniSGLError):
        return cls
    return errors.MiniSGLError


def error_reply(rid: str, exc: BaseException) -> Error:
    """The Error message for an exception: typed errors keep their class, anything else is reported as is."""
    if isinstance(exc, errors.MiniSGLError):
        return Error(rid, type(exc).__name__, str(exc))
    return Error(rid, "MiniSGLError", f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------- start-up failure line

# The last line a daemon that could not start writes to stderr; whoever spawned it re-raises the error.
STARTUP_FAILED = "minisgl: start-up failed: "


def startup_failure(log: str) -> tuple[str, str] | None:
    """The (error type, message) a failed daemon reported in its output, if any."""
    for line in reversed(log.splitlines()):
        if line.startswith(STARTUP_FAILED):
            try:
                d = json.loads(line[len(STARTUP_FAILED) :])
                return str(d["error_type"]), str(d["message"])
            except (ValueError, KeyError, TypeError):
                return None
    return None

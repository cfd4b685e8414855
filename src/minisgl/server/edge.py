"""What the HTTP edge checks of a JSON body before a route validates it, on every router (their route class).

RequestGuard has counted and scanned the body's bytes (server/guard.py, server/bodyscan.py). Here, with the served
model's context window and vocabulary:
- before parsing, a large body's prompts of token ids are counted in its scan: one longer than the context window
  is refused without building its millions of Python ints, and so is a body holding more numbers than any field
  takes;
- the body is parsed once, a large one in a worker thread, and the route reads that parse (EdgeRequest);
- every integer must fit in 64 bits (what msgpack carries; a max_tokens past that runs to the context's end, as
  any past the context does), token ids must be in [0, vocab), and a prompt's characters are bounded by what the
  context window can hold (MAX_CHARS_PER_TOKEN a token): before anything is sent to the daemon's tokenizer.

A refusal is a 400 naming the field (OpenAI's error body; Ollama's {"error": ...} on /api routes).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Coroutine, NamedTuple

import anyio.to_thread
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from minisgl.core import describe_int, int64_overflow
from minisgl.server.bodyscan import BodyShape
from minisgl.server.state import APIError, ModelFacts, server_of

MAX_CHARS_PER_TOKEN = 256  # past any tokenizer's longest token (SmolLM2's is 81 characters)
PARSE_IN_THREAD_BYTES = 256 * 2**10  # parsing a larger body would hold the event loop for milliseconds or more
BODY_SHAPE = "minisgl.body_shape"  # the scope key of RequestGuard's scan of a large body
_PROMPT_ID_FIELDS = ("prompt", "input", "input_ids")  # a prompt of token ids (or a batch of them) in some API
_ID_FIELDS = (*_PROMPT_ID_FIELDS, "tokens")  # token ids: /detokenize's too
_PROMPT_FIELDS = ("prompt", "input", "input_ids", "messages")  # what the tokenizer reads (and SGLang's "text")
_CLAMPED = frozenset({"max_tokens", "max_completion_tokens", "max_new_tokens", "max_output_tokens", "num_predict"})
_SPARE_NUMBERS = 65536  # numbers a body may hold besides its prompts, its logit_bias and stop_token_ids


class _Parsed(NamedTuple):
    value: Any
    error: Exception | None  # json.loads' error, raised where the route reads the body


class EdgeRequest(Request):
    """The request a route sees: its body already read, and parsed once."""

    def __init__(self, request: Request, body: bytes, parsed: _Parsed) -> None:
        super().__init__(request.scope, request.receive)
        self._edge_body, self._parsed = body, parsed

    async def body(self) -> bytes:
        return self._edge_body

    async def json(self) -> Any:
        if self._parsed.error is not None:
            raise self._parsed.error
        return self._parsed.value


class EdgeRoute(APIRoute):
    """An APIRoute whose JSON body passes check_body before FastAPI or the route reads it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method not in ("POST", "PUT", "PATCH"):
                return await handler(request)
            body = await request.body()
            try:
                parsed = await _parse(request, body)
            except APIError as e:
                return self.refusal(e)
            return await handler(EdgeRequest(request, body, parsed))

        return checked

    def refusal(self, e: APIError) -> Response:
        return e.response()


class OllamaEdgeRoute(EdgeRoute):
    def refusal(self, e: APIError) -> Response:
        return JSONResponse({"error": e.message}, status_code=e.status)


async def _parse(request: Request, body: bytes) -> _Parsed:
    if not body:
        return _Parsed(None, json.JSONDecodeError("Expecting value", "", 0))
    facts = await server_of(request).model_facts()
    shape = request.scope.pop(BODY_SHAPE, None)
    if shape is not None and facts is not None:
        check_shape(shape, facts)
    if len(body) < PARSE_IN_THREAD_BYTES:
        return parse_and_check(body, facts, request.url.path)

    return await anyio.to_thread.run_sync(parse_and_check, body, facts, request.url.path)


def check_shape(shape: BodyShape, facts: ModelFacts) -> None:
    """Before parsing: a prompt of ids longer than the context, or more numbers than the fields take, is refused."""
    context, in_prompts = facts.context_length, 0
    for name in _PROMPT_ID_FIELDS:
        member = shape.members.get(name)
        if member is None:
            continue
        prompts = max(1, member.containers)  # a batch: more ids than its prompts can each hold means a long one
        if member.numbers >= prompts * context:
            raise _too_long(name, f"holds {member.numbers} token ids for {prompts} prompt(s)", context)
        in_prompts += member.numbers
    allowed = in_prompts + 2 * facts.vocab_size + _SPARE_NUMBERS
    if shape.numbers > allowed:
        raise APIError(
            400,
            f"the body holds {shape.numbers} numbers: no request needs more than {allowed} here",
            "invalid_request_error",
            "too_many_numbers",
        )


def parse_and_check(body: bytes, facts: ModelFacts | None, route: str) -> _Parsed:
    """The body parsed and checked (check_body); a body that is no JSON is the route's to refuse."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:
        return _Parsed(None, e)
    check_body(value, facts, route)
    return _Parsed(value, None)


def check_body(body: Any, facts: ModelFacts | None, route: str) -> None:
    """Integers within 64 bits, token ids within the vocabulary, prompts within what the context can hold."""
    found = int64_overflow(body, _CLAMPED)
    if found is not None:
        where, value = found
        raise APIError(
            400,
            f"{where} is {describe_int(value)}: integers must fit in 64 bits ([-2**63, 2**63 - 1])",
            "invalid_request_error",
            "integer_out_of_range",
            where,
        )
    if not isinstance(body, dict) or facts is None:
        return
    vocab = facts.vocab_size
    params = body.get("sampling_params")  # SGLang's, one object or one per prompt
    for prefix, fields in (("", body), *_sampling_params(params)):
        _check_ids(fields.get("stop_token_ids"), f"{prefix}stop_token_ids", vocab)
        _check_biases(fields.get("logit_bias"), f"{prefix}logit_bias", vocab)
    for name in _ID_FIELDS:
        _check_ids(body.get(name), name, vocab)
    truncated = route == "/api/embed" and body.get("truncate", True) is not False  # Ollama cuts what is too long
    for name in (*_PROMPT_FIELDS, "text") if route == "/generate" else _PROMPT_FIELDS:
        if body.get(name) is not None and not (truncated and name == "input"):
            _check_prompt(body[name], name, facts.context_length)


def _sampling_params(params: Any) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(params, dict):
        return [("sampling_params.", params)]
    if isinstance(params, list):
        return [(f"sampling_params[{i}].", p) for i, p in enumerate(params) if isinstance(p, dict)]
    return []


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _check_ids(value: Any, name: str, vocab: int) -> None:
    """A list of token ids, or a list of such lists: each in [0, vocab). Other shapes are the route's to refuse."""
    if not isinstance(value, list) or not value:
        return
    lists = [(name, value)] if _int_list(value) else [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    for where, ids in lists:
        if _int_list(ids) and (min(ids) < 0 or max(ids) >= vocab):
            i = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise _bad_token(f"{where}[{i}]", f"{where}[{i}] is {describe_int(ids[i])}", vocab)


def _check_biases(value: Any, name: str, vocab: int) -> None:
    if not isinstance(value, dict):
        return
    for key in value:
        try:
            token = int(key)
        except (TypeError, ValueError):
            continue  # not a number: SamplingParams says so
        if not 0 <= token < vocab:
            raise _bad_token(name, f"{name} has the key {describe_int(token)}", vocab)


def _check_prompt(value: Any, name: str, context: int) -> None:
    """Ids: fewer than the context window (as the daemon counts); text: what the window can hold."""
    if _int_list(value):
        if len(value) >= context:
            raise _too_long(name, f"has {len(value)} tokens", context)
        return
    if isinstance(value, list) and value and all(_int_list(p) or isinstance(p, str) for p in value):
        for i, prompt in enumerate(value):  # a batch: each prompt alone
            _check_prompt(prompt, f"{name}[{i}]", context)
        return
    chars = _characters(value)
    if chars > context * MAX_CHARS_PER_TOKEN:
        raise _too_long(
            name,
            f"holds {chars} characters, more than {context * MAX_CHARS_PER_TOKEN} "
            f"({MAX_CHARS_PER_TOKEN} a token, the most any token spells)",
            context,
        )


def _characters(value: Any) -> int:
    """The characters of every string in a value (a text, or chat messages and their parts)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _too_long(name: str, what: str, context: int) -> APIError:
    return APIError(
        400,
        f"{name} {what}, but the context window is {context} tokens: shorten the prompt",
        "invalid_request_error",
        "context_length_exceeded",
        name,
    )


def _bad_token(where: str, what: str, vocab: int) -> APIError:
    return APIError(
        400,
        f"{what}, outside the tokenizer's vocabulary: this model's token ids are in [0, {vocab})",
        "invalid_request_error",
        "invalid_token_id",
        where,
    )

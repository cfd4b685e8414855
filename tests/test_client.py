"""The client library and the daemon's plumbing, without a model: codec, addresses, registry,
CLI flags, the tokenizer/detokenizer workers' logic, and Client/AsyncClient against a scripted
in-test ROUTER (a double of the daemon's frontend, for the transport only)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest
import zmq

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams, TokenOutput
from minisgl.errors import (
    ConfigError,
    DaemonNotRunningError,
    DaemonTimeoutError,
    GrammarError,
    InvalidRequestError,
    PromptTooLongError,
)
from minisgl.runtime import protocol as P
from minisgl.runtime.addresses import daemon_name, parse_address
from minisgl.runtime.registry import DaemonRecord, FileLock, Registry
from minisgl.server.params import sampling_params_from_openai


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINISGL_RUNTIME_DIR", str(tmp_path))
    return tmp_path


# ---------------------------------------------------------------------------- protocol


def test_every_message_survives_the_codec() -> None:
    usage = P.Usage(5, 3, 2)
    chunk = P.Chunk(
        "r",
        1,
        "hé",
        [1, 2],
        [{"token_id": 1, "token": "a", "logprob": -0.5, "top_logprobs": []}],
        "stop",
        "\n",
        [{"index": 0, "function": {"name": "f"}}],
        usage,
        True,
    )
    out = TokenOutput("r", 0, [7], [[-0.1, [[7, -0.1]]]], True, "stop", 2, 4, 1, 1, None)
    msgs = [
        P.Generate("r", prompt="hi", params=SamplingParams(max_tokens=3).to_dict(), tools=[{"type": "function"}]),
        P.Generate("r", messages=[{"role": "user", "content": "x"}], tool_choice="auto"),
        P.Abort("r"),
        P.Ping("r"),
        P.GetModelInfo("r"),
        P.GetStats("r"),
        P.Shutdown("r"),
        P.Chunks([chunk, chunk._replace(usage=None, done=False)]),
        P.Error("r", "GrammarError", "bad"),
        P.Pong("r", "ready", 1, "m", "ipc:///x", "0.1", {"tp": 1}),
        P.ModelInfoReply("r", {"a": 1}),
        P.StatsReply("r", {"free_pages": 3}),
        P.AddRequest("r", [1, 2], {"n": 1}, {"stop": []}),
        P.RequestMeta("r", {"n": 2}),
        P.TokenOutputs([out]),
        P.WorkerInit({"context_length": 8}, "/models/m"),
        P.SchedulerReady({"x": 1}, {"total_pages": 4}),
        P.WorkerReady("tokenizer"),
        P.WorkerFailed("scheduler", "ModelLoadError", "no"),
    ]
    for msg in msgs:
        back = P.decode(P.encode(msg))
        assert type(back) is type(msg) and back == msg
    assert isinstance(P.decode(P.encode(P.Chunks([chunk]))).items[0].usage, P.Usage)
    assert isinstance(P.decode(P.encode(P.TokenOutputs([out]))).items[0], TokenOutput)


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"\xc1\xc1garbage", "not msgpack"),
        (msgpack.packb({"type": "ping"}), "expected [version, type"),
        (msgpack.packb([P.PROTOCOL_VERSION + 1, "ping", "r"]), "protocol version"),
        (msgpack.packb([P.PROTOCOL_VERSION, "teleport", "r"]), "unknown message type 'teleport'"),
        (msgpack.packb([P.PROTOCOL_VERSION, "ping"]), "takes 1..1 fields"),
        (msgpack.packb([P.PROTOCOL_VERSION, "ping", "r", "extra"]), "takes 1..1 fields"),
    ],
)
def test_bad_bytes_raise_protocol_error(raw: bytes, words: str) -> None:
    with pytest.raises(P.ProtocolError, match=words.replace("[", r"\[")):
        P.decode(raw)


def test_error_replies_name_the_typed_exception() -> None:
    assert P.error_class("PromptTooLongError") is PromptTooLongError
    assert P.error_class("ProtocolError") is P.ProtocolError
    assert P.error_class("os.system") is P.error_class("NoSuchError") is P.errors.MiniSGLError
    assert P.error_reply("r", GrammarError("bad schema")) == P.Error("r", "GrammarError", "bad schema")
    assert P.error_reply("r", KeyError("k")).error_type == "MiniSGLError"


# ---------------------------------------------------------------------------- addresses, registry, flags


def test_addresses_are_checked() -> None:
    assert parse_address("ipc:///run/x.sock").is_loopback
    assert parse_address("tcp://127.0.0.1:5555").is_loopback
    assert parse_address("tcp://localhost:5555").is_loopback
    assert not parse_address("tcp://0.0.0.0:5555").is_loopback
    assert not parse_address("tcp://10.1.2.3:5555").is_loopback
    for bad in ("ipc://relative.sock", "tcp://127.0.0.1", "http://127.0.0.1:80", "ipc:///" + "x" * 200):
        with pytest.raises(ConfigError):
            parse_address(bad)


def test_daemon_name_follows_model_and_engine_options() -> None:
    a = EngineConfig.from_kwargs("smollm2")
    assert daemon_name(a) == daemon_name(EngineConfig.from_kwargs("smollm2"))
    assert daemon_name(a).startswith("smollm2-")
    assert daemon_name(a) != daemon_name(EngineConfig.from_kwargs("smollm2", page_size=16))
    assert daemon_name(EngineConfig.from_kwargs("/models/Qwen3 0.6B/")).startswith("Qwen3-0.6B-")


def test_registry_finds_live_daemons_and_drops_dead_ones(runtime_dir: Path) -> None:
    reg = Registry()
    cfg = EngineConfig.from_kwargs("m").to_dict()
    reg.add(DaemonRecord("ipc:///a", "m", os.getpid(), cfg, 1.0))
    reg.add(DaemonRecord("ipc:///b", "m", os.getpid(), {**cfg, "page_size": 4}, 2.0))
    reg.add(DaemonRecord("ipc:///dead", "m", 2**22 + 12345, cfg, 3.0))
    assert [r.address for r in reg.find("m")] == ["ipc:///b", "ipc:///a"]
    assert [r.address for r in reg.find("m", cfg)] == ["ipc:///a"]
    assert reg.find("other") == []
    assert reg.get("ipc:///dead") is None  # removed as stale by the scan
    reg.remove("ipc:///a", pid=os.getpid() + 1)  # not ours: kept
    assert reg.get("ipc:///a") is not None
    reg.remove("ipc:///a")
    assert reg.get("ipc:///a") is None
    assert (runtime_dir / "daemons").stat().st_mode & 0o777 == 0o700


def test_file_lock_is_exclusive(tmp_path: Path) -> None:
    a, b = FileLock(tmp_path / "l"), FileLock(tmp_path / "l")
    assert a.try_acquire()
    assert not b.try_acquire()
    with pytest.raises(DaemonTimeoutError):
        b.acquire(0.1)
    a.release()
    assert b.try_acquire()
    b.release()


def test_engine_flags_round_trip_through_the_cli() -> None:
    from minisgl.cli import build_parser, engine_config
    from minisgl.runtime.launcher import engine_flags

    config = EngineConfig.from_kwargs("smollm2", page_size=16, kv_cache_gb=0.5, disable_overlap=True, dtype="bfloat16")
    args = build_parser().parse_args(["serve", *engine_flags(config)])
    assert engine_config(args) == config
    assert engine_flags(EngineConfig.from_kwargs("smollm2")) == ["--model", "smollm2"]


# ---------------------------------------------------------------------------- daemon refusals (no model load)


def _serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minisgl", "serve", "--model", "smollm2", *args]
    if "--http-port" not in args:  # HTTP is on by default, on one port shared by every test
        cmd.append("--no-http")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_non_loopback_bind_needs_allow_remote(runtime_dir: Path) -> None:
    from minisgl.runtime.daemon import Daemon

    with pytest.raises(ConfigError, match="--allow-remote"):
        Daemon(EngineConfig.from_kwargs("smollm2"), "tcp://0.0.0.0:45123")
    result = _serve("--address", "tcp://0.0.0.0:45123")
    assert result.returncode == 1 and "--allow-remote" in result.stderr


def test_bad_command_lines_end_in_one_error_line_not_a_traceback(runtime_dir: Path, tmp_path: Path) -> None:
    from minisgl.cli import main

    public = _serve("--address", f"ipc://{tmp_path}/d.sock", "--http-port", "18097", "--host", "0.0.0.0")
    assert public.returncode == 1 and "--api-key" in public.stderr and "Traceback" not in public.stderr
    port = _serve("--http-port", "99999")  # argparse's own error, before anything starts
    assert port.returncode == 2 and "1-65535" in port.stderr
    for argv, words in (
        (["generate", "--model", "smollm2", "--device", "bogus", "x"], "unknown device 'bogus'"),
        (["keys", "--curve-dir", "/dev/null/x"], "Not a directory"),
    ):
        result = subprocess.run([sys.executable, "-m", "minisgl", *argv], capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and words in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert main(["generate", "--model", "smollm2", "--seed", str(2**70), "x"]) == 1  # a typed error, one line


def test_a_client_key_name_cannot_leave_the_keys_directory(tmp_path: Path) -> None:
    from minisgl.runtime.auth import create_client_keys

    for name in ("../evil", "a/b", ".hidden", ""):
        with pytest.raises(ConfigError, match="plain file name"):
            create_client_keys(tmp_path, name)
    assert sorted(p.name for p in tmp_path.rglob("*")) == []  # nothing written anywhere
    public, secret = create_client_keys(tmp_path, "laptop-1")
    assert public.parent == secret.parent == tmp_path / "clients"


def test_remote_access_needs_an_authorized_client_key(tmp_path: Path) -> None:
    from minisgl.runtime.daemon import Daemon

    with pytest.raises(ConfigError, match="minisgl keys --client"):
        Daemon(EngineConfig.from_kwargs("smollm2"), "tcp://0.0.0.0:45123", allow_remote=True, curve_keys=tmp_path)
    assert (tmp_path / "server.key_secret").stat().st_mode & 0o777 == 0o600


def test_a_failed_start_up_names_its_error_for_the_spawning_client(runtime_dir: Path) -> None:
    from minisgl.runtime.protocol import startup_failure

    result = _serve("--address", "ipc://relative.sock")
    assert result.returncode == 1
    error_type, message = startup_failure("some log line\n" + result.stderr) or ("", "")
    assert error_type == "ConfigError" and "absolute socket path" in message
    assert startup_failure("no marker here") is None


def test_no_daemon_and_no_auto_start_fails_fast(runtime_dir: Path) -> None:
    from minisgl.client import Client

    t0 = time.monotonic()
    with pytest.raises(DaemonNotRunningError, match="minisgl serve --model smollm2"):
        Client("smollm2", auto_start=False)
    with pytest.raises(DaemonNotRunningError, match="minisgl serve"):
        Client("smollm2", address=f"ipc://{runtime_dir}/nothing.sock", auto_start=False)
    assert time.monotonic() - t0 < 2.0


def test_connection_monitors_do_not_collide_with_names_held_elsewhere(runtime_dir: Path) -> None:
    # pyzmq names a monitor after its socket's file descriptor; libzmq frees that name asynchronously after a
    # close, so a new socket reusing the descriptor could fail with "Address already in use" (seen in CI).
    from minisgl.runtime.connection import AsyncConnection, SyncConnection

    ctx = zmq.Context.instance()
    squatter = ctx.socket(zmq.PAIR)
    for fd in range(3, 4096):  # hold every descriptor-derived name the new sockets could pick
        squatter.bind(f"inproc://monitor.s-{fd}")
    address = f"ipc://{runtime_dir}/nothing.sock"
    try:
        SyncConnection(ctx, address).close()

        async def main() -> None:
            conn = AsyncConnection(address)
            await conn.close()

        asyncio.run(main())
    finally:
        squatter.close(linger=0)


def test_unknown_engine_option_is_a_config_error(runtime_dir: Path) -> None:
    from minisgl.client import Client

    with pytest.raises(ConfigError, match="unknown engine options"):
        Client("smollm2", auto_start=False, page_sise=4)
    for bad, words in ((dict(kv_cache_gb=-1), "kv_cache_gb must be > 0"), (dict(mem_fraction=1.5), "mem_fraction")):
        with pytest.raises(ConfigError, match=words):  # a clear error, not an odd one from the pool sizing later
            EngineConfig.from_kwargs("smollm2", **bad)


# ---------------------------------------------------------------------------- tokenizer / detokenizer logic


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from minisgl.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def test_the_daemon_fills_an_unset_max_tokens_from_the_context(tokenizer: Any) -> None:
    from minisgl.runtime.tokenizer_worker import RequestPreparer

    prep = RequestPreparer(tokenizer, {"context_length": 64})
    add = prep.prepare(P.Generate("r", prompt="Hello there", params={"max_tokens": None}))
    assert add.params["max_tokens"] == 64 - len(add.input_ids)
    chat = prep.prepare(
        P.Generate(
            "r",
            messages=[{"role": "user", "content": "Hi"}],
            params=sampling_params_from_openai({"temperature": 0}).to_dict(),
        )
    )
    assert chat.params["max_tokens"] == 64 - len(chat.input_ids)
    given = prep.prepare(P.Generate("r", prompt="Hello there", params={"max_tokens": 5}))
    assert given.params["max_tokens"] == 5
    assert SamplingParams().max_tokens == 16  # LLM.generate's default is unchanged


def test_tokenizer_worker_validates_before_the_scheduler(tokenizer: Any) -> None:
    from minisgl.runtime.tokenizer_worker import RequestPreparer

    prep = RequestPreparer(tokenizer, {"context_length": 64})
    add = prep.prepare(P.Generate("r", prompt="Hello there", params={"max_tokens": 4, "stop": ["x"]}))
    assert add.input_ids == tokenizer.encode("Hello there")
    assert add.detok["stop"] == ["x"] and add.params["max_tokens"] == 4
    chat = prep.prepare(P.Generate("r", messages=[{"role": "user", "content": "Hi"}]))
    assert chat.input_ids == tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    cases: list[tuple[P.Generate, type[Exception]]] = [
        (P.Generate("r", prompt=""), InvalidRequestError),
        (P.Generate("r"), InvalidRequestError),
        (P.Generate("r", prompt="a", input_ids=[1]), InvalidRequestError),
        (P.Generate("r", prompt=123), InvalidRequestError),  # type: ignore[arg-type]
        (P.Generate("r", input_ids=[1, "2"]), InvalidRequestError),  # type: ignore[list-item]
        (P.Generate("r", prompt="a", params={"temperature": "hot"}), InvalidRequestError),
        (P.Generate("r", prompt="a", params={"max_tokens": 0}), InvalidRequestError),
        (P.Generate("r", prompt="a", params={"bogus": 1}), InvalidRequestError),
        (P.Generate("r", prompt="a", params=[1]), InvalidRequestError),  # type: ignore[arg-type]
        (P.Generate("r", input_ids=list(range(64))), PromptTooLongError),
        (P.Generate("r", prompt="a", response_format={"type": "yaml"}), InvalidRequestError),
        (P.Generate("r", prompt="a", tool_choice="required"), InvalidRequestError),
    ]
    for msg, error in cases:
        with pytest.raises(error):
            prep.prepare(msg)


def test_messages_the_chat_template_cannot_render_are_invalid_requests_not_internal_errors(tokenizer_dir: Path) -> None:
    """vLLM answers both with a 400: a content that is neither text nor parts (it was a TypeError inside the
    template), and a conversation the template itself refuses with raise_exception (Llama 2, Mistral, Gemma)."""
    from jinja2 import TemplateError

    from minisgl.runtime.tokenizer_worker import RequestPreparer
    from minisgl.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    prep = RequestPreparer(tok, {"context_length": 4096, "model_type": "llama"})
    for content in (5, {"text": "hi"}, True):
        with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content"):
            prep.prepare(P.Generate("r", messages=[{"role": "user", "content": content}]))
    with pytest.raises(InvalidRequestError, match="role"):
        prep.prepare(P.Generate("r", messages=[{"role": 3, "content": "hi"}]))
    tok.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError):  # what HF's rendering raises
        tok.apply_chat_template(two_users, tokenize=False)
    with pytest.raises(InvalidRequestError, match="must alternate"):
        prep.prepare(P.Generate("r", messages=two_users))


def test_developer_messages_are_system_messages_unless_the_template_knows_the_role(tokenizer_dir: Path) -> None:
    from minisgl.runtime.tokenizer_worker import RequestPreparer
    from minisgl.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    prep = RequestPreparer(tok, {"context_length": 4096, "model_type": "llama"})

    def ids(role: str) -> list[int]:
        messages = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
        return prep.prepare(P.Generate("r", messages=messages)).input_ids

    system = tok.encode(
        tok.apply_chat_template(
            [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    assert ids("developer") == ids("system") == system  # OpenAI: developer messages replace system messages
    tok.chat_template = THINKING_TEMPLATE.replace("m['role']", "m['role'] if m['role'] != 'developer' else 'dev'")
    assert tok.decode(ids("developer")).startswith("<|im_start|>dev\n")  # a template with the role renders it


# Qwen3's switch, as its template has it: with enable_thinking=False the answer starts after an empty think block.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_render_as_hf_renders_them(tokenizer_dir: Path) -> None:
    from minisgl.runtime.tokenizer_worker import RequestPreparer
    from minisgl.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    tok.chat_template = THINKING_TEMPLATE
    prep = RequestPreparer(tok, {"context_length": 4096, "model_type": "qwen3"})
    messages = [{"role": "user", "content": "Hi"}]

    def hf(**template_kwargs: Any) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
        return tok.encode(text, add_special_tokens=False)

    plain = prep.prepare(P.Generate("r", messages=messages)).input_ids
    off = prep.prepare(P.Generate("r", messages=messages, chat_template_kwargs={"enable_thinking": False})).input_ids
    on = prep.prepare(P.Generate("r", messages=messages, chat_template_kwargs={"enable_thinking": True})).input_ids
    assert plain == hf() == on and off == hf(enable_thinking=False) and off != plain
    # The tool-aware rendering gets them too.
    with_tools = prep.prepare(
        P.Generate("r", messages=messages, tools=[WEATHER_TOOL], chat_template_kwargs={"enable_thinking": False})
    ).input_ids
    assert tok.decode(with_tools).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    cases = [
        (P.Generate("r", messages=messages, chat_template_kwargs={"tokenize": True}), "tokenize"),
        (
            P.Generate("r", messages=messages, chat_template_kwargs={"add_generation_prompt": False}),
            "add_generation_prompt",
        ),
        (P.Generate("r", messages=messages, chat_template_kwargs=["enable_thinking"]), "object"),  # type: ignore[arg-type]
        (P.Generate("r", messages=messages, chat_template_kwargs={1: True}), "object"),  # type: ignore[dict-item]
        (P.Generate("r", prompt="Hi", chat_template_kwargs={"enable_thinking": False}), "chat request"),
    ]
    for msg, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            prep.prepare(msg)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tools_are_rendered_and_forced_calls_constrained(tokenizer: Any) -> None:
    from minisgl.runtime.tokenizer_worker import RequestPreparer

    prep = RequestPreparer(tokenizer, {"context_length": 4096, "model_type": "llama"})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    auto = prep.prepare(P.Generate("r", messages=messages, tools=[WEATHER_TOOL]))
    assert "get_weather" in tokenizer.decode(auto.input_ids)
    assert auto.params["ebnf"] is None and auto.detok["tool_parser"] == "hermes"
    forced = prep.prepare(P.Generate("r", messages=messages, tools=[WEATHER_TOOL], tool_choice="required"))
    assert "get_weather" in forced.params["ebnf"]
    none = prep.prepare(P.Generate("r", messages=messages, tools=[WEATHER_TOOL], tool_choice="none"))
    assert "get_weather" not in tokenizer.decode(none.input_ids) and none.detok["tool_parser"] is None
    with pytest.raises(GrammarError):
        prep.prepare(
            P.Generate("r", messages=messages, tools=[WEATHER_TOOL], tool_choice={"function": {"name": "nope"}})
        )
    with pytest.raises(InvalidRequestError):
        prep.prepare(P.Generate("r", prompt="plain", tools=[WEATHER_TOOL]))
    with pytest.raises(InvalidRequestError):
        prep.prepare(P.Generate("r", messages=messages, tools=[{"type": "function", "function": {"name": "bad name"}}]))


def test_detokenizer_parses_tool_calls_out_of_the_text(tokenizer: Any) -> None:
    from minisgl.client import merge_tool_calls
    from minisgl.runtime.detokenizer_worker import Detokenizer

    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    detok.add_request("r", {"n": 1, "tool_parser": "hermes"})
    chunks, _ = detok.process(_outputs("r", 0, ids, "stop", 2))
    assert "".join(c.text for c in chunks) == "Let me check."
    calls: list[dict[str, Any]] = []
    for c in chunks:
        merge_tool_calls(calls, c.tool_calls or [])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert chunks[-1].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_only_the_first_call(tokenizer: Any) -> None:
    """OpenAI's parallel_tool_calls=false: the request's detokenizer meta allows one call, and of a text with two
    calls only the first comes out (streamed deltas and assembled); the default keeps both."""
    from minisgl.client import merge_tool_calls
    from minisgl.runtime.detokenizer_worker import Detokenizer
    from minisgl.runtime.tokenizer_worker import RequestPreparer

    prep = RequestPreparer(tokenizer, {"context_length": 4096, "model_type": "llama"})
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    single = prep.prepare(P.Generate("r", messages=messages, tools=[WEATHER_TOOL], parallel_tool_calls=False)).detok
    default = prep.prepare(P.Generate("r", messages=messages, tools=[WEATHER_TOOL])).detok
    assert (single["max_tool_calls"], default["max_tool_calls"]) == (1, None)
    with pytest.raises(InvalidRequestError, match="parallel_tool_calls"):
        prep.prepare(P.Generate("r", messages=messages, tools=[WEATHER_TOOL], parallel_tool_calls="no"))
    call = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
    ids = tokenizer.encode(call.format("Paris") + "\n" + call.format("Rome"), add_special_tokens=False)
    for meta, cities in ((single, ["Paris"]), (default, ["Paris", "Rome"])):
        detok = Detokenizer(tokenizer)
        detok.add_request("r", meta)
        chunks, _ = detok.process(_outputs("r", 0, ids, "stop", 2))
        calls: list[dict[str, Any]] = []
        for c in chunks:
            merge_tool_calls(calls, c.tool_calls or [])
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities
        assert chunks[-1].finish_reason == "tool_calls"


def _reasoning_of(tokenizer: Any, meta: dict[str, Any], text: str) -> tuple[str, str, list[Any]]:
    """(reasoning, answer, chunks) the daemon's detokenizer makes of `text` generated token by token."""
    from minisgl.runtime.detokenizer_worker import Detokenizer

    detok = Detokenizer(tokenizer)
    detok.add_request("r", {"n": 1, **meta})
    chunks, _ = detok.process(_outputs("r", 0, tokenizer.encode(text, add_special_tokens=False), "stop", 2))
    return "".join(c.reasoning for c in chunks), "".join(c.text for c in chunks), chunks


def test_a_reasoning_parser_separates_the_think_part_from_the_answer_and_its_tool_calls(tokenizer_dir: Path) -> None:
    from minisgl.client import merge_tool_calls
    from minisgl.runtime.tokenizer_worker import RequestPreparer
    from minisgl.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    tok.chat_template = THINKING_TEMPLATE
    info = {"context_length": 4096, "model_type": "qwen3", "config": {"reasoning_parser": "qwen3"}}
    prep = RequestPreparer(tok, info)
    messages = [{"role": "user", "content": "Capital of France?"}]
    meta = prep.prepare(P.Generate("r", messages=messages)).detok
    assert meta["reasoning"] is False  # the model opens <think> itself
    reasoning, answer, _ = _reasoning_of(tok, meta, "<think>\nThe user asks for a capital.\n</think>\n\nParis.")
    assert (reasoning, answer) == ("The user asks for a capital.", "Paris.")
    # enable_thinking=False closes an empty block in the prompt: everything generated is the answer.
    off = prep.prepare(P.Generate("r", messages=messages, chat_template_kwargs={"enable_thinking": False})).detok
    assert off["reasoning"] is False
    assert _reasoning_of(tok, off, "Paris.")[:2] == ("", "Paris.")
    # A template that opens the block in the prompt (DeepSeek-R1): the output starts inside it.
    tok.chat_template = THINKING_TEMPLATE.replace("{% if enable_thinking", "<think>\n{% if enable_thinking")
    opened = prep.prepare(P.Generate("r", messages=messages)).detok
    assert opened["reasoning"] is True
    assert _reasoning_of(tok, opened, "Hmm, France.\n</think>\n\nParis.")[:2] == ("Hmm, France.", "Paris.")
    assert _reasoning_of(tok, opened, "Hmm, France, cut short by max_to")[:2] == (
        "Hmm, France, cut short by max_to",
        "",
    )
    # Tool calls are parsed out of the answer only.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reasoning, answer, chunks = _reasoning_of(
        tok, {**meta, "tool_parser": "hermes"}, f"<think>I need the weather tool.</think>\n{call}"
    )
    calls: list[dict[str, Any]] = []
    for c in chunks:
        merge_tool_calls(calls, c.tool_calls or [])
    assert reasoning == "I need the weather tool." and answer.strip() == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and chunks[-1].finish_reason == "tool_calls"
    # Without a reasoning parser, and for plain prompts, the text is left as it is.
    assert (
        RequestPreparer(tok, {**info, "config": {}}).prepare(P.Generate("r", messages=messages)).detok["reasoning"]
        is None
    )
    assert prep.prepare(P.Generate("r", prompt="<think>")).detok["reasoning"] is None
    assert _reasoning_of(tok, {}, "<think>x</think>y")[:2] == ("", "<think>x</think>y")


def test_response_format_becomes_a_json_schema() -> None:
    from minisgl.runtime.tokenizer_worker import apply_response_format

    p = SamplingParams()
    assert apply_response_format(p, None) is p
    assert apply_response_format(p, {"type": "text"}) is p
    assert apply_response_format(p, {"type": "json_object"}).json_schema == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert apply_response_format(p, rf).json_schema == schema
    with pytest.raises(InvalidRequestError):
        apply_response_format(SamplingParams(regex="a+"), rf)


def _outputs(rid: str, index: int, ids: list[int], reason: str, matched: Any = None) -> list[TokenOutput]:
    last = len(ids) - 1
    return [
        TokenOutput(
            rid, index, [t], None, i == last, reason if i == last else None, matched if i == last else None, 7, 3, i + 1
        )
        for i, t in enumerate(ids)
    ]


def test_detokenizer_streams_utf8_safe_deltas_and_usage_last(tokenizer: Any) -> None:
    from minisgl.runtime.detokenizer_worker import Detokenizer

    text = "Grüße, 世界! 🎉 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    detok.add_request("r", {"n": 1, "stop": [], "skip_special_tokens": True})
    chunks = []
    for out in _outputs("r", 0, ids, "length"):
        got, errors = detok.process([out])
        assert not errors
        chunks += got
    assert "".join(c.text for c in chunks) == text
    assert all("\ufffd" not in c.text for c in chunks)
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].usage == P.Usage(7, len(ids), 3) and chunks[-1].done
    assert "r" not in detok.states


def test_detokenizer_trims_stop_strings_and_waits_for_all_samples(tokenizer: Any) -> None:
    from minisgl.runtime.detokenizer_worker import Detokenizer

    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    detok.add_request("r", {"n": 2, "stop": [" three"], "skip_special_tokens": True})
    first, _ = detok.process(_outputs("r", 0, ids, "stop", " three"))
    assert "".join(c.text for c in first) == "one two"
    assert first[-1].finish_reason == "stop" and first[-1].matched_stop == " three"
    assert not first[-1].done and first[-1].usage is None
    second, _ = detok.process(_outputs("r", 1, ids[:2], "length"))
    assert second[-1].done and second[-1].usage == P.Usage(7, len(ids) + 2, 3)


def test_detokenizer_reports_a_failed_request_as_an_error(tokenizer: Any) -> None:
    from minisgl.runtime.detokenizer_worker import Detokenizer

    detok = Detokenizer(tokenizer)
    detok.add_request("r", {"n": 1})
    out = TokenOutput("r", 0, [], None, True, "abort", None, 3, 0, 0, "the engine shut down")
    chunks, errors = detok.process([out])
    assert chunks == [] and errors == [P.Error("r", "RequestAbortedError", "the engine shut down")]


def test_tool_call_deltas_merge_into_complete_calls() -> None:
    from minisgl.client import merge_tool_calls

    calls: list[dict[str, Any]] = []
    merge_tool_calls(calls, [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}])
    merge_tool_calls(calls, [{"index": 0, "function": {"arguments": '{"a": '}}])
    merge_tool_calls(
        calls,
        [
            {"index": 0, "function": {"arguments": "1}"}},
            {"index": 1, "id": "c2", "type": "function", "function": {"name": "g"}},
        ],
    )
    assert calls == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}},
    ]


# ---------------------------------------------------------------------------- Client / AsyncClient over a scripted
# ROUTER


class ScriptedRouter:
    """Answers like the daemon's frontend: ping -> ready; prompt "slow" -> one chunk, then silence;
    prompt "bad" -> a typed error; any other prompt -> its words as chunks, interleaved across requests."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.aborted: list[str] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        streams: dict[str, tuple[bytes, list[str]]] = {}
        while not self._stop.is_set():
            if self.sock.poll(10):
                ident, raw = self.sock.recv_multipart()
                msg = P.decode(raw)
                if isinstance(msg, P.Ping):
                    self._send(ident, P.Pong(msg.rid, "ready", os.getpid(), "fake", self.address, "0", {}))
                elif isinstance(msg, P.Abort):
                    self.aborted.append(msg.rid)
                elif isinstance(msg, P.Generate) and msg.prompt == "bad":
                    self._send(ident, P.Error(msg.rid, "PromptTooLongError", "too long"))
                elif isinstance(msg, P.Generate) and msg.prompt == "slow":
                    self._send(ident, P.Chunks([P.Chunk(msg.rid, 0, "s", [1])]))
                elif isinstance(msg, P.Generate):
                    streams[msg.rid] = (ident, (msg.prompt or "").split(" "))
            for rid, (ident, words) in list(streams.items()):  # one word per request per round: interleaved
                word = words.pop(0)
                last = not words
                usage = P.Usage(1, 2, 0) if last else None
                self._send(
                    ident,
                    P.Chunks(
                        [P.Chunk(rid, 0, word, [len(word)], None, "stop" if last else None, None, None, usage, last)]
                    ),
                )
                if last:
                    del streams[rid]

    def _send(self, ident: bytes, msg: Any) -> None:
        self.sock.send_multipart([ident, P.encode(msg)])

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def router(tmp_path: Path, runtime_dir: Path) -> Any:
    fake = ScriptedRouter(f"ipc://{tmp_path}/fake.sock")
    yield fake
    fake.close()


def _eventually(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_sync_client_generates_and_streams(router: ScriptedRouter) -> None:
    from minisgl.client import Client

    with Client("fake", router.address, auto_start=False, timeout=5) as c:
        out = c.generate("a b c")
        assert (out.text, out.token_ids, out.finish_reason, out.usage) == ("abc", [1, 1, 1], "stop", P.Usage(1, 2, 0))
        chunks = list(c.stream("x yy"))
        assert [ch.text for ch in chunks] == ["x", "yy"] and [ch.usage is None for ch in chunks] == [True, False]
        with pytest.raises(PromptTooLongError, match="too long"):
            c.generate("bad")


def test_text_without_a_utf8_form_is_an_invalid_request_and_the_client_goes_on(router: ScriptedRouter) -> None:
    """JSON can carry half of a surrogate pair ("\\ud83c", what a JavaScript client sends after slicing an emoji),
    which UTF-8 cannot encode; vLLM answers such a prompt with a 400. It was a UnicodeEncodeError (HTTP 500)."""
    from minisgl.client import AsyncClient, Client

    half = json.loads('"\\ud83c"')
    with pytest.raises(UnicodeEncodeError):
        half.encode("utf-8")
    with Client("fake", router.address, auto_start=False, timeout=5) as c:
        with pytest.raises(InvalidRequestError, match="surrogate"):
            c.generate("a " + half)
        with pytest.raises(InvalidRequestError, match="surrogate"):
            c.generate([{"role": "user", "content": "x"}], SamplingParams(stop=[half]))
        assert c.generate("a b").text == "ab"

    async def run() -> str:
        async with AsyncClient("fake", router.address, auto_start=False, timeout=5) as ac:
            with pytest.raises(InvalidRequestError, match="surrogate"):
                await ac.generate("a " + half)
            return (await ac.generate("c d")).text

    assert asyncio.run(run()) == "cd"


def test_a_second_request_with_an_id_in_flight_is_refused_and_the_first_goes_on(router: ScriptedRouter) -> None:
    """As the daemon refuses a rid in flight, so does a connection (every HTTP user shares the server's one, and
    SGLang's /generate takes the caller's rid): the second request took over the first one's replies, which then
    hung until its timeout (and the second's failure could abort the first)."""
    from minisgl.client import AsyncClient, Client

    with Client("fake", router.address, auto_start=False, timeout=5) as c:
        first = c.stream("a b c", rid="same")
        assert next(first).text == "a"
        with pytest.raises(InvalidRequestError, match="already in flight"):
            c.stream("d e", rid="same")
        assert "".join(ch.text for ch in first) == "bc"

    async def run() -> list[Any]:
        async with AsyncClient("fake", router.address, auto_start=False, timeout=5) as ac:
            return await asyncio.gather(
                ac.generate("a b c d", rid="dup"), ac.generate("e f", rid="dup"), return_exceptions=True
            )

    first_result, second = asyncio.run(run())
    assert isinstance(second, InvalidRequestError) and "already in flight" in str(second)
    assert first_result.text == "abcd" and first_result.finish_reason == "stop"
    assert router.aborted == []


def test_sync_client_is_safe_across_threads(router: ScriptedRouter) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from minisgl.client import Client

    with Client("fake", router.address, auto_start=False, timeout=5) as c:
        prompts = [" ".join(f"w{i}_{j}" for j in range(i % 4 + 1)) for i in range(16)]
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: c.generate(p).text, prompts))
        assert texts == [p.replace(" ", "") for p in prompts]


def test_timeout_raises_and_aborts_the_request(router: ScriptedRouter) -> None:
    from minisgl.client import Client

    with Client("fake", router.address, auto_start=False, timeout=0.3) as c:
        with pytest.raises(DaemonTimeoutError, match="aborted"):
            c.generate("slow", rid="t1")
        assert _eventually(lambda: router.aborted == ["t1"])


def test_leaving_a_stream_early_aborts_the_request(router: ScriptedRouter) -> None:
    from minisgl.client import Client

    with Client("fake", router.address, auto_start=False, timeout=5) as c:
        for chunk in c.stream("slow", rid="s1"):
            assert chunk.text == "s"
            break
        assert _eventually(lambda: router.aborted == ["s1"])
        for _ in c.stream("a b", rid="s2"):
            pass  # ran to the end: nothing to abort
        time.sleep(0.1)
        assert router.aborted == ["s1"]


def test_async_client_demultiplexes_concurrent_requests(router: ScriptedRouter) -> None:
    from minisgl.client import AsyncClient

    async def main() -> list[str]:
        async with AsyncClient("fake", router.address, auto_start=False, timeout=5) as ac:
            prompts = [" ".join(f"r{i}w{j}" for j in range(i % 5 + 1)) for i in range(20)]
            outs = await asyncio.gather(*(ac.generate(p) for p in prompts))
            assert [o.text for o in outs] == [p.replace(" ", "") for p in prompts]
            deltas = [chunk.text async for chunk in ac.stream("p q r")]
            assert deltas == ["p", "q", "r"]
            with pytest.raises(PromptTooLongError):
                await ac.generate("bad")
            return [o.rid for o in outs]

    assert len(set(asyncio.run(main()))) == 20


def test_cancelling_an_async_request_aborts_it(router: ScriptedRouter) -> None:
    from minisgl.client import AsyncClient

    async def main() -> None:
        async with AsyncClient("fake", router.address, auto_start=False, timeout=30) as ac:
            task = asyncio.ensure_future(ac.generate("slow", rid="c1"))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stream = ac.stream("slow", rid="c2")
            assert (await stream.__anext__()).text == "s"
            await stream.aclose()
            with pytest.raises(DaemonTimeoutError):
                await ac.generate("slow", rid="c3", timeout=0.2)

    asyncio.run(main())
    assert _eventually(lambda: sorted(router.aborted) == ["c1", "c2", "c3"])


def test_a_client_dropped_without_close_closes_its_sockets(router: ScriptedRouter) -> None:
    import gc

    from minisgl.client import Client

    c = Client("fake", router.address, auto_start=False, timeout=10)
    assert c.generate("hello world").text == "helloworld"  # the fake daemon streams the words
    conn = c._conns[0]
    del c
    gc.collect()
    assert conn.sock.closed and conn.monitor.closed


def test_a_daemon_that_goes_away_fails_waiting_requests_at_once(router: ScriptedRouter) -> None:
    from minisgl.client import Client

    with Client("fake", router.address, auto_start=False, timeout=30) as c:
        stream = c.stream("slow")
        next(stream)
        threading.Timer(0.2, router.close).start()
        t0 = time.monotonic()
        with pytest.raises(DaemonNotRunningError, match="lost"):
            next(stream)
        assert time.monotonic() - t0 < 5


def test_requests_to_a_daemon_that_went_away_fail_at_once_and_succeed_once_it_is_back(router: ScriptedRouter) -> None:
    """As an HTTP client meets "connection refused": every request while the daemon is gone, not only the first,
    fails at once with DaemonNotRunningError (not after the timeout); the first one after it is back succeeds."""
    from minisgl.client import AsyncClient, Client

    def fails_at_once(call: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        with pytest.raises(DaemonNotRunningError):
            call()
        assert time.monotonic() - t0 < 5

    async def async_round(ac: Any, gone: bool) -> None:
        if gone:
            for _ in range(2):
                t0 = time.monotonic()
                with pytest.raises(DaemonNotRunningError):
                    await ac.generate("a b")
                assert time.monotonic() - t0 < 5
        else:
            assert (await ac.generate("a b")).text == "ab"

    with Client("fake", router.address, auto_start=False, timeout=30) as c:
        loop = asyncio.new_event_loop()
        ac = AsyncClient("fake", router.address, auto_start=False, timeout=30)
        try:
            assert c.generate("a b").text == "ab"
            loop.run_until_complete(async_round(ac, gone=False))
            router.close()
            time.sleep(0.5)
            for _ in range(2):
                fails_at_once(lambda: c.generate("a b"))
            fails_at_once(c.stats)
            loop.run_until_complete(async_round(ac, gone=True))
            back = ScriptedRouter(router.address)
            try:
                time.sleep(0.5)
                assert c.generate("a b").text == "ab"
                loop.run_until_complete(async_round(ac, gone=False))
            finally:
                back.close()
        finally:
            loop.run_until_complete(ac.close())
            loop.close()


def test_closing_a_client_fails_its_open_streams_at_once_with_a_typed_error(router: ScriptedRouter) -> None:
    """Streams still read when their client is closed (another thread's, another task's) end with DaemonError at
    once, not after their timeout or with a raw ZMQError; their requests end in the daemon with the connection."""
    from minisgl.client import AsyncClient, Client
    from minisgl.errors import DaemonError

    async def main() -> None:
        ac = AsyncClient("fake", router.address, auto_start=False, timeout=30)
        streams = [ac.stream("slow") for _ in range(3)]
        for s in streams:
            assert (await s.__anext__()).text == "s"
        readers = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await ac.close()
        for r in readers:
            with pytest.raises(DaemonError, match="closed"):
                await asyncio.wait_for(r, 5)
        assert time.monotonic() - t0 < 5
        for s in streams:
            await s.aclose()  # nothing left to abort: no error

    loop = asyncio.new_event_loop()
    unhandled: list[Any] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert not unhandled

    c = Client("fake", router.address, auto_start=False, timeout=30)
    errors: list[BaseException] = []
    started = threading.Barrier(3)

    def read() -> None:
        stream = c.stream("slow")
        next(stream)
        started.wait()
        try:
            next(stream)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.1)
    c.close()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert [type(e) for e in errors] == [DaemonError, DaemonError], errors


def test_connections_of_threads_that_ended_are_closed(router: ScriptedRouter) -> None:
    """A shared Client used from short-lived threads (a threaded web server, a pool made per batch) keeps one
    connection per live thread: file descriptors stay flat however many threads came and went."""
    import gc

    from minisgl.client import Client

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with Client("fake", router.address, auto_start=False, timeout=10) as c:
        assert c.generate("a b").text == "ab"
        before = open_fds()
        for _ in range(3):
            texts: list[str] = []
            threads = [threading.Thread(target=lambda: texts.append(c.generate("x y").text)) for _ in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert texts == ["xy"] * 20
        gc.collect()
        assert _eventually(lambda: open_fds() <= before + 4), (before, open_fds())
        assert c.generate("a b").text == "ab"  # the main thread's connection is still there

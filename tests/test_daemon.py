"""The daemon end to end: real `minisgl serve` processes (SmolLM2, and a tiny model behind CURVE).

Two daemon start-ups in all; the SIGTERM test runs last because it stops the SmolLM2 daemon.
After every SmolLM2 test the daemon must be idle with free + cached pages == total.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import zmq

from daemon_fixtures import (  # noqa: F401 - fixtures are used by name
    SMOLLM2_ENGINE,
    DaemonHandle,
    daemon_runtime_dir,
    free_port,
    smollm2_daemon,
    start_serve,
    wait_http,
)
from minisgl.client import AsyncClient, Client
from minisgl.core import SamplingParams
from minisgl.engine.threads import default_threads
from minisgl.errors import (
    DaemonError,
    DaemonNotRunningError,
    DaemonTimeoutError,
    GrammarError,
    InvalidRequestError,
    PromptTooLongError,
    RequestAbortedError,
    UnknownModelError,
)
from minisgl.runtime import protocol as P
from minisgl.runtime.registry import Registry, pid_alive

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "My favourite colour is"]
LONG = SamplingParams(max_tokens=400, temperature=0.8, seed=0, ignore_eos=True)  # in flight until aborted


def _eventually(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _idle(client: Any) -> bool:
    s = client.stats()
    return s["running"] == 0 and s["waiting"] == 0 and s["inflight"] == 0 and s["req_pages"] == 0


@pytest.fixture
def client(smollm2_daemon: DaemonHandle) -> Iterator[Any]:
    c = smollm2_daemon.client
    yield c
    assert _eventually(lambda: _idle(c)), c.stats()
    s = c.stats()
    assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s


def _raw(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    return sock


def _reply(sock: zmq.Socket, timeout_ms: int = 10_000) -> Any:
    assert sock.poll(timeout_ms), "no reply"
    return P.decode(sock.recv())


# ---------------------------------------------------------------------------- start-up and discovery


def test_concurrent_auto_starts_share_one_daemon_and_log_each_stage(smollm2_daemon: DaemonHandle) -> None:
    a, b = smollm2_daemon.clients
    assert a.address == b.address == smollm2_daemon.address
    log = smollm2_daemon.log_path.read_text()
    assert log.count("listening at") == 1
    for stage in (
        "weights loaded",
        "KV pool: 4096 pages",
        "scheduler ready",
        "text worker ready",
        "ready: serving smollm2",
    ):
        assert stage in log, stage


def test_ipc_socket_is_private_to_the_user(smollm2_daemon: DaemonHandle) -> None:
    path = Path(smollm2_daemon.address.removeprefix("ipc://"))
    mode = path.stat().st_mode
    assert stat.S_ISSOCK(mode) and mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


def test_clients_find_the_daemon_of_their_model_and_options(smollm2_daemon: DaemonHandle) -> None:
    with Client("smollm2", auto_start=False) as c:
        assert c.address == smollm2_daemon.address
    with Client("smollm2", auto_start=False, **SMOLLM2_ENGINE) as c:
        assert c.address == smollm2_daemon.address
    with pytest.raises(DaemonNotRunningError):
        Client("smollm2", auto_start=False, page_size=8)  # no daemon runs with these options


def test_model_info_describes_the_served_model(client: Any) -> None:
    info = client.model_info()
    assert info["name"] == "smollm2" and info["architecture"] == "LlamaForCausalLM"
    assert info["context_length"] == 8192 and info["eos_token_ids"] == [2] and info["total_pages"] == 4096


def test_a_second_daemon_on_the_same_address_is_refused(smollm2_daemon: DaemonHandle) -> None:
    cmd = [sys.executable, "-m", "minisgl", "serve", "--model", "smollm2", "--address", smollm2_daemon.address]
    cmd.append("--no-http")  # HTTP is on by default, on one port shared by every test
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "already serves" in result.stderr and str(smollm2_daemon.pid) in result.stderr


def test_auto_starting_an_unknown_model_raises_its_typed_error(daemon_runtime_dir: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(UnknownModelError, match="no-such-model-xyz"):
        Client("no-such-model-xyz", timeout=120)
    assert time.monotonic() - t0 < 90
    assert not Registry().find("no-such-model-xyz")


# ---------------------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def offline_token_ids(smollm2_daemon: DaemonHandle) -> list[list[int]]:
    from minisgl.llm import LLM

    llm = LLM("smollm2", **SMOLLM2_ENGINE)
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del llm
    return outs


def test_concurrent_requests_from_asyncio_and_threads_equal_offline_generate(
    client: Any, offline_token_ids: list[list[int]]
) -> None:
    async def with_asyncio() -> list[Any]:
        async with AsyncClient("smollm2", client.address, auto_start=False) as ac:
            return await asyncio.gather(*(ac.generate(p, GREEDY) for p in PROMPTS))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the threads share one Client
        threaded = pool.map(lambda p: client.generate(p, GREEDY), PROMPTS)
        from_async = asyncio.run(with_asyncio())
        from_threads = list(threaded)
    for outs in (from_async, from_threads):
        assert [o.token_ids for o in outs] == offline_token_ids
        assert all(
            o.finish_reason in ("length", "stop") and o.usage.completion_tokens == len(o.token_ids) for o in outs
        )
    tokenizer = _tokenizer()
    assert [o.text for o in from_async] == [
        tokenizer.decode(ids, skip_special_tokens=True) for ids in offline_token_ids
    ]


def test_stream_deltas_concatenate_and_usage_comes_last(client: Any) -> None:
    prompt = "Once upon a time, in a small village,"
    full = client.generate(prompt, GREEDY)
    chunks = list(client.stream(prompt, GREEDY))
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert all(c.usage is None and not c.done for c in chunks[:-1])
    last = chunks[-1]
    assert last.done and last.finish_reason == "length"
    assert last.usage.prompt_tokens == full.usage.prompt_tokens and last.usage.completion_tokens == 6
    assert last.usage.cached_tokens == last.usage.prompt_tokens - 1  # the same prompt again: all but the last token


def test_chat_messages_use_the_chat_template(client: Any) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    out = client.generate(messages, GREEDY)
    tokenizer = _tokenizer()
    expected_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(expected_prompt, add_special_tokens=False))
    assert out.text


def test_n_samples_come_back_as_outputs(client: Any) -> None:
    out = client.generate("Roses are", SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=3))
    assert [o.index for o in out.outputs] == [0, 1]
    assert all(o.finish_reason in ("length", "stop") and o.token_ids for o in out.outputs)
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in out.outputs)


def test_stop_strings_are_trimmed_from_the_text(client: Any) -> None:
    prompt = "The capital of France is"
    base = client.generate(prompt, SamplingParams(max_tokens=10, temperature=0))
    k = len(base.text) // 2
    stop = base.text[k : k + 3]
    expected = base.text[: base.text.find(stop)]
    chunks = list(client.stream(prompt, SamplingParams(max_tokens=10, temperature=0, stop=[stop])))
    assert "".join(c.text for c in chunks) == expected
    assert (chunks[-1].finish_reason, chunks[-1].matched_stop) == ("stop", stop)


def test_a_stop_token_ends_the_answer_without_its_text(client: Any) -> None:
    prompt = "The capital of France is"
    free = client.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    stop_id = free.outputs[0].token_ids[3]
    out = client.generate(
        prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    )
    ids = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "stop" and ids[-1] == stop_id  # the id stays, its text does not
    assert out.text == _tokenizer().decode(ids[:-1], skip_special_tokens=True)


def test_min_tokens_holds_back_stop_strings_in_the_daemons_text_too(client: Any) -> None:
    prompt = "The capital of France is"
    free = client.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    first_word = free.text.split()[0]  # completed by the first token(s): cut at once without min_tokens
    held = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[first_word], min_tokens=6)
    out = client.generate(prompt, held)
    boundary = len(_tokenizer().decode(free.outputs[0].token_ids[:5], skip_special_tokens=True))
    cut = free.text.find(first_word, max(0, boundary - len(first_word) + 1))  # vLLM's rule on the free answer
    assert out.text == (free.text if cut < 0 else free.text[:cut]) and len(out.outputs[0].token_ids) >= 6
    streamed = "".join(c.text for c in client.stream(prompt, held))
    assert streamed == out.text


# ---------------------------------------------------------------------------- aborts free pages


def test_leaving_a_stream_early_aborts_and_frees_pages(client: Any) -> None:
    for i, _ in enumerate(client.stream("Write a long story about a dragon.", LONG)):
        if i == 2:
            break
    assert _eventually(lambda: _idle(client))


def test_abort_by_request_id_ends_the_stream_with_abort(smollm2_daemon: DaemonHandle, client: Any) -> None:
    stream = client.stream("Write a long story about a cat.", LONG, rid="abort-me")
    next(stream)
    client.abort("abort-me")  # a client aborts its own requests (another client's abort is refused)
    rest = list(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].done


def test_timeout_raises_and_aborts_the_request(client: Any) -> None:
    with pytest.raises(DaemonTimeoutError, match="aborted"):
        client.generate("Write a long story about a fox.", LONG, timeout=0.01)


def test_a_total_timeout_bounds_the_whole_request_and_aborts_it(client: Any) -> None:
    # chunks keep arriving well within the per-reply timeout; the request as a whole takes seconds
    for total in (0, -1.0, "1", True):
        with pytest.raises(InvalidRequestError, match="total_timeout"):
            client.generate("Hi", LONG, total_timeout=total)
    t0 = time.monotonic()
    with pytest.raises(DaemonTimeoutError, match="total_timeout of 0.3s"):
        client.generate("Write a long story about a fox.", LONG, timeout=30, total_timeout=0.3)
    assert time.monotonic() - t0 < 5.0

    async def with_asyncio() -> None:
        async with AsyncClient("smollm2", client.address, auto_start=False) as ac:
            with pytest.raises(DaemonTimeoutError, match="total_timeout"):
                await ac.generate("Write a long story about a fox.", LONG, total_timeout=0.3)
            short = await ac.generate("Hi", GREEDY, total_timeout=60)  # a request within its limit is unaffected
            assert short.outputs[0].finish_reason in ("length", "stop")

    asyncio.run(with_asyncio())  # the fixture then checks that both requests were aborted and freed their pages


def test_a_killed_client_process_has_its_request_aborted(smollm2_daemon: DaemonHandle, client: Any) -> None:
    script = (
        "from minisgl.client import Client\nfrom minisgl.core import SamplingParams\n"
        f"c = Client('smollm2', address={smollm2_daemon.address!r}, auto_start=False)\n"
        "for chunk in c.stream('Write a long story about the sea.', SamplingParams(max_tokens=400, ignore_eos=True)):\n"
        "    print('chunk', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "chunk\n"
    assert client.stats()["running"] == 1
    proc.kill()
    proc.wait()
    assert _eventually(lambda: _idle(client))


# ---------------------------------------------------------------------------- errors


def test_request_errors_are_typed_and_reach_only_their_client(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        client.generate("")
    with pytest.raises(PromptTooLongError):
        client.generate(list(range(1, 9000)))
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        client.generate([10**9])
    with pytest.raises(GrammarError):
        client.generate("x", SamplingParams(json_schema="{not json"))
    assert client.generate("Hi", SamplingParams(max_tokens=2)).usage.completion_tokens == 2


def test_bad_messages_get_an_error_and_the_daemon_keeps_serving(smollm2_daemon: DaemonHandle, client: Any) -> None:
    import msgpack

    sock = _raw(smollm2_daemon.address)
    bad = [
        (b"\xc1 not msgpack", "not msgpack"),
        (msgpack.packb([P.PROTOCOL_VERSION, "teleport", "r"]), "unknown message type"),
        (msgpack.packb([99, "ping", "r"]), "protocol version 99"),
        (msgpack.packb([P.PROTOCOL_VERSION, "ping", 5]), "non-empty string rid"),
        (P.encode(P.WorkerReady("tokenizer")), "cannot send"),
    ]
    for raw, words in bad:
        sock.send(raw)
        reply = _reply(sock)
        assert isinstance(reply, P.Error) and reply.error_type == "ProtocolError" and words in reply.message
    sock.send(P.encode(P.Generate("raw-1", prompt="Hi", params={"max_tokens": 2, "temperature": -1})))
    reply = _reply(sock)
    assert reply.error_type == "InvalidRequestError" and reply.rid == "raw-1"
    sock.close()
    assert client.generate("Hi", SamplingParams(max_tokens=2)).usage.completion_tokens == 2


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from minisgl.models.loader import resolve_model
    from minisgl.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2"))


# ---------------------------------------------------------------------------- CURVE over tcp (tiny model)


class CurveDaemon:
    def __init__(
        self,
        connect: str,
        keys: Path,
        client_secret: Path,
        stranger_secret: Path,
        proc: Any,
        model_dir: Path,
        log_path: Path,
    ) -> None:
        self.connect = connect
        self.server_public = keys / "server.key"
        self.client_secret = client_secret
        self.stranger_secret = stranger_secret
        self.proc = proc
        self.model_dir = model_dir
        self.log_path = log_path

    def client_keys(self) -> dict[str, str]:
        return {"curve_client_key": str(self.client_secret), "curve_server_key": str(self.server_public)}


@pytest.fixture(scope="module")
def curve_daemon(
    daemon_runtime_dir: Path, tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CurveDaemon]:
    import zmq.auth

    from minisgl.runtime.auth import ClientCurve, create_client_keys, ensure_server_keys
    from minisgl.runtime.launcher import stop_daemon, wait_ready

    keys = tmp_path_factory.mktemp("curve")
    ensure_server_keys(keys)
    _, alice = create_client_keys(keys, "alice")
    _, mallory = zmq.auth.create_certificates(str(tmp_path_factory.mktemp("stranger")), "mallory")
    port = free_port()
    log = daemon_runtime_dir / "curve.log"
    proc = start_serve(
        [
            "--model",
            str(tiny_model_dir("llama")),
            "--address",
            f"tcp://0.0.0.0:{port}",
            "--allow-remote",
            "--curve-dir",
            str(keys),
            "--max-message-bytes",
            "65536",
            "--num-pages",
            "2048",
        ],
        log,
    )
    connect = f"tcp://127.0.0.1:{port}"
    curve = ClientCurve(alice, keys / "server.key")
    wait_ready(connect, 180, curve, proc=proc, log_path=log)
    yield CurveDaemon(connect, keys, alice, Path(mallory), proc, tiny_model_dir("llama"), log)
    if proc.poll() is None:
        stop_daemon(connect, 30, curve)
    proc.wait(30)


def test_curve_client_with_authorized_keys_is_served(curve_daemon: CurveDaemon) -> None:
    with Client("tiny", curve_daemon.connect, auto_start=False, **curve_daemon.client_keys()) as c:
        out = c.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 4


@pytest.mark.parametrize("who", ["no keys", "unauthorized keys"])
def test_curve_daemon_refuses_clients_without_authorized_keys(curve_daemon: CurveDaemon, who: str) -> None:
    keys = (
        {}
        if who == "no keys"
        else {
            "curve_client_key": str(curve_daemon.stranger_secret),
            "curve_server_key": str(curve_daemon.server_public),
        }
    )
    t0 = time.monotonic()
    with pytest.raises(DaemonError):
        Client("tiny", curve_daemon.connect, auto_start=False, timeout=5, **keys)
    assert time.monotonic() - t0 < 10


def _ps(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "ps", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_ps_without_daemons_says_so(tmp_path: Path) -> None:
    assert _ps(env={"MINISGL_RUNTIME_DIR": str(tmp_path)}).strip() == "no minisgl daemon is running"
    assert _ps("--json", env={"MINISGL_RUNTIME_DIR": str(tmp_path)}) == ""


def test_ps_lists_each_daemon_with_its_state_and_load(
    smollm2_daemon: DaemonHandle, client: Any, curve_daemon: CurveDaemon
) -> None:
    stream = client.stream("Once upon a time", LONG)  # one request in flight while ps looks
    local = curve_daemon.server_public.parent / "clients" / "local.key_secret"
    with stream:
        next(iter(stream))
        local.rename(local.with_suffix(".away"))  # a user without the daemon's local keys
        try:
            statuses = {s["pid"]: s for s in map(json.loads, _ps("--json").splitlines())}
        finally:
            local.with_suffix(".away").rename(local)
        table = _ps()
    mine = statuses[smollm2_daemon.pid]
    assert mine["address"] == smollm2_daemon.address and mine["model"] == "smollm2" and mine["state"] == "ready"
    assert mine["total_pages"] == SMOLLM2_ENGINE["num_pages"] and mine["running"] == 1 and mine["req_pages"] > 0
    assert mine["uptime_s"] >= 0
    threads = int(os.environ.get("OMP_NUM_THREADS") or default_threads())  # what its scheduler process computes with
    assert mine["quantization"] == "none" and mine["threads"] == threads
    # The CURVE daemon does not answer a client without keys: ps says so instead of hanging or failing.
    curve = statuses[curve_daemon.proc.pid]
    assert curve["state"].startswith("refused") and "total_pages" not in curve
    keyed = {
        "MINISGL_CURVE_CLIENT_KEY": str(curve_daemon.client_secret),
        "MINISGL_CURVE_SERVER_KEY": str(curve_daemon.server_public),
    }
    curve = {s["pid"]: s for s in map(json.loads, _ps("--json", env=keyed).splitlines())}[curve_daemon.proc.pid]
    assert curve["state"] == "ready" and curve["total_pages"] == 2048 and curve["running"] == 0
    lines = table.splitlines()
    assert lines[0].split()[:8] == ["MODEL", "ADDRESS", "PID", "STATE", "UP", "QUANTIZATION", "THREADS", "RUNNING"]
    row = next(line.split() for line in lines if str(smollm2_daemon.pid) in line.split())
    assert row[0] == "smollm2" and row[3] == "ready" and row[5:8] == ["none", str(threads), "1"]


def test_oversize_message_drops_only_that_connection(curve_daemon: CurveDaemon) -> None:
    keys = curve_daemon.client_keys()
    with (
        Client("tiny", curve_daemon.connect, auto_start=False, timeout=30, **keys) as big,
        Client("tiny", curve_daemon.connect, auto_start=False, timeout=30, **keys) as other,
    ):
        with pytest.raises(DaemonError):
            big.generate(list(range(1, 30_000)), SamplingParams(max_tokens=2))
        assert len(other.generate([1, 2], SamplingParams(max_tokens=2, ignore_eos=True)).token_ids) == 2


def test_a_forced_tool_call_comes_back_as_tool_calls(curve_daemon: CurveDaemon) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]},
        },
    }
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with Client("tiny", curve_daemon.connect, auto_start=False, **curve_daemon.client_keys()) as c:
        params = SamplingParams(max_tokens=60, temperature=0)
        out = c.generate(messages, params, tools=[tool], tool_choice=choice)
    assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")


def test_64_concurrent_streaming_clients_finish_and_equal_offline(curve_daemon: CurveDaemon) -> None:
    from minisgl.llm import LLM

    prompts = [[(7 * i + j) % 1000 + 5 for j in range(3 + i % 5)] for i in range(64)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(str(curve_daemon.model_dir), num_pages=2048)
    expected = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    keys = curve_daemon.client_keys()

    def collect(chunks: Any) -> list[int]:
        return [t for c in chunks for t in c.token_ids]

    async def streams(batch: list[list[int]]) -> list[list[int]]:
        async with AsyncClient("tiny", curve_daemon.connect, auto_start=False, **keys) as ac:

            async def one(p: list[int]) -> list[int]:
                return collect([c async for c in ac.stream(p, params)])

            return list(await asyncio.gather(*(one(p) for p in batch)))

    with Client("tiny", curve_daemon.connect, auto_start=False, **keys) as shared, ThreadPoolExecutor(32) as pool:
        threaded = pool.map(lambda p: collect(shared.stream(p, params)), prompts[32:])
        from_async = asyncio.run(streams(prompts[:32]))
        assert from_async + list(threaded) == expected
        stats = shared.stats()
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"] and stats["req_pages"] == 0


def test_a_killed_scheduler_fails_waiting_requests_and_stops_the_daemon(curve_daemon: CurveDaemon) -> None:
    with Client("tiny", curve_daemon.connect, auto_start=False, timeout=30, **curve_daemon.client_keys()) as c:
        scheduler = c.stats()["workers"]["scheduler"]
        stream = c.stream([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        next(stream)
        os.kill(scheduler, signal.SIGKILL)
        with pytest.raises(DaemonError, match="scheduler process"):
            for _ in stream:
                pass
    assert curve_daemon.proc.wait(30) == 1
    assert f"scheduler process (pid {scheduler}) exited unexpectedly" in curve_daemon.log_path.read_text()


# ---------------------------------------------------------------------------- a forward that fails (tiny model, a test
# plugin)


def _with_test_plugin(
    tmp: Path, model_dir: Path, architecture: str, monkeypatch: pytest.MonkeyPatch | None = None, **env: str
) -> tuple[Path, dict[str, str]]:
    """A copy of model_dir served by `architecture` of tests/failing_model_plugin.py, and the env that installs
    it (plus `env`); with monkeypatch, that env is also set for the daemons this test starts."""
    site = tmp / "site"
    dist = site / "minisgl_failing_plugin-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: minisgl-failing-plugin\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[minisgl]\nfailing = failing_model_plugin\n")
    shutil.copy(Path(__file__).with_name("failing_model_plugin.py"), site)
    model = tmp / architecture
    shutil.copytree(model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (model / "config.json").write_text(json.dumps(cfg))
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep), **env}
    for key, value in env.items() if monkeypatch is not None else ():
        monkeypatch.setenv(key, value)
    return model, env


def test_a_failing_forward_fails_its_requests_with_a_typed_error_and_the_daemon_keeps_serving(
    daemon_runtime_dir: Path, tiny_model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from failing_model_plugin import POISON
    from minisgl.errors import EngineError
    from minisgl.runtime.launcher import stop_daemon, wait_ready

    model, _ = _with_test_plugin(tmp_path, tiny_model_dir("llama"), "PoisonedLlamaForCausalLM", monkeypatch)
    address = f"ipc://{daemon_runtime_dir}/poisoned.sock"
    log = daemon_runtime_dir / "poisoned.log"
    proc = start_serve(["--model", str(model), "--address", address, "--num-pages", "512", "--page-size", "4"], log)
    try:
        wait_ready(address, 180, proc=proc, log_path=log)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        with Client(str(model), address, auto_start=False, timeout=60) as c:
            stream = c.stream(list(range(20, 50)), params)  # decoding before the poisoned request arrives
            first = next(stream)
            with pytest.raises(EngineError, match="poisoned batch: mkldnn_reorder_linear_weight"):
                c.generate([11, *POISON, 12], SamplingParams(max_tokens=4, n=2))
            # The poisoned prefill ran in its own batch: the decoding request goes on untouched.
            rest = list(stream)
            assert len(first.token_ids) + sum(len(ch.token_ids) for ch in rest) == 24
            assert rest[-1].finish_reason == "length"
            assert c.generate([30, 31, 32], SamplingParams(max_tokens=5, ignore_eos=True)).usage.completion_tokens == 5
            assert _eventually(lambda: _idle(c)), c.stats()
            stats = c.stats()
            assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"], stats
        assert proc.poll() is None
        assert "a step failed; failing its 1 sequence(s)" in log.read_text()
    finally:
        if proc.poll() is None:
            stop_daemon(address, 30)
        proc.wait(30)


def test_serve_with_a_forward_that_cannot_run_fails_at_start_with_a_clear_error(
    daemon_runtime_dir: Path, tiny_model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up runs one tiny forward before "ready": a dtype/kernel this machine lacks fails `serve` itself."""
    from minisgl.errors import EngineError
    from minisgl.runtime.launcher import wait_ready

    model, _ = _with_test_plugin(tmp_path, tiny_model_dir("llama"), "NoKernelLlamaForCausalLM", monkeypatch)
    address = f"ipc://{daemon_runtime_dir}/nokernel.sock"
    log = daemon_runtime_dir / "nokernel.log"
    proc = start_serve(["--model", str(model), "--address", address, "--dtype", "bfloat16"], log)
    with pytest.raises(EngineError, match=r"bfloat16 on cpu cannot run on this machine.*avx_ne_convert.*--dtype"):
        wait_ready(address, 180, proc=proc, log_path=log)
    assert proc.wait(30) == 1
    text = log.read_text()
    assert "ready: serving" not in text
    assert "scheduler failed: EngineError" in text
    assert Registry().get(address) is None


def test_generate_with_a_forward_that_cannot_run_prints_a_clear_error(tiny_model_dir: Any, tmp_path: Path) -> None:
    """`minisgl generate --dtype bfloat16` on a machine without the kernel: one error line, exit 1, no traceback."""
    model, env = _with_test_plugin(tmp_path, tiny_model_dir("llama"), "NoKernelLlamaForCausalLM")
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "generate", "hello", "--model", str(model), "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(r"minisgl: error: .*bfloat16 on cpu cannot run on this machine.*--dtype", proc.stderr), proc.stderr


@pytest.mark.parametrize("gemm", ["this CPU's path", "F.linear forced"])
def test_serve_and_generate_in_bfloat16_on_any_cpu(daemon_runtime_dir: Path, tiny_model_dir: Any, gemm: str) -> None:
    """bf16 serves requests whether the CPU packs bf16 for oneDNN (AVX-512) or not (AVX2: F.linear, forced here)."""
    from minisgl.runtime.launcher import stop_daemon, wait_ready

    env = {**os.environ, "MINISGL_ONEDNN": "0"} if gemm == "F.linear forced" else dict(os.environ)
    model = str(tiny_model_dir("llama"))
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisgl",
            "generate",
            "hello",
            "--model",
            model,
            "--dtype",
            "bfloat16",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert gen.returncode == 0 and "Traceback" not in gen.stderr, gen.stderr
    address = f"ipc://{daemon_runtime_dir}/bf16.sock"
    log = daemon_runtime_dir / "bf16.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minisgl",
            "serve",
            "--model",
            model,
            "--address",
            address,
            "--dtype",
            "bfloat16",
            "--no-http",
        ],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        wait_ready(address, 180, proc=proc, log_path=log)
        with Client(model, address, auto_start=False, timeout=60) as c:
            assert c.model_info()["dtype"] == "bfloat16"
            out = c.generate(list(range(10, 40)), SamplingParams(max_tokens=8, ignore_eos=True, n=2))
            assert [len(o.token_ids) for o in out.outputs] == [8, 8]
    finally:
        if proc.poll() is None:
            stop_daemon(address, 30)
        proc.wait(30)


# ---------------------------------------------------------------------------- idle timeout, HTTP on a running daemon


def test_an_idle_daemon_stops_after_its_idle_timeout(daemon_runtime_dir: Path, tiny_model_dir: Any) -> None:
    from minisgl.runtime.launcher import wait_ready

    address = f"ipc://{daemon_runtime_dir}/idle.sock"
    log = daemon_runtime_dir / "idle.log"
    proc = start_serve(["--model", str(tiny_model_dir("llama")), "--address", address, "--idle-timeout", "3"], log)
    try:
        wait_ready(address, 180, proc=proc, log_path=log)
        with Client("tiny", address, auto_start=False, timeout=60) as c:
            for _ in range(3):  # requests keep it alive past the timeout
                assert c.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)).usage.completion_tokens == 2
                time.sleep(1.5)
            assert proc.poll() is None
        assert proc.wait(60) == 0  # then, idle, it stops by itself
        assert "stopping: idle for 3s" in log.read_text()
        assert Registry().get(address) is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
)


def _scripted_thinker(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, template: str, pieces: list[str]
) -> tuple[Path, Any]:
    """(model dir, tokenizer) of a tiny Llama that writes `pieces` (one token each, then EOS;
    tests/failing_model_plugin.py's script), with <think> and </think> added to its tokenizer as Qwen3 has them (added,
    not special: decoded as text)."""
    from transformers import AutoTokenizer

    from conftest import _build_tiny

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    script = [tok.encode(piece, add_special_tokens=False) for piece in pieces]
    assert all(len(ids) == 1 for ids in script), script
    model, _ = _with_test_plugin(
        tmp_path,
        _build_tiny("llama", tmp_path / "tok", tmp_path / "thinker"),
        "ScriptedLlamaForCausalLM",
        monkeypatch,
        MINISGL_TEST_SCRIPT=",".join(str(ids[0]) for ids in script),
    )
    return model, tok


def test_a_reasoning_parser_serves_the_think_part_apart_end_to_end(
    daemon_runtime_dir: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve --reasoning-parser qwen3` with a model that writes "<think>France capital?</think>Paris!" (a script:
    see tests/failing_model_plugin.py): the Client and the OpenAI API get the reasoning and the answer apart."""
    import openai

    from minisgl.runtime.launcher import stop_daemon, wait_ready

    model, tok = _scripted_thinker(
        tmp_path,
        tokenizer_dir,
        monkeypatch,
        THINKING_TEMPLATE,
        ["<think>", "France", " capital", "?", "</think>", "Paris", "!"],
    )
    address, port = f"ipc://{daemon_runtime_dir}/thinker.sock", free_port()
    log = daemon_runtime_dir / "thinker.log"
    proc = start_serve(
        ["--model", str(model), "--address", address, "--reasoning-parser", "qwen3", "--http-port", str(port)], log
    )
    messages = [{"role": "user", "content": "Capital of France?"}]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    try:
        wait_ready(address, 180, proc=proc, log_path=log)
        with Client(str(model), address, auto_start=False, timeout=60) as c:
            out = c.generate(messages, greedy)
            assert (out.outputs[0].reasoning_content, out.text, out.finish_reason) == (
                "France capital?",
                "Paris!",
                "stop",
            )
            chunks = list(c.stream(messages, greedy))
            assert "".join(ch.reasoning for ch in chunks) == "France capital?"
            assert "".join(ch.text for ch in chunks) == "Paris!"
            # chat_template_kwargs reach the daemon's template: the prompt is HF's rendering with them.
            off = c.generate(messages, greedy, chat_template_kwargs={"enable_thinking": False})
            rendered = tok.apply_chat_template(messages, tokenize=False, enable_thinking=False)
            assert rendered.endswith("</think>\n\n")
            assert (
                off.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False)) > out.usage.prompt_tokens
            )
            plain = c.generate("Tell me", greedy)  # not a chat: no reasoning parsing
            assert plain.outputs[0].reasoning_content is None and plain.text.startswith("<think>")
        wait_http(port, proc, log)  # the HTTP server starts after the daemon is ready
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        message = oai.chat.completions.create(model=str(model), messages=messages, temperature=0).choices[0].message
        assert (message.reasoning_content, message.content) == ("France capital?", "Paris!")
        deltas = [
            ch.choices[0].delta
            for ch in oai.chat.completions.create(model=str(model), messages=messages, temperature=0, stream=True)
            if ch.choices
        ]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "France capital?"
        assert "".join(d.content or "" for d in deltas) == "Paris!"
    finally:
        if proc.poll() is None:
            stop_daemon(address, 30)
        proc.wait(30)


def test_structured_answers_of_a_model_that_starts_inside_think_come_after_its_reasoning(
    daemon_runtime_dir: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template that opens <think> in the prompt (DeepSeek-R1, QwQ, Qwen3-Thinking-2507) and a model that writes
    "France capital?</think>Paris!": a grammar (response_format, guided_choice, a forced tool call) constrains the
    answer after </think>, as vLLM and SGLang apply it, so the reasoning stays reasoning and the answer is the
    structured content. (Constrained from the first token, the answer was written inside the open block and came
    back as reasoning_content, with an empty content and no tool call.)"""
    import jsonschema
    import openai

    from minisgl.runtime.launcher import stop_daemon, wait_ready

    model, _ = _scripted_thinker(
        tmp_path,
        tokenizer_dir,
        monkeypatch,
        THINKING_TEMPLATE.replace("{% if enable_thinking", "<think>\n{% if enable_thinking"),
        ["France", " capital", "?", "</think>", "Paris", "!"],
    )
    address, port = f"ipc://{daemon_runtime_dir}/r1.sock", free_port()
    log = daemon_runtime_dir / "r1.log"
    proc = start_serve(
        ["--model", str(model), "--address", address, "--reasoning-parser", "deepseek-r1", "--http-port", str(port)],
        log,
    )
    messages = [{"role": "user", "content": "Capital of France?"}]
    answer = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "capital", "parameters": answer}}]
    try:
        wait_ready(address, 180, proc=proc, log_path=log)
        wait_http(port, proc, log)  # the HTTP server starts after the daemon is ready
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        ask = dict(model=str(model), messages=messages, temperature=0, max_tokens=200)
        plain = oai.chat.completions.create(**ask).choices[0].message
        assert (plain.reasoning_content, plain.content) == ("France capital?", "Paris!")

        choice = oai.chat.completions.create(**ask, extra_body={"guided_choice": ["yes", "no"]}).choices[0]
        assert choice.message.reasoning_content == "France capital?"
        assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop"

        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
        whole = oai.chat.completions.create(**ask, response_format=fmt).choices[0]
        assert whole.message.reasoning_content == "France capital?" and whole.finish_reason == "stop"
        jsonschema.validate(json.loads(whole.message.content), answer)
        deltas = [
            ch.choices[0].delta
            for ch in oai.chat.completions.create(**ask, response_format=fmt, stream=True)
            if ch.choices
        ]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "France capital?"
        assert "".join(d.content or "" for d in deltas) == whole.message.content

        called = oai.chat.completions.create(**ask, tools=tools, tool_choice="required").choices[0]
        assert called.message.reasoning_content == "France capital?" and called.finish_reason == "tool_calls"
        assert [c.function.name for c in called.message.tool_calls] == ["capital"]
        jsonschema.validate(json.loads(called.message.tool_calls[0].function.arguments), answer)
    finally:
        if proc.poll() is None:
            stop_daemon(address, 30)
        proc.wait(30)


def test_serve_with_http_port_attaches_to_the_running_daemon(daemon_runtime_dir: Path, tiny_model_dir: Any) -> None:
    """`serve --http-port` for a model whose daemon already runs serves HTTP for that daemon instead of failing."""
    import httpx

    from minisgl.runtime.launcher import stop_daemon, wait_ready

    model = str(tiny_model_dir("llama"))
    address = f"ipc://{daemon_runtime_dir}/attach.sock"
    log = daemon_runtime_dir / "attach.log"
    proc = start_serve(["--model", model, "--address", address], log)
    http = None
    try:
        wait_ready(address, 180, proc=proc, log_path=log)
        port = free_port()
        http = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "minisgl",
                "serve",
                "--model",
                model,
                "--address",
                address,
                "--http-port",
                str(port),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        body = None
        for _ in range(300):
            try:
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    timeout=30,
                    json={"model": model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True},
                )
                body = r.json()
                break
            except httpx.TransportError:
                assert http.poll() is None, http.stderr.read() if http.stderr else ""
                time.sleep(0.1)
        assert body is not None and body["usage"]["completion_tokens"] == 3, body
        http.terminate()
        http.wait(30)
        assert f"a daemon already serves {model} at {address}" in (http.stderr.read() if http.stderr else "")
        assert proc.poll() is None  # the daemon keeps running without its HTTP front
        assert Registry().get(address) is not None
    finally:
        if http is not None and http.poll() is None:
            http.kill()
        if proc.poll() is None:
            stop_daemon(address, 30)
        proc.wait(30)


# ---------------------------------------------------------------------------- shutdown (last: stops the daemon)


def _children(pid: int) -> list[int]:
    out = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat_file.parent.name))
    return out


def test_sigterm_fails_inflight_requests_and_cleans_up(smollm2_daemon: DaemonHandle) -> None:
    client = smollm2_daemon.client
    children = _children(smollm2_daemon.pid)
    assert len(children) >= 3  # scheduler, tokenizer, detokenizer (and multiprocessing's resource tracker)
    stream = client.stream("Write a long story about a mountain.", LONG)
    next(stream)
    os.kill(smollm2_daemon.pid, signal.SIGTERM)
    with pytest.raises(RequestAbortedError, match="shutting down"):
        for _ in stream:
            pass
    assert _eventually(lambda: not pid_alive(smollm2_daemon.pid))
    assert _eventually(lambda: all(not pid_alive(c) for c in children), timeout=10)
    socket_path = Path(smollm2_daemon.address.removeprefix("ipc://"))
    assert not socket_path.exists() and not socket_path.with_name(socket_path.name + ".lock").exists()
    assert Registry().get(smollm2_daemon.address) is None
    log = smollm2_daemon.log_path.read_text()
    assert "stopping: received SIGTERM" in log and log.rstrip().endswith("stopped")
    with pytest.raises(DaemonNotRunningError):
        Client("smollm2", auto_start=False)

"""The daemon end to end: real `minisgl serve` processes (SmolLM2, and a tiny model behind CURVE).

Two daemon start-ups in all; the SIGTERM test runs last because it stops the SmolLM2 daemon.
After every SmolLM2 test the daemon must be idle with free + cached pages == total.
"""

from __future__ import annotations

import asyncio
import functools
import os
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
)
from minisgl.client import AsyncClient, Client
from minisgl.core import SamplingParams
from minisgl.errors import (
    DaemonError,
    DaemonNotRunningError,
    DaemonTimeoutError,
    GrammarError,
    InvalidRequestError,
    PromptTooLongError,
    RequestAbortedError,
)
from minisgl.runtime import protocol as P
from minisgl.runtime.registry import Registry, pid_alive

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "My favourite colour is"]
LONG = SamplingParams(max_tokens=400, temperature=0.8, seed=0)


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
    for stage in ("weights loaded", "KV pool: 4096 pages", "scheduler ready", "tokenizer worker ready",
                  "detokenizer worker ready", "ready: serving smollm2"):
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
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "already serves" in result.stderr and str(smollm2_daemon.pid) in result.stderr


# ---------------------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def offline_token_ids(smollm2_daemon: DaemonHandle) -> list[list[int]]:
    from minisgl.llm import LLM

    llm = LLM("smollm2", **SMOLLM2_ENGINE)
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del llm
    return outs


def test_concurrent_async_requests_equal_offline_generate(client: Any, offline_token_ids: list[list[int]]) -> None:
    async def main() -> list[Any]:
        async with AsyncClient("smollm2", client.address, auto_start=False) as ac:
            return await asyncio.gather(*(ac.generate(p, GREEDY) for p in PROMPTS))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == offline_token_ids
    tokenizer = _tokenizer()
    assert [o.text for o in outs] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in offline_token_ids]


def test_threads_sharing_one_client_equal_offline_generate(client: Any, offline_token_ids: list[list[int]]) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: client.generate(p, GREEDY), PROMPTS))
    assert [o.token_ids for o in outs] == offline_token_ids
    assert all(o.finish_reason in ("length", "stop") and o.usage.completion_tokens == len(o.token_ids) for o in outs)


def test_stream_deltas_concatenate_and_usage_comes_last(client: Any) -> None:
    prompt = "Once upon a time, in a small village,"
    full = client.generate(prompt, GREEDY)
    chunks = list(client.stream(prompt, GREEDY))
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert all(c.usage is None and not c.done for c in chunks[:-1])
    last = chunks[-1]
    assert last.done and last.finish_reason == "length"
    assert last.usage.prompt_tokens == full.usage.prompt_tokens and last.usage.completion_tokens == 8
    assert last.usage.cached_tokens == last.usage.prompt_tokens - 1  # the same prompt again: all but the last token


def test_chat_messages_use_the_chat_template(client: Any) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    out = client.generate(messages, GREEDY)
    tokenizer = _tokenizer()
    expected_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(expected_prompt, add_special_tokens=False))
    assert out.text


def test_n_samples_come_back_as_outputs(client: Any) -> None:
    out = client.generate("Roses are", SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3))
    assert [o.index for o in out.outputs] == [0, 1]
    assert all(o.finish_reason in ("length", "stop") and o.token_ids for o in out.outputs)
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in out.outputs)


def test_stop_strings_are_trimmed_from_the_text(client: Any) -> None:
    prompt = "The capital of France is"
    base = client.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    k = len(base.text) // 2
    stop = base.text[k : k + 3]
    expected = base.text[: base.text.find(stop)]
    params = SamplingParams(max_tokens=12, temperature=0, stop=[stop])
    out = client.generate(prompt, params)
    assert (out.text, out.finish_reason, out.matched_stop) == (expected, "stop", stop)
    assert "".join(c.text for c in client.stream(prompt, params)) == expected


# ---------------------------------------------------------------------------- aborts free pages


def test_leaving_a_stream_early_aborts_and_frees_pages(client: Any) -> None:
    for i, _ in enumerate(client.stream("Write a long story about a dragon.", LONG)):
        if i == 2:
            break
    assert _eventually(lambda: _idle(client))


def test_abort_by_request_id_ends_the_stream_with_abort(smollm2_daemon: DaemonHandle, client: Any) -> None:
    stream = client.stream("Write a long story about a cat.", LONG, rid="abort-me")
    next(stream)
    smollm2_daemon.clients[1].abort("abort-me")
    rest = list(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].done


def test_timeout_raises_and_aborts_the_request(client: Any) -> None:
    with pytest.raises(DaemonTimeoutError, match="aborted"):
        client.generate("Write a long story about a fox.", LONG, timeout=0.01)


def test_a_killed_client_process_has_its_request_aborted(smollm2_daemon: DaemonHandle, client: Any) -> None:
    script = (
        "from minisgl.client import Client\nfrom minisgl.core import SamplingParams\n"
        f"c = Client('smollm2', address={smollm2_daemon.address!r}, auto_start=False)\n"
        "for chunk in c.stream('Write a long story about the sea.', SamplingParams(max_tokens=400)):\n"
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
    def __init__(self, connect: str, keys: Path, client_secret: Path, stranger_secret: Path, proc: Any) -> None:
        self.connect = connect
        self.server_public = keys / "server.key"
        self.client_secret = client_secret
        self.stranger_secret = stranger_secret
        self.proc = proc


@pytest.fixture(scope="module")
def curve_daemon(daemon_runtime_dir: Path, tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CurveDaemon]:
    import zmq.auth

    from minisgl.runtime.auth import ClientCurve, create_client_keys
    from minisgl.runtime.launcher import stop_daemon, wait_ready

    keys = tmp_path_factory.mktemp("curve")
    _, alice = create_client_keys(keys, "alice")
    _, mallory = zmq.auth.create_certificates(str(tmp_path_factory.mktemp("stranger")), "mallory")
    port = free_port()
    log = daemon_runtime_dir / "curve.log"
    proc = start_serve(
        ["--model", str(tiny_model_dir("llama")), "--address", f"tcp://0.0.0.0:{port}", "--allow-remote",
         "--curve-dir", str(keys), "--max-message-bytes", "65536", "--num-pages", "256"], log,
    )
    connect = f"tcp://127.0.0.1:{port}"
    curve = ClientCurve(alice, keys / "server.key")
    wait_ready(connect, 180, curve, proc=proc, log_path=log)
    yield CurveDaemon(connect, keys, alice, Path(mallory), proc)
    stop_daemon(connect, 30, curve)
    proc.wait(30)


def test_curve_client_with_authorized_keys_is_served(curve_daemon: CurveDaemon) -> None:
    with Client("tiny", curve_daemon.connect, auto_start=False, curve_client_key=str(curve_daemon.client_secret),
                curve_server_key=str(curve_daemon.server_public)) as c:
        out = c.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 4


@pytest.mark.parametrize("who", ["no keys", "unauthorized keys"])
def test_curve_daemon_refuses_clients_without_authorized_keys(curve_daemon: CurveDaemon, who: str) -> None:
    keys = {} if who == "no keys" else {
        "curve_client_key": str(curve_daemon.stranger_secret), "curve_server_key": str(curve_daemon.server_public),
    }
    t0 = time.monotonic()
    with pytest.raises(DaemonError):
        Client("tiny", curve_daemon.connect, auto_start=False, timeout=5, **keys)
    assert time.monotonic() - t0 < 10


def test_oversize_message_drops_only_that_connection(curve_daemon: CurveDaemon) -> None:
    with Client("tiny", curve_daemon.connect, auto_start=False, timeout=30,
                curve_client_key=str(curve_daemon.client_secret),
                curve_server_key=str(curve_daemon.server_public)) as big, \
         Client("tiny", curve_daemon.connect, auto_start=False, timeout=30,
                curve_client_key=str(curve_daemon.client_secret),
                curve_server_key=str(curve_daemon.server_public)) as other:
        with pytest.raises(DaemonError):
            big.generate(list(range(1, 30_000)), SamplingParams(max_tokens=2))
        assert len(other.generate([1, 2], SamplingParams(max_tokens=2, ignore_eos=True)).token_ids) == 2


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
    assert len(children) >= 3  # scheduler, tokenizer, detokenizer
    stream = client.stream("Write a long story about a mountain.", LONG)
    next(stream)
    os.kill(smollm2_daemon.pid, signal.SIGTERM)
    with pytest.raises(RequestAbortedError, match="shutting down"):
        for _ in stream:
            pass
    assert _eventually(lambda: not pid_alive(smollm2_daemon.pid))
    assert all(not pid_alive(c) for c in children)
    socket_path = Path(smollm2_daemon.address.removeprefix("ipc://"))
    assert not socket_path.exists() and not socket_path.with_name(socket_path.name + ".lock").exists()
    assert Registry().get(smollm2_daemon.address) is None
    log = smollm2_daemon.log_path.read_text()
    assert "stopping: received SIGTERM" in log and log.rstrip().endswith("stopped")
    with pytest.raises(DaemonNotRunningError):
        Client("smollm2", auto_start=False)

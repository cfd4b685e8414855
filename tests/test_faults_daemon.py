"""Hostile clients of a real daemon (a tiny model on the CPU): one request never stalls or fails another's."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
import zmq
from tests.daemon_fixtures import daemon_runtime_dir, start_serve  # noqa: F401 - fixtures

from minisgl.runtime import protocol as P

COMPILE_TIMEOUT_S = 10.0
NORMAL = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def address(tiny_model_dir, daemon_runtime_dir) -> Iterator[str]:  # noqa: F811
    from minisgl.runtime.launcher import wait_ready

    address = f"ipc://{daemon_runtime_dir}/faults.sock"
    log = daemon_runtime_dir / "faults.log"
    flags = ["--num-pages", "512", "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S), "--address", address]
    proc = start_serve(["--model", str(tiny_model_dir("llama")), "--device", "cpu", *flags], log)
    try:
        wait_ready(address, 300, proc=proc, log_path=log)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=60)


class RawClient:
    """A DEALER socket speaking the wire protocol directly (what any program on the socket can send)."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)

    def send(self, msg: Any) -> None:
        self.sock.send(P.encode(msg))

    def until_done(self, rid: str, timeout: float = 120) -> tuple[float, list[int], Any]:
        """(seconds until the request ended, its token ids, its last Chunk or Error)."""
        t0, ids = time.monotonic(), []
        while self.sock.poll(int(timeout * 1000)):
            msg = P.decode(self.sock.recv())
            if isinstance(msg, P.Error) and msg.rid == rid:
                return time.monotonic() - t0, ids, msg
            for chunk in msg.items if isinstance(msg, P.Chunks) else []:
                if chunk.rid == rid:
                    ids += chunk.token_ids
                    if chunk.done:
                        return time.monotonic() - t0, ids, chunk
        raise AssertionError(f"request {rid} did not end within {timeout}s")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def clients(address) -> Iterator[tuple[RawClient, RawClient]]:
    a, b = RawClient(address), RawClient(address)
    yield a, b
    a.close()
    b.close()


def stats(client: RawClient) -> dict[str, int]:
    client.send(P.GetStats("stats"))
    return P.decode(client.sock.recv()).stats


def test_a_client_cannot_abort_another_clients_request(clients):
    owner, other = clients
    owner.send(P.Generate("theirs", input_ids=[5, 6, 7], params=NORMAL))
    other.send(P.Abort("theirs"))
    _, ids, last = owner.until_done("theirs")
    assert isinstance(last, P.Chunk) and last.finish_reason == "length" and len(ids) == 24
    owner.send(P.Generate("mine", input_ids=[5, 6, 7], params={**NORMAL, "max_tokens": 2000}))
    owner.send(P.Abort("mine"))
    _, _, last = owner.until_done("mine")
    assert getattr(last, "finish_reason", None) == "abort" or isinstance(last, P.Error)


def test_a_grammar_that_compiles_for_a_minute_does_not_stall_a_normal_stream(clients):
    hostile, normal = clients
    normal.send(P.Generate("warm", input_ids=[4, 5], params={"regex": "[ab]+", "max_tokens": 2}))
    normal.until_done("warm")  # the grammar backend is built once, on the first constrained request
    normal.send(P.Generate("alone", input_ids=[4, 5, 6], params=NORMAL))
    alone_s, want, _ = normal.until_done("alone")
    hostile.send(P.Generate("hostile", input_ids=[1, 2, 3], params={"regex": "[^c]{1,3000}" * 40, "max_tokens": 4}))
    time.sleep(0.2)  # the compile is under way
    normal.send(P.Generate("normal", input_ids=[4, 5, 6], params=NORMAL))
    normal_s, ids, last = normal.until_done("normal")
    normal_end = time.monotonic()
    assert isinstance(last, P.Chunk) and ids == want
    _, _, failed = hostile.until_done("hostile")
    assert time.monotonic() - normal_end > 1.0  # the normal one ended well before the hostile one
    assert normal_s < 5 * alone_s + 3.0  # it shared the CPU with the compile, but never waited for it
    if isinstance(failed, P.Error):  # it fails alone, with a 400's error type
        assert failed.error_type == "GrammarError" and "grammar_compile_timeout" in failed.message, failed
    else:  # or, on a fast machine, it compiled in time and completed
        assert failed.finish_reason == "length"


@pytest.mark.parametrize(
    "params, error_type",
    [
        ({"n": 1000}, "InvalidRequestError"),
        ({"stop": ["x"] * 50_000}, "InvalidRequestError"),
        ({"json_schema": '{"type": "array", "items": ' * 400 + "{}" + "}" * 400}, "GrammarError"),
        ({"regex": "a" * 100_000}, "GrammarError"),
    ],
)
def test_a_request_past_a_limit_fails_alone_with_a_typed_error(clients, params, error_type):
    hostile, normal = clients
    normal.send(P.Generate("normal", input_ids=[4, 5, 6], params=NORMAL))
    hostile.send(P.Generate("hostile", input_ids=[1, 2, 3], params=params))
    _, _, failed = hostile.until_done("hostile", timeout=30)
    assert isinstance(failed, P.Error) and failed.error_type == error_type, failed
    _, ids, last = normal.until_done("normal")
    assert isinstance(last, P.Chunk) and len(ids) == 24
    s = stats(normal)
    assert s["free_pages"] + s["cached_pages"] == s["total_pages"]  # nothing leaked

"""An auto-started daemon: the first start in a process logs one line (model, address, idle timeout, how to stop
it), it stops by itself after its idle timeout ($MINISGL_IDLE_TIMEOUT, else 300 s), and a JSON-schema request
cut off by max_tokens says so in its last chunk's finish_detail."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from tests.daemon_fixtures import START_TIMEOUT_S, daemon_runtime_dir  # noqa: F401 - a fixture

from minisgl import SamplingParams
from minisgl.runtime import launcher

IDLE_S = 20  # long enough for the tests below to use it, short enough to watch it stop


@pytest.fixture(scope="module")
def started(daemon_runtime_dir: Path, tiny_model_dir: Any) -> Iterator[tuple[Any, list[str]]]:  # noqa: F811
    """A Client whose daemon it auto-started with MINISGL_IDLE_TIMEOUT=IDLE_S, and the lines logged meanwhile."""
    from minisgl import Client

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("minisgl").addHandler(handler)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_IDLE_TIMEOUT", str(IDLE_S))
        mp.setattr(launcher, "_announced", False)
        try:
            client = Client(str(tiny_model_dir("llama")), timeout=START_TIMEOUT_S, num_pages=256)
            again = Client(str(tiny_model_dir("llama")), timeout=START_TIMEOUT_S, num_pages=256)
            again.close()
            yield client, lines
        finally:
            logging.getLogger("minisgl").removeHandler(handler)
    client.close()


def test_the_first_auto_start_logs_one_line_saying_how_to_stop_it(started):
    client, lines = started
    started_lines = [line for line in lines if "started a daemon" in line]
    assert len(started_lines) == 1, lines
    assert client.address in started_lines[0] and f"stops after {IDLE_S}s idle" in started_lines[0]
    assert f"minisgl stop --address {client.address}" in started_lines[0]


def test_a_json_schema_cut_off_by_max_tokens_says_why_in_finish_detail(started):
    client, _ = started
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    chunks = list(
        client.stream(
            "Give a number as JSON:",
            SamplingParams(temperature=0, max_tokens=2),
            response_format=fmt,
        )
    )
    last = chunks[-1]
    assert last.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads("".join(c.text for c in chunks))  # really cut off
    assert "max_tokens" in last.finish_detail and "'maximum' on integers" in last.finish_detail
    result = client.generate("Give a number as JSON:", SamplingParams(temperature=0, max_tokens=2), response_format=fmt)
    assert result.outputs[0].finish_detail == last.finish_detail  # the folded result keeps it
    free = list(client.stream("hi", SamplingParams(temperature=0, max_tokens=2)))
    assert free[-1].finish_reason == "length" and free[-1].finish_detail is None  # no grammar: nothing to say


def test_an_auto_started_daemon_stops_after_its_idle_timeout(started):
    from minisgl.runtime.registry import pid_alive

    client, _ = started
    pid = launcher.ping(client.address).pid  # then only watch the pid: a ping is activity too
    deadline = time.monotonic() + IDLE_S + 60
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not pid_alive(pid)
    assert (
        f"--idle-timeout {IDLE_S}" in next(Path(client.address.removeprefix("ipc://")).parent.glob("*.log")).read_text()
    )


def test_the_default_idle_timeout_of_auto_starts_is_300_seconds_and_0_keeps_them(monkeypatch):
    monkeypatch.delenv("MINISGL_IDLE_TIMEOUT", raising=False)
    assert launcher.auto_idle_timeout() == 300.0
    monkeypatch.setenv("MINISGL_IDLE_TIMEOUT", "0")
    assert launcher.auto_idle_timeout() == 0.0

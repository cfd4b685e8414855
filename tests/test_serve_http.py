"""`minisgl serve` serves the HTTP API by default (127.0.0.1:30000; ZeroMQ only with --no-http, --http-port 0,
or when the default port is taken), and --served-model-name gives the names /v1/models lists and requests may
use (checked with the real openai package). Auto-started daemons never open HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.daemon_fixtures import daemon_runtime_dir, free_port, start_serve, wait_http  # noqa: F401 - a fixture

from minisgl import cli
from minisgl.server import DEFAULT_HTTP_PORT


def _http(argv: list[str]) -> Any:
    return cli._http_options(cli.build_parser().parse_args(["serve", *argv]))


def test_serve_listens_on_the_default_port_on_loopback(monkeypatch):
    monkeypatch.setattr(cli, "_port_free", lambda host, port: True)
    default = _http([])
    assert (default.host, default.port, default.served_model_names) == ("127.0.0.1", DEFAULT_HTTP_PORT, ())
    assert DEFAULT_HTTP_PORT == 30000


@pytest.mark.parametrize("argv", [["--no-http"], ["--http-port", "0"]])
def test_no_http_and_port_0_serve_zeromq_only(argv):
    assert _http(argv) is None


def test_a_taken_default_port_leaves_http_off_but_a_given_one_is_kept(monkeypatch):
    monkeypatch.setattr(cli, "_port_free", lambda host, port: False)
    assert _http([]) is None
    given = _http(["--http-port", "8123", "--served-model-name", "a", "b"])
    assert (given.port, given.served_model_names) == (8123, ("a", "b"))


def test_served_model_names_are_listed_and_accepted(daemon_runtime_dir: Path, tiny_model_dir: Any):  # noqa: F811
    import openai

    model = str(tiny_model_dir("llama"))
    port = free_port()
    address = f"ipc://{daemon_runtime_dir}/named.sock"
    log = daemon_runtime_dir / "named.log"
    argv = ["--model", model, "--address", address, "--http-port", str(port), "--num-pages", "256"]
    proc = start_serve([*argv, "--served-model-name", "tiny", "tiny-alias"], log)
    try:
        base = wait_http(port, proc, log, timeout=300)
        oai = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        assert [m.id for m in oai.models.list().data] == ["tiny", "tiny-alias"]
        for name in ("tiny", "tiny-alias", model):
            reply = oai.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
            )
            assert reply.model == "tiny" and reply.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        proc.terminate()
        proc.wait(60)

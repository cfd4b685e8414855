"""`minisgl shell`: the chat REPL, scripted through a pipe and driven through a pty."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

from minisgl.errors import InvalidRequestError
from minisgl.server.shell import run_shell


class EchoClient:
    """Streams back 'you said: <last user message>' word by word; records the conversations it saw."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.conversations: list[list[dict[str, str]]] = []
        self.fail_on = fail_on

    def stream(self, messages: list[dict[str, str]], params: Any = None, **kw: Any) -> Any:
        self.conversations.append([dict(m) for m in messages])
        last = messages[-1]["content"]
        if last == self.fail_on:
            raise InvalidRequestError("the prompt is too long")
        for i, word in enumerate(f"you said: {last}".split(" ")):
            yield SimpleNamespace(text=word if i == 0 else " " + word, finish_reason=None)


def _run(script: str, client: Any, **kw: Any) -> tuple[int, str]:
    out = io.StringIO()
    code = run_shell(client, stdin=io.StringIO(script), stdout=out, **kw)
    return code, out.getvalue()


def test_piped_shell_streams_answers_and_keeps_history():
    client = EchoClient()
    code, out = _run("hello\nhow are you\n", client, system_prompt="Be brief.")
    assert code == 0
    assert out.splitlines() == ["you said: hello", "you said: how are you"]
    assert client.conversations[1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "you said: hello"},
        {"role": "user", "content": "how are you"},
    ]


def test_reset_clears_history_and_exit_stops_reading():
    client = EchoClient()
    code, out = _run("one\n/reset\ntwo\n/exit\nnever sent\n", client)
    assert code == 0
    assert client.conversations[1] == [{"role": "user", "content": "two"}]
    assert len(client.conversations) == 2
    assert "(history cleared)" in out


def test_help_unknown_command_and_errors_do_not_end_the_session():
    client = EchoClient(fail_on="boom")
    code, out = _run("/help\n/nope\nboom\nstill here\n", client)
    assert code == 0
    assert "/reset" in out and "unknown command '/nope'" in out
    assert "error: the prompt is too long" in out
    # The failed question is not kept in the history.
    assert client.conversations[-1] == [{"role": "user", "content": "still here"}]

"""`minisgl shell`: the chat REPL, scripted through a pipe and driven through a pty."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from daemon_fixtures import daemon_runtime_dir, smollm2_daemon  # noqa: F401 - fixtures are used by name
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


def test_answers_are_written_chunk_by_chunk_as_they_arrive():
    class Recorder(io.StringIO):
        flushed: list[str] = []

        def flush(self) -> None:
            self.flushed.append(self.getvalue())

    out = Recorder()
    run_shell(EchoClient(), stdin=io.StringIO("a b\n"), stdout=out)
    assert ["you", "you said:", "you said: a", "you said: a b", "you said: a b\n"] == out.flushed


def test_help_unknown_command_and_errors_do_not_end_the_session():
    client = EchoClient(fail_on="boom")
    code, out = _run("/help\n/nope\nboom\nstill here\n", client)
    assert code == 0
    assert "/reset" in out and "unknown command '/nope'" in out
    assert "error: the prompt is too long" in out
    # The failed question is not kept in the history.
    assert client.conversations[-1] == [{"role": "user", "content": "still here"}]


# ---------------------------------------------------------------------------- acceptance: a real daemon


def _shell_cmd(address: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "minisgl",
        "shell",
        "--model",
        "smollm2",
        "--address",
        address,
        "--temperature",
        "0",
        "--max-tokens",
        "24",
    ]


def test_piped_shell_answers_a_question_and_exits_cleanly(smollm2_daemon):
    script = "What is the capital of France?\n/reset\n/exit\n"
    done = subprocess.run(_shell_cmd(smollm2_daemon.address), input=script, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "Paris" in lines[0] and lines[1] == "(history cleared)" and len(lines) == 2


def test_shell_on_a_pty_streams_answers_and_reset_forgets_the_conversation(smollm2_daemon):
    import pexpect

    shell = pexpect.spawn(
        _shell_cmd(smollm2_daemon.address)[0],
        _shell_cmd(smollm2_daemon.address)[1:],
        env={**os.environ, "TERM": "dumb"},
        encoding="utf-8",
        timeout=300,
    )
    try:
        shell.expect_exact(">>> ")
        answers = []
        for before in ("What is the capital of France?", "/reset", "What is the capital of France?"):
            shell.sendline(before)
            shell.expect_exact(">>> ")
            answers.append(shell.before.split("\n", 1)[1].strip())  # drop the echoed input line
        assert "Paris" in answers[0]
        assert answers[1] == "(history cleared)"
        # After /reset the question is asked in a fresh conversation: the same greedy answer.
        assert answers[2] == answers[0]
        shell.sendline("/exit")
        shell.expect(pexpect.EOF)
    finally:
        shell.close()
    assert shell.exitstatus == 0

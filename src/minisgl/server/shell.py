"""`minisgl shell`: an interactive chat with the daemon's model, streamed token by token."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from minisgl.core import SamplingParams
from minisgl.errors import MiniSGLError
from minisgl.server.params import sampling_params_for

HELP = """Commands:
  /reset   forget the conversation so far
  /help    show this help
  /exit    quit (also /quit or Ctrl-D)
Anything else is sent to the model; Ctrl-C stops an answer."""


def run_shell(
    client: Any,
    system_prompt: str | None = None,
    sampling_params: SamplingParams | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> int:
    """Chat with `client` (a minisgl Client) until /exit or end of input; returns an exit code.

    On a terminal the prompt is `>>> ` and input has line editing; on a pipe the shell reads
    plain lines and prints each answer on its own line, so it can be scripted.
    """
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    interactive = stdin.isatty() and stdout.isatty()
    params = sampling_params or sampling_params_for("shell", {})
    history: list[dict[str, str]] = []

    def say(text: str = "", end: str = "\n") -> None:
        stdout.write(text + end)
        stdout.flush()

    if interactive:
        import readline  # noqa: F401 - line editing and history for input()

        say("minisgl shell: /help for commands, /exit to quit")

    while True:
        try:
            line = _read_line(stdin, interactive)
        except KeyboardInterrupt:
            say()
            continue
        if line is None:
            if interactive:
                say()
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            say("(history cleared)")
            continue
        if line == "/help":
            say(HELP)
            continue
        if line.startswith("/"):
            say(f"unknown command {line.split()[0]!r}: /help lists the commands")
            continue

        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + history
        answer: list[str] = []
        stream = None
        try:
            stream = client.stream(messages, params)
            for chunk in stream:
                if chunk.text:
                    answer.append(chunk.text)
                    say(chunk.text, end="")
        except KeyboardInterrupt:
            say(" [stopped]", end="")
        except MiniSGLError as e:
            say()
            say(f"error: {e}")
            history.pop()
            continue
        finally:
            if stream is not None:
                stream.close()  # leaving the stream early aborts the request in the daemon
        say()
        history.append({"role": "assistant", "content": "".join(answer)})


def _read_line(stdin: TextIO, interactive: bool) -> str | None:
    """One line of input, or None at end of input."""
    if interactive and stdin is sys.stdin:
        try:
            return input(">>> ")
        except EOFError:
            return None
    line = stdin.readline()
    return line if line else None

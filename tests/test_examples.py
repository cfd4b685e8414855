"""Every example in examples/ runs as its docstring documents it and gives the right answer with the default model
(SmolLM2-135M-Instruct): the daemon clients against one shared daemon, the in-process ones on their own. The LiteLLM
proxy's documented commands bind loopback and give its two daemons no port to fight over."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.daemon_fixtures import DaemonHandle, daemon_runtime_dir, smollm2_daemon  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240  # one example on a loaded 2-core runner; a quiet one takes a fraction


def run_example(name: str, *args: str) -> str:
    """The example's stdout (and stderr, for the failure message); it must exit 0 within TIMEOUT_S."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=ROOT,
        env=os.environ.copy(),  # MINISGL_RUNTIME_DIR: the module's daemon is the one the example finds
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def answer_of(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("A: ")]
    assert len(lines) == 1, output
    return lines[0]


def test_chat_streams_from_the_daemon(smollm2_daemon: DaemonHandle):  # noqa: F811
    out = run_example("chat.py", "What is the capital of France?")
    assert "Paris" in answer_of(out), out


def test_langchain_agent_multiplies_12_by_7(smollm2_daemon: DaemonHandle):  # noqa: F811
    pytest.importorskip("langchain_core")
    out = run_example("langchain_agent.py")  # as documented: no arguments
    assert re.search(r"^-> multiply\(\{'a': 12, 'b': 7\}\)$", out, re.M), out
    assert "<- 84" in out and "add(" not in out, out
    answer = answer_of(out)
    assert re.search(r"\b84\b", answer), out
    assert "<tool_" not in out and "</tool_" not in out, out  # no template tags in the final answer


def test_langchain_agent_with_a_named_tool(smollm2_daemon: DaemonHandle):  # noqa: F811
    pytest.importorskip("langchain_core")
    out = run_example("langchain_agent.py", "--tool", "add", "What is 25 plus 17?")
    assert re.search(r"^-> add\(\{'a': 25, 'b': 17\}\)$", out, re.M) and "<- 42" in out, out
    assert "<tool_" not in out, out


def test_langchain_create_agent_answers_without_template_tags(smollm2_daemon: DaemonHandle):  # noqa: F811
    pytest.importorskip("langchain.agents")
    out = run_example("langchain_create_agent.py")  # as documented: no arguments
    assert re.search(r"^-> multiply\(\{'a': 12, 'b': 7\}\)$", out, re.M) and "<- 84" in out, out
    assert re.search(r"\b84\b", answer_of(out)), out
    assert "<tool_" not in out and "</tool_" not in out, out  # the model echoes <tool_response>: never content


def test_offline_chat_answers_in_process():
    out = run_example("offline_chat.py", "What is the capital of France?")
    assert "Paris" in answer_of(out), out


def test_hf_generate_answers_through_patched_generate():
    pytest.importorskip("transformers_minisgl")
    out = run_example("hf_generate.py", "What is the capital of France?")
    assert "Paris" in answer_of(out), out
    assert "transformers' again: True" in out, out


def test_tiny_moe_matches_hf_transformers(tmp_path: Path):
    out = run_example("tiny_moe.py", "--out", str(tmp_path / "moe"))
    checks = re.findall(r"same tokens as HF transformers: (\w+)", out)
    assert checks and all(c == "True" for c in checks), out


def _shell_commands(text: str, program: str) -> list[list[str]]:
    """The command lines of `program` in a text's bash blocks and comments (continuations joined)."""
    text = text.replace("\\\n", " ")
    lines = [re.sub(r"^\s*#\s*", "", line) for line in text.splitlines()]
    return [
        shlex.split(line.split(program, 1)[1].split("#", 1)[0].rstrip(" &"))
        for line in lines
        if re.search(rf"(^|\s){program} ", line)
    ]


@pytest.mark.parametrize("doc", ["examples/litellm/README.md", "examples/litellm/config.yaml"])
def test_litellm_proxy_commands_bind_loopback_and_daemons_share_no_port(doc: str):
    text = (ROOT / doc).read_text()
    proxies = _shell_commands(text, "litellm")
    assert proxies and all("--host" in p and p[p.index("--host") + 1] == "127.0.0.1" for p in proxies), proxies
    serves = [argv for argv in _shell_commands(text, "minisgl") if argv[0] == "serve"]
    assert len(serves) == 2, serves
    http = [
        None if "--no-http" in a else a[a.index("--http-port") + 1] if "--http-port" in a else "30000" for a in serves
    ]
    taken = [port for port in http if port is not None]
    assert len(taken) == len(set(taken)), http  # two daemons on one HTTP port: the second would fail
    addresses = [a[a.index("--address") + 1] for a in serves]
    assert len(set(addresses)) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in addresses), addresses


def test_readme_litellm_proxy_command_binds_loopback():
    commands = re.findall(r"`(litellm --config [^`]*)`", (ROOT / "README.md").read_text())
    assert commands and all(re.search(r"--host 127\.0\.0\.1\b", c) for c in commands), commands

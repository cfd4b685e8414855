"""An unknown model name fails at once, before any daemon starts, with a message that lists the aliases and the
daemons running, and leaves no file behind (no `<model>-*.log`, no `.start.lock`): through Client, the
`minisgl generate` command and the real LiteLLM package's provider."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minisgl import errors


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "run"
    monkeypatch.setenv("MINISGL_RUNTIME_DIR", str(path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty hub cache: the name is nowhere local
    return path


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) if path.exists() else []


def test_client_with_an_unknown_model_fails_in_well_under_a_second_offline(runtime_dir, monkeypatch):
    from minisgl import Client

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(errors.UnknownModelError) as info:
        Client(model="doesnotexist")
    assert time.perf_counter() - t0 < 0.5
    assert "smollm2" in str(info.value) and "daemons running here: none" in str(info.value)
    assert "HF_HUB_OFFLINE" in str(info.value)
    assert _files(runtime_dir) == []


def test_an_unreachable_hub_fails_fast_without_a_daemon(runtime_dir, monkeypatch):
    from minisgl import Client

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens, refused at once
    t0 = time.perf_counter()
    with pytest.raises(errors.UnknownModelError, match="unreachable"):
        Client(model="someone/doesnotexist")
    assert time.perf_counter() - t0 < 1.0
    assert _files(runtime_dir) == []


def test_a_missing_path_is_refused_without_asking_the_hub(runtime_dir, monkeypatch):
    from minisgl import Client

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(errors.UnknownModelError, match="existing path"):
        Client(model="./no/such/model.gguf")
    assert _files(runtime_dir) == []


def test_minisgl_generate_with_an_unknown_model_exits_with_the_message(runtime_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINISGL_RUNTIME_DIR": str(runtime_dir)}
    env["HF_HUB_CACHE"] = str(tmp_path / "hub")
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "generate", "--model", "doesnotexist", "hello"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "'doesnotexist' is not a model directory" in proc.stderr and "smollm2" in proc.stderr
    assert _files(runtime_dir) == []


def test_litellm_completion_with_an_unknown_model_fails_fast(runtime_dir, monkeypatch):
    litellm = pytest.importorskip("litellm")
    import litellm_minisgl

    litellm_minisgl.register()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(Exception) as info:
        litellm.completion(model="minisgl/doesnotexist", messages=[{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 5.0  # litellm's own wrapping included
    assert "doesnotexist" in str(info.value) and "smollm2" in str(info.value)
    assert _files(runtime_dir) == []

"""minisgl.env is the one registry of MINISGL_* variables: read lazily, typed, feeding EngineConfig, documented."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl import env
from minisgl.config import EngineConfig
from minisgl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[Path]:
    return sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")])


def _environ_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each read of a MINISGL_* variable: os.environ.get / os.getenv / os.environ[...] loads."""
    reads = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "environ.get", "getenv", "os.environ.setdefault"):
                name = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if ast.unparse(node.value) in ("os.environ", "environ") and isinstance(node.slice, ast.Constant):
                name = node.slice.value
        if isinstance(name, str) and name.startswith("MINISGL_"):
            reads.append((node.lineno, name))
    return reads


def test_only_env_py_reads_minisgl_variables():
    reads = [
        f"{path.relative_to(ROOT)}:{line} {name}"
        for path in _sources()
        if path != ROOT / "src/minisgl/env.py"
        for line, name in _environ_reads(ast.parse(path.read_text()))
    ]
    assert reads == []


def test_the_read_finder_sees_each_form_of_read():
    tree = ast.parse(
        'import os\nos.environ.get("MINISGL_A")\nos.getenv("MINISGL_B", "1")\nx = os.environ["MINISGL_C"]\n'
        'os.environ["MINISGL_D"] = "w"\nos.environ.get("HOME")\n'
    )
    assert _environ_reads(tree) == [(2, "MINISGL_A"), (3, "MINISGL_B"), (4, "MINISGL_C")]


def test_every_variable_the_code_names_is_declared():
    declared = {var.name for var in env.VARIABLES}
    named = {m for path in _sources() for m in re.findall(r"MINISGL_[A-Z0-9_]+", path.read_text())}
    assert named - declared == set()
    assert len(declared) == len(env.VARIABLES)  # each declared once


def test_variables_are_read_when_asked_for(monkeypatch):
    monkeypatch.delenv("MINISGL_IDLE_TIMEOUT", raising=False)
    assert env.IDLE_TIMEOUT.get() == 0.0
    monkeypatch.setenv("MINISGL_IDLE_TIMEOUT", "2.5")
    assert env.IDLE_TIMEOUT.get() == 2.5
    monkeypatch.setenv("MINISGL_IDLE_TIMEOUT", "")  # empty counts as unset
    assert env.IDLE_TIMEOUT.get() == 0.0
    monkeypatch.setenv("MINISGL_RUNTIME_DIR", "~/x")
    assert env.RUNTIME_DIR.get() == Path.home() / "x"
    for raw, value in [("0", False), ("false", False), ("1", True), ("On", True)]:
        monkeypatch.setenv("MINISGL_XQA", raw)
        assert env.XQA.get() is value


@pytest.mark.parametrize(
    ("name", "raw", "match"),
    [
        ("MINISGL_TP_FUSED_MB", "lots", "MINISGL_TP_FUSED_MB='lots' is not a valid int"),
        ("MINISGL_XQA", "maybe", "MINISGL_XQA='maybe' is not a valid bool"),
        ("MINISGL_TP_ALLREDUCE", "mpi", "MINISGL_TP_ALLREDUCE must be one of nccl, symm_mem, fused, fused_ll"),
        ("MINISGL_MOE_PARALLEL", "dp", "MINISGL_MOE_PARALLEL must be one of auto, tp, ep"),
    ],
)
def test_a_bad_value_raises_a_config_error_naming_the_variable(monkeypatch, name, raw, match):
    monkeypatch.setenv(name, raw)
    var = next(v for v in env.VARIABLES if v.name == name)
    with pytest.raises(ConfigError, match=re.escape(match)):
        var.get()


def test_engine_settings_default_from_the_environment_and_keywords_override(monkeypatch):
    for name in ("TP_ALLREDUCE", "TP_FUSED_MB", "TP_VOCAB_SAMPLING", "XQA", "PIECEWISE_GRAPH"):
        monkeypatch.delenv(f"MINISGL_{name}", raising=False)
    plain = EngineConfig()
    assert (plain.tp_allreduce, plain.tp_fused_mb, plain.tp_vocab_sampling) == ("fused_ll", 8, True)
    assert (plain.disable_xqa, plain.piecewise_cuda_graph_max_tokens) == (False, 4096)
    monkeypatch.setenv("MINISGL_TP_ALLREDUCE", "nccl")
    monkeypatch.setenv("MINISGL_TP_FUSED_MB", "192")
    monkeypatch.setenv("MINISGL_TP_VOCAB_SAMPLING", "0")
    monkeypatch.setenv("MINISGL_XQA", "0")
    monkeypatch.setenv("MINISGL_PIECEWISE_GRAPH", "0")
    got = EngineConfig()
    assert (got.tp_allreduce, got.tp_fused_mb, got.tp_vocab_sampling) == ("nccl", 192, False)
    assert (got.disable_xqa, got.piecewise_cuda_graph_max_tokens) == (True, 0)
    assert EngineConfig.from_kwargs("m", tp_allreduce="symm_mem", disable_xqa=False).tp_allreduce == "symm_mem"
    with pytest.raises(ConfigError, match="tp_allreduce must be one of"):
        EngineConfig(tp_allreduce="mpi")


def test_the_readme_table_is_the_registry():
    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- env-table:begin -->\n", "<!-- env-table:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    section = text[text.index(begin) + len(begin) : text.index(end)]
    assert section == env.markdown_table(), "regenerate it: python -m minisgl.env"
    for var in env.VARIABLES:
        assert f"| `{var.name}` |" in section


def test_python_m_minisgl_env_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "minisgl.env"], capture_output=True, text=True, check=True).stdout
    assert out == env.markdown_table()
    assert out.splitlines()[0] == "| variable | type | default | what it does |"

"""The size rule for the shipped code: no module over 500 lines, no function over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("src", "integrations")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _python_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def _oversized(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root)
    found = []
    module_lines = len(text.splitlines())
    if module_lines > MAX_MODULE_LINES:
        found.append(f"{rel}: module has {module_lines} lines (limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno}: {node.name} has {length} lines (limit {MAX_FUNCTION_LINES})")
    return found


def test_the_source_tree_is_found():
    # Guards against a moved tree making the size check pass vacuously.
    assert any(p.name == "engine.py" for p in _python_files())


def test_no_module_over_500_lines_and_no_function_over_80_lines():
    offenders = [line for path in _python_files() for line in _oversized(path)]
    assert not offenders, "split these into smaller modules or helpers:\n" + "\n".join(offenders)


def test_the_checker_flags_a_long_function(tmp_path: Path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "long.py"
    source.write_text(f"def long():\n{body}\n")
    assert _oversized(source, tmp_path) == [f"long.py:1: long has {MAX_FUNCTION_LINES + 1} lines (limit 80)"]


def test_the_checker_flags_a_long_module(tmp_path: Path):
    source = tmp_path / "big.py"
    source.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _oversized(source, tmp_path) == [f"big.py: module has {MAX_MODULE_LINES + 1} lines (limit 500)"]

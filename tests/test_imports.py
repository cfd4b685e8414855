"""Imports run down the layers (LAYERS below, docs/ARCHITECTURE.md's list; issues 16 and 49).

Read with `ast`, nothing is imported. Graphs over src/minisgl and integrations/:
- module level: what importing a module runs (imports in functions and under TYPE_CHECKING left out);
- run time: those plus the imports inside functions (the lazy ones a call runs);
- all: every import anywhere in a module, those under `if TYPE_CHECKING:` (the ones a type checker
  follows) included.
No graph may hold a loop (a loop of type-only or lazy imports still ties the modules into one knot),
and no edge of the run-time graph may point up a layer. An edge goes to the module an import names:
relative imports are resolved, and `from pkg import name` points at pkg.name where that is a module.
Package `__init__` modules are followed as Python runs them: importing pkg.sub.mod runs pkg/__init__ and
pkg/sub/__init__ first (an edge to each package the importer is not inside), and `from pkg import name`, where
pkg's `__init__` re-exports name, also points at the module that defines it.
Names loaded through importlib by string (minisgl.__getattr__'s _LAZY, a plugin's "module:Class"
reference) are a facade, not an edge: the module naming them does not depend on the code behind them.
Adapters (integrations/*) import from minisgl only the names in `minisgl.__all__` (the error classes
included: `minisgl` re-exports them); an adapter's benchmark (its `bench` module, run by `minisgl bench`) is a
tool and may use minisgl's tool modules, under the layer rule like every module.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "src", ROOT / "integrations")
ADAPTERS = ("langchain_minisgl", "litellm_minisgl", "transformers_minisgl")

# Lowest first (docs/ARCHITECTURE.md, "Layers"); a module belongs to the longest prefix that names it. A module
# may import its own layer and those below, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "nouns",
        (
            "minisgl",
            "minisgl.errors",
            "minisgl.env",
            "minisgl.config",
            "minisgl.core",
            "minisgl.lifetime",
            "minisgl.hooks",
        ),
    ),
    (
        "tensor-parallel group, grammars",
        ("minisgl.distributed", "minisgl.structured", "minisgl.tokenizer", "minisgl.hf_records", "minisgl.limits"),
    ),
    ("kvcache", ("minisgl.kvcache",)),
    ("layers", ("minisgl.layers",)),
    ("models, attention", ("minisgl.models", "minisgl.attention")),
    ("plugins", ("minisgl.plugins",)),
    ("engine", ("minisgl.engine",)),
    ("scheduler", ("minisgl.scheduler",)),
    ("runtime", ("minisgl.runtime", "minisgl.llm")),
    ("client, server", ("minisgl.client", "minisgl.server")),
    ("cli, bench", ("minisgl.cli", "minisgl.__main__", "minisgl.bench")),
    ("adapters", ADAPTERS),
]

# Adapter imports of minisgl internals that are known debt, each with its reason (none today).
ADAPTER_EXCEPTIONS: set[tuple[str, str, str]] = set()


def _modules(sources: Sequence[Path] = SOURCES) -> dict[str, Path]:
    mods = {}
    for base in sources:
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.Module, module: str, is_pkg: bool, lazy: bool, type_checking: bool | None = None
) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) of each import; lazy: also those in functions, type_checking (default:
    lazy) also those under TYPE_CHECKING."""
    type_checking = lazy if type_checking is None else type_checking
    found: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_stmt(stmt)
                continue
            visit_stmt(child)

    def visit_stmt(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_pkg else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                target = ".".join(package + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.extend((target, alias.name, node.lineno) for alias in node.names)
        elif lazy or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            visit(node)  # a class body runs at import, a function body when called

    visit(tree)
    return found


class Graph:
    def __init__(self, lazy: bool, sources: Sequence[Path] = SOURCES, type_checking: bool | None = None) -> None:
        self.modules = _modules(sources)
        self.edges: dict[str, dict[str, int]] = {}  # module -> {imported module: line}
        self.names: dict[str, list[tuple[str, str | None, int]]] = {}
        packages = {mod for mod, path in self.modules.items() if path.name == "__init__.py"}
        for mod, path in self.modules.items():
            imports = _imports(ast.parse(path.read_text()), mod, mod in packages, lazy, type_checking)
            self.names[mod] = imports
        for mod in self.modules:
            deps: dict[str, int] = {}
            for target, name, line in self.names[mod]:
                full = f"{target}.{name}" if name is not None else target
                targets = [full] if full in self.modules else [target, *self._defined_in(target, name, packages)]
                for dep in targets:
                    for pkg in _packages_run(dep, mod, packages):
                        deps.setdefault(pkg, line)
                    if dep in self.modules:
                        deps.setdefault(dep, line)
            deps.pop(mod, None)
            self.edges[mod] = deps

    def _defined_in(self, package: str, name: str | None, packages: set[str], depth: int = 0) -> list[str]:
        """The module(s) a package's `__init__` re-exports `name` from, followed through re-exports."""
        if package not in packages or name is None or depth > 8:
            return []
        found = []
        for target, imported, _ in self.names[package]:
            if imported == name:
                full = f"{target}.{name}"
                source = full if full in self.modules else target
                if source in self.modules and source != package:
                    found += [source, *self._defined_in(source, name, packages, depth + 1)]
        return found


def _packages_run(target: str, importer: str, packages: set[str]) -> list[str]:
    """The package `__init__`s importing target runs first: its parents the importer is not inside."""
    parts = target.split(".")
    inside = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    return [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in packages and p not in inside]


def find_cycle(edges: dict[str, dict[str, int]] | dict[str, set[str]]) -> list[str] | None:
    """One import loop as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := dfs(start)) is not None:
            return cycle
    return None


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank)
    return None if best is None else best[1]


@pytest.fixture(
    scope="module", params=[(False, False), (True, False), (True, True)], ids=["module-level", "run-time", "all"]
)
def graph(request: pytest.FixtureRequest) -> Graph:
    lazy, type_checking = request.param
    return Graph(lazy=lazy, type_checking=type_checking)


def test_no_import_loops(graph: Graph) -> None:
    cycle = find_cycle(graph.edges)
    assert cycle is None, (
        "import loop: "
        + " -> ".join(f"{a} (line {graph.edges[a][b]})" for a, b in zip(cycle, cycle[1:]))
        + f" -> {cycle[-1]}"
    )


def test_every_module_has_a_layer() -> None:
    assert [m for m in _modules() if layer_of(m) is None] == []


def upward_imports(graph: Graph, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    """Each edge that points up a layer, as 'mod (layer) imports dep (layer) at line n'."""
    rank = {mod: layer_of(mod, layers) for mod in graph.modules}
    return [
        f"{mod} ({layers[rank[mod]][0]}) imports {dep} ({layers[rank[dep]][0]}) at line {line}"  # type: ignore[index]
        for mod, deps in sorted(graph.edges.items())
        for dep, line in sorted(deps.items())
        if rank[dep] > rank[mod]  # type: ignore[operator]
    ]


def test_imports_point_down() -> None:
    assert upward_imports(Graph(lazy=True, type_checking=False)) == []  # a type-only import may name a type from above


def test_adapters_use_only_the_public_api() -> None:
    import minisgl

    public = set(minisgl.__all__)
    graph = Graph(lazy=True)
    bad = []
    for mod, imports in sorted(graph.names.items()):
        adapter = mod.split(".")[0]
        if adapter not in ADAPTERS or mod == f"{adapter}.bench":  # a benchmark is a tool (see the docstring)
            continue
        for target, name, line in imports:
            if target.split(".")[0] != "minisgl" or (adapter, target, name) in ADAPTER_EXCEPTIONS:
                continue
            if target != "minisgl" or name not in public:
                bad.append(f"{mod}:{line} imports {target}{'.' + name if name else ''}")
    assert bad == []
    for name in public:  # and every exported name resolves
        assert getattr(minisgl, name) is not None


def test_the_checks_catch_violations() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert layer_of("minisgl.runtime.daemon") > layer_of("minisgl.engine.engine")  # type: ignore[operator]
    assert layer_of("minisgl.plugins") > layer_of("minisgl.models.registry") > layer_of("minisgl.layers")  # type: ignore[operator]
    assert layer_of("minisgl.runtime.ranks") > layer_of("minisgl.scheduler") > layer_of("minisgl.distributed")  # type: ignore[operator]
    assert layer_of("minisgl.server.app") > layer_of("minisgl.runtime.daemon")  # type: ignore[operator]
    tree = ast.parse(
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\n"
        "def f():\n    from .sib import x\n"
    )
    assert [t for t, _, _ in _imports(tree, "pkg.mod", False, lazy=False)] == ["os", "typing"]
    assert [t for t, _, _ in _imports(tree, "pkg.mod", False, lazy=True)] == ["os", "typing", "a.b", "pkg.sib"]


def _write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_circle_through_a_type_checking_and_a_function_import_is_found(tmp_path):
    """pkg.a -> pkg.sub.b (in a function, relative) -> pkg.c (TYPE_CHECKING, `from pkg import c`) -> pkg.a."""
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "def f():\n    from .sub import b\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n",
            "pkg/c.py": "import os\nimport pkg.a\n",
        },
    )
    assert find_cycle(Graph(lazy=True, sources=[tmp_path]).edges) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert find_cycle(Graph(lazy=False, sources=[tmp_path]).edges) is None  # invisible at import time
    (tmp_path / "pkg/a.py").write_text("X = 1\n")  # the circle broken
    assert find_cycle(Graph(lazy=True, sources=[tmp_path]).edges) is None


def test_adapters_do_not_reach_into_the_engine():
    """Adapters drive an in-process engine through LLM's public methods, never its scheduler or engine."""
    private = {"scheduler", "engine", "prefix_cache", "graph_runner", "attn_backend", "kv_pool"}
    reached = [
        f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}"
        for adapter in ADAPTERS
        for path in sorted((ROOT / "integrations" / adapter).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in private
    ]
    assert not reached, reached


# A synthetic tree for the checker itself: pkg.models's __init__ re-exports its loader, which loads plugins.
SYNTHETIC_LAYERS = [("nouns", ("pkg", "pkg.core")), ("models", ("pkg.models",)), ("plugins", ("pkg.plugins",))]
SYNTHETIC = {
    "pkg/__init__.py": "",
    "pkg/core.py": "",
    "pkg/models/__init__.py": "from pkg.models.loader import load\n",
    "pkg/models/registry.py": "from pkg.core import *\n",
    "pkg/models/loader.py": "def load():\n    pass\n",
    "pkg/plugins.py": "from pkg.models import registry\n",
}


def test_a_circle_through_a_package_init_is_found(tmp_path):
    """pkg.models (__init__) -> its loader -> pkg.plugins -> pkg.models.registry, whose import runs pkg.models first."""
    _write_package(tmp_path, {**SYNTHETIC, "pkg/models/loader.py": "from pkg import plugins\n"})
    graph = Graph(lazy=False, sources=[tmp_path])
    assert find_cycle(graph.edges) == ["pkg.models", "pkg.models.loader", "pkg.plugins", "pkg.models"]
    assert upward_imports(graph, SYNTHETIC_LAYERS) == [
        "pkg.models.loader (models) imports pkg.plugins (plugins) at line 1"
    ]
    _write_package(tmp_path, SYNTHETIC)  # the loader no longer loads the plugins: no circle, nothing climbs
    graph = Graph(lazy=False, sources=[tmp_path])
    assert find_cycle(graph.edges) is None and upward_imports(graph, SYNTHETIC_LAYERS) == []


def test_an_upward_import_through_a_re_export_is_found(tmp_path):
    """pkg.core imports a name pkg.models's __init__ re-exports: it climbs to pkg.models and to its loader."""
    _write_package(tmp_path, {**SYNTHETIC, "pkg/core.py": "def f():\n    from pkg.models import load\n"})
    assert upward_imports(Graph(lazy=True, sources=[tmp_path]), SYNTHETIC_LAYERS) == [
        "pkg.core (nouns) imports pkg.models (models) at line 2",
        "pkg.core (nouns) imports pkg.models.loader (models) at line 2",
    ]
    assert upward_imports(Graph(lazy=False, sources=[tmp_path]), SYNTHETIC_LAYERS) == []  # lazy: run time only

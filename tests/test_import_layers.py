"""pyturbo's modules import each other in layers, with no cycle.

Every import statement of every module is read (those inside functions too: a lazy import still
ties two modules together), resolved to the pyturbo module it names, and the graph is checked:
- no cycle anywhere (a cycle is how "lab" had come to hold the format that the runtime needs);
- pyturbo.format, the format's definition, imports only the type table and the path helpers;
- the lab (experiments) is imported by nothing in the package but the CLI's `kvlab` command.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pyturbo"

# what pyturbo.format may import from the package: the type table and where the checkout is
FORMAT_MAY_IMPORT = {"pyturbo.types", "pyturbo._paths"}


def modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the pyturbo modules it imports (package __init__ modules included by name)."""
    mods = modules(package)
    graph: dict[str, set[str]] = {m: set() for m in mods}

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")
                    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # `from P import x` imports the submodule P.x where there is one, else P itself
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
            for t in targets:
                r = resolve(t) if t.split(".")[0] == package.name else None
                if r and r != mod:
                    graph[mod].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def test_no_import_cycle(graph):
    found = cycles(graph)
    assert not found, "import cycles in pyturbo/: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_format_depends_on_nothing_above_it(graph):
    bad = {m: sorted(t for t in deps if not t.startswith("pyturbo.format") and t not in FORMAT_MAY_IMPORT)
           for m, deps in graph.items() if m.startswith("pyturbo.format")}
    assert not {m: d for m, d in bad.items() if d}, f"pyturbo.format imports from above it: {bad}"


def test_only_the_cli_reaches_into_the_lab(graph):
    users = sorted(m for m, deps in graph.items()
                   if not m.startswith("pyturbo.lab") and any(t.startswith("pyturbo.lab") for t in deps))
    assert users in ([], ["pyturbo.cli"]), f"modules outside the lab that import it: {users}"


def test_the_graph_sees_real_imports(graph):
    """The reader resolves relative, absolute and lazy imports: a few edges that exist."""
    assert "pyturbo.format.codebook" in graph["pyturbo.hf.torch_codec"]  # from ..format.codebook import ...
    assert "pyturbo.format.trellis" in graph["pyturbo.format.codebook"]  # from . import trellis
    assert "pyturbo.hf" in graph["pyturbo.lab.trellis"]                   # a lazy import inside e2e()
    assert "pyturbo.llama" in graph["pyturbo"]                            # pyturbo/__init__'s lazy Llama


def test_a_cycle_is_found(tmp_path):
    """The check can fail: two modules of a throwaway package that import each other lazily."""
    pkg = tmp_path / "pyturbo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    assert cycles(import_graph(pkg)) == [["pyturbo.a", "pyturbo.sub.b"]]

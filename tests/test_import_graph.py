"""marft_bridge's module graph is acyclic, read from the source with ``ast``.

Every import counts: module level, inside functions (lazy imports), relative ones, and those under
``if TYPE_CHECKING:`` (they never run, but a type named against the flow still ties the two
modules together: name it by a Protocol instead). An edge goes to the module an import
names (``from . import x`` names the submodule ``x`` when there is one); importing a submodule
also runs its parent packages' ``__init__``, which is not an edge of the importer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import marft_bridge

ROOT = Path(marft_bridge.__file__).parent
PKG = "marft_bridge"


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST):
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            for t in targets:
                while t and t not in modules and t.startswith(PKG):
                    t = t.rpartition(".")[0]  # ``import marft_bridge.x.y`` of a name: its module
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []

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


def cycle_edges(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    members = set(comp)
    return sorted(f"{a} -> {b}" for a in comp for b in graph[a] if b in members)


def test_the_reader_sees_relative_and_lazy_imports():
    g = edges(module_names())
    # ``from ...capture_errors import capture_error`` (relative, three levels) at module level ...
    assert "marft_bridge.capture_errors" in g["marft_bridge.integrations.langgraph.channels"]
    # ... ``from . import channels as kinds`` (a submodule by name) ...
    assert "marft_bridge.integrations.langgraph.channels" in g["marft_bridge.integrations.langgraph.precision"]
    # ... and ``from ...schema import utcnow`` inside a method.
    assert "marft_bridge.schema" in g["marft_bridge.integrations.langgraph.tools"]


def test_the_module_graph_is_acyclic():
    g = edges(module_names())
    found = {" / ".join(c): cycle_edges(g, c) for c in cycles(g)}
    assert found == {}, found


def test_a_cycle_is_found_with_its_edges():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycle_edges(g, ["a", "b", "c"]) == ["a -> b", "b -> c", "c -> a"]

"""No import cycle among mtds's modules.

The graph is read from the source with ``ast`` (nothing is imported): an edge A -> B for every
``import``/``from ... import`` in A that names mtds module B, wherever it sits in A: at module level,
inside a function, or under ``if TYPE_CHECKING:``. Function-level imports count because a deferred
import is how a circle is usually hidden, not removed: the two modules still need each other, and
the order they may first be imported in still matters. ``from mtds.x import y`` is an edge to
``mtds.x.y`` when that is a module, else to ``mtds.x``. A package's ``__init__`` is its own node:
importing ``mtds.a.b`` runs ``mtds/a/__init__.py`` too, but an edge is drawn only where a name is
imported, so a package that re-exports its submodules does not make every sibling import a cycle.
"""
from __future__ import annotations

from lab.import_graph import import_graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One concrete circle inside a component, for the failure message: a -> b -> ... -> a."""
    members, start = set(component), component[0]
    parents = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                chain = [v]
                while parents[chain[-1]] is not None:
                    chain.append(parents[chain[-1]])
                return " -> ".join(reversed(chain)) + f" -> {start}"
            if w not in parents:
                parents[w] = v
                queue.append(w)
    return " <-> ".join(component)


def test_the_cycle_finder_sees_a_circle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "mtds"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from mtds.sub.a import thing\n")
    (pkg / "c.py").write_text("import mtds.sub.a\n")
    graph = import_graph(pkg)
    assert graph["mtds.sub.a"] == {"mtds.sub.b"} and graph["mtds.c"] == {"mtds.sub.a"}
    assert cycles(graph) == [["mtds.sub.a", "mtds.sub.b"]]


def test_no_import_cycle_among_mtds_modules():
    graph = import_graph()
    assert len(graph) > 100 and graph["mtds.training.job"], "the graph was not read"
    found = cycles(graph)
    assert not found, "import cycles (break each by moving the shared piece down a layer):\n" + "\n".join(
        _path(graph, c) for c in found)


def test_no_folder_imports_a_higher_layer():
    """The house's floors (lab/import_graph.py LAYERS): a folder imports its own layer and those below; a new
    folder must be given a layer before anything may import it or it anything."""
    from lab.import_graph import folder_graph, upward
    arrows = folder_graph(import_graph())
    assert len(arrows) > 30, "the folder graph was not read"
    assert upward(arrows) == [], "arrows up a layer (move the shared piece down, or the folder up):\n" + "\n".join(
        f"{a} -> {b} ({n} imports)" for a, b, n in upward(arrows))
